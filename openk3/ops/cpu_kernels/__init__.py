"""CPU decode kernels (`decode_kernels.c`), built on first use with the system C compiler and called via ctypes:

    y = linear_gemv(x, W)                  # x [..., I] bf16, at most MAX_ROWS rows; W [O, I] bf16 -> [..., O] bf16
    y = experts(z, w1s, w3s, w2s, w, ...)  # one token's k experts (fp32 or bf16), fused: [1, Lt] -> [1, Lt]

The plain references are `torch.nn.functional.linear` and the torch expert path of model/moe.py (and DenseMLP);
`ops.dispatch` picks between them ("ref" / "gemv", "ref" / "fused") and falls back to the reference for anything a
kernel does not take (other dtypes, more rows, autograd, non-CPU tensors, or no compiler). Why they exist and how
they round: the C file's header.

The library is compiled once per source and machine into `$OPENK3_CACHE` (default `~/.cache/openk3`) with
`-O3 -march=native -fopenmp` (`$CC`, default `cc`), written atomically, and loaded after torch, so its OpenMP calls
resolve to the libgomp torch already loaded (one thread pool; `torch.set_num_threads` governs both). A failed build
is logged once and the reference is used from then on.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading

import torch

log = logging.getLogger(__name__)

MAX_ROWS = 8  # the C kernel's MAX_ROWS: decode and small verify batches; larger inputs are GEMMs for torch
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode_kernels.c")
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed: str | None = None  # why the build or load failed (then the reference is used)


def _cache_dir() -> str:
    return os.environ.get("OPENK3_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "openk3")


def _cpu_id() -> str:
    """What -march=native depends on: the CPU's model and flags (a cache shared across machines must not hand one
    machine another's instructions)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith(("model name", "flags", "Features"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _build() -> ctypes.CDLL:
    with open(_SOURCE, "rb") as f:
        source = f.read()
    cc = os.environ.get("CC", "cc")
    flags = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
    libs = ["-lm"]
    key = hashlib.sha256(source + " ".join([cc, *flags, platform.machine(), _cpu_id()]).encode()).hexdigest()
    folder = _cache_dir()
    path = os.path.join(folder, f"decode_kernels-{key[:16]}.so")
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        try:
            done = subprocess.run([cc, *flags, _SOURCE, "-o", tmp, *libs], capture_output=True, text=True, timeout=120, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-500:]}")
            os.replace(tmp, path)  # atomic: a concurrent build writes the same bytes
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(path)
    fn = lib.openk3_gemv_bf16
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    fn = lib.openk3_experts
    ptrs = ctypes.POINTER(ctypes.c_void_p)
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ptrs, ptrs, ptrs, ctypes.c_void_p, ctypes.c_float, ctypes.c_float, ctypes.c_void_p]  # fmt: skip
    fn.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first call; None if it cannot be built here (logged once)."""
    global _lib, _failed
    if _lib is None and _failed is None:
        with _lock:
            if _lib is None and _failed is None:
                try:
                    _lib = _build()
                except (OSError, RuntimeError, subprocess.SubprocessError) as err:
                    _failed = f"{type(err).__name__}: {err}"
                    log.warning("the CPU decode kernels are unavailable (%s); decode uses the torch path", _failed)
    return _lib


def available() -> bool:
    return library() is not None


def _plain(t: torch.Tensor) -> bool:
    """A CPU tensor of plain storage (not a DTensor shard, a meta or a subclass tensor) that autograd does not need."""
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.device.type == "cpu"
        and not (torch.is_grad_enabled() and t.requires_grad)
    )


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear_gemv` takes these operands (else the caller uses the reference)."""
    return (
        x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and _plain(x)
        and _plain(weight)
        and weight.dim() == 2
        and weight.is_contiguous()
        and x.shape[-1] == weight.shape[1]
        and 0 < x.numel() // max(x.shape[-1], 1) <= MAX_ROWS
    )


def linear_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` (no bias) by the C kernel; the caller checked `applies` and `available`."""
    O, I = weight.shape
    x2 = x.reshape(-1, I).contiguous()
    y = torch.empty(x2.shape[0], O, dtype=torch.bfloat16)
    rc = _lib.openk3_gemv_bf16(x2.data_ptr(), weight.data_ptr(), y.data_ptr(), x2.shape[0], O, I)
    if rc:
        raise RuntimeError(f"openk3_gemv_bf16 refused rows={x2.shape[0]} (at most {MAX_ROWS})")
    return y.view(*x.shape[:-1], O)


def experts_apply(z_TL: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """Whether `experts` takes this input and these expert matrices: one token, fp32 or bf16 throughout."""
    dtype = z_TL.dtype
    return (
        dtype in (torch.float32, torch.bfloat16)
        and z_TL.dim() == 2
        and z_TL.shape[0] == 1
        and _plain(z_TL)
        and all(w.dtype == dtype and w.is_contiguous() and _plain(w) for w in weights)
    )


def experts(z_1L: torch.Tensor, w1s: list[torch.Tensor], w3s: list[torch.Tensor], w2s: list[torch.Tensor],
            weights_k: torch.Tensor | None, beta: float, linear_beta: float) -> torch.Tensor:  # fmt: skip
    """One token's k experts [F, I] / [O, F] (views of the stacked weights), SiTU-GLU, weighted by `weights_k` (fp32
    [k]) and added in the given order: [1, O] in z's dtype. `weights_k=None` with k = 1: the plain MLP output. The
    caller checked `experts_apply` and `available`."""
    k = len(w1s)
    F_, I = w1s[0].shape
    O = w2s[0].shape[0]
    z = z_1L.contiguous()
    y = torch.empty(1, O, dtype=z.dtype)
    arrays = [(ctypes.c_void_p * k)(*[w.data_ptr() for w in ws]) for ws in (w1s, w3s, w2s)]
    wts = None if weights_k is None else weights_k.to(torch.float32).contiguous()
    rc = _lib.openk3_experts(int(z.dtype == torch.bfloat16), z.data_ptr(), I, F_, O, k, *arrays,
                             None if wts is None else wts.data_ptr(), beta, linear_beta, y.data_ptr())  # fmt: skip
    if rc:
        raise RuntimeError(f"openk3_experts refused k={k} (weights {'absent' if wts is None else 'given'})")
    return y

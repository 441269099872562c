"""CPU decode kernels (`decode_kernels.c`), built on first use with the system C compiler and called via ctypes:

    y = linear_gemv(x, W)                  # x [..., I] bf16, at most MAX_ROWS rows; W [O, I] bf16 -> [..., O] bf16
    y = experts(z, w1s, w3s, w2s, w, ...)  # one token's k experts (fp32 or bf16), fused: [1, Lt] -> [1, Lt]
    KDADecode(weights...)(x, io)           # a whole KDA layer's decode step (projections to o_proj), state in io
    MoEDecode(weights...)(x, routes)       # a StableLatentMoE layer's decode step (router, experts, shared experts)
    MLADecode(weights...).inputs(x)        # a gated MLA layer's decode step: its projections and norms ...
    MLADecode(weights...).output(q, ...)   # ... then, after the cache append, attention and the gated o_proj
    MixNorm(weights...)(sources)           # a Block AttnRes mix and the RMSNorm after it, for decode rows

The layer kernels are classes: their weights are checked and turned into ctypes arguments once (`packs` caches an
instance per module while its weights stay the same tensors), and each call checks only its inputs (`applies`).
The plain references are `torch.nn.functional.linear`, the torch expert path of model/moe.py (and DenseMLP), the
torch paths of model/kda.py and model/moe.py and `norm(attnres.mix(...))`; `ops.dispatch` picks between them ("ref" / "gemv",
"ref" / "fused") and falls back to the reference for anything a kernel does not take (other dtypes, more rows, autograd, non-CPU tensors, or no compiler). Why they exist and how
they round: the C file's header.

The library is built once per source, build and machine into `$OPENK3_CACHE` (default `~/.cache/openk3`) with the
system C compiler (`$CC`, default `cc`), written atomically, and loaded after torch, so its OpenMP calls resolve to
the libgomp torch already loaded (one thread pool; `torch.set_num_threads` governs both). Builds (`ISA_FLAGS`):
"avx512" (`-march=native`, 512-bit vectors), "avx2" (`-march=native -mno-avx512f`: AVX2 + FMA) and "portable" (no
intrinsics: the compiler vectorizes the C for its default target; on Arm the native one, NEON). The best this CPU
runs is built (`ops.cpu_features`), or the one `$OPENK3_CPU_ISA` names; `use_isa` swaps builds (tests run every
build the machine runs). Where the compiler takes no `-fopenmp` (Apple clang) or no `-march=native`, the build
goes on without them and logs the compiler's words; a build that fails outright (a compile error) is logged once
with the compiler's message (`failure()`) and the reference is used from then on.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator

import torch

from openk3.ops.cpu_features import features

log = logging.getLogger(__name__)

MAX_ROWS = 8  # the C kernel's MAX_ROWS: decode and small verify batches; larger inputs are GEMMs for torch
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode_kernels.c")
ISA_FLAGS = {"avx512": ["-march=native", "-mprefer-vector-width=512"], "avx2": ["-march=native", "-mno-avx512f"],
             "portable": []}  # fmt: skip
BASE_FLAGS = ["-O3", "-shared", "-fPIC", "-std=c11"]
OPENMP_FLAG = "-fopenmp"
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None  # the build in use (`library()`, swapped by `use_isa`)
_libs: dict[str, ctypes.CDLL] = {}  # every build loaded, by ISA
_builds: dict[str, dict] = {}  # by ISA: how it was built (flags, openmp, notes) or why it failed ("error")
_default: str | None = None  # the ISA of the default build (`default_isa()`, chosen on first use)
_failed: str | None = None  # why the default build failed (then the reference is used)


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


def compiler() -> str | None:
    """The C compiler's path (`$CC`, default `cc`), or None where there is none."""
    return shutil.which(os.environ.get("CC", "cc"))


def default_isa() -> str:
    """The build `library()` loads: `$OPENK3_CPU_ISA` (one of `ISA_FLAGS`, checked against this CPU), else the
    best this CPU runs."""
    runnable = features().isas()
    isa = os.environ.get("OPENK3_CPU_ISA", "").strip().lower() or "auto"
    if isa == "auto":
        return runnable[0]
    if isa not in ISA_FLAGS:
        raise ValueError(f"OPENK3_CPU_ISA={isa!r} is not one of {['auto', *ISA_FLAGS]}")
    if isa not in runnable:
        raise ValueError(f"OPENK3_CPU_ISA={isa!r}: this CPU runs only {list(runnable)} ({features().summary()})")
    return isa


def compile_source(cc: str, flags: list[str], out: str, source: str | None = None) -> subprocess.CompletedProcess:
    """`cc flags source -o out -lm`: one compile of the kernel source (also for other targets, e.g. a cross
    compiler in the tests)."""
    return subprocess.run([cc, *BASE_FLAGS, *flags, source or _SOURCE, "-o", out, "-lm"], capture_output=True, text=True,
                          timeout=180, check=False)  # fmt: skip


def _attempts(isa: str) -> list[tuple[list[str], str]]:
    """The flag sets to try in order, each with the note logged when a later one is the one that built: the ISA's
    flags with OpenMP, then without OpenMP (a compiler that has none, e.g. Apple clang); the portable build also
    without `-march=native` (a compiler that does not take it)."""
    march = ISA_FLAGS[isa]
    if isa == "portable" and not features().x86:
        march = ["-march=native"]  # Arm and others: the portable C, vectorized for this CPU (NEON)
    tries = [([*march, OPENMP_FLAG], ""), (march, "without OpenMP (one thread)")]
    if isa == "portable" and march:
        tries += [([OPENMP_FLAG], "without -march=native"), ([], "without -march=native or OpenMP (one thread)")]
    return tries


def _build(isa: str) -> tuple[ctypes.CDLL, dict]:
    """Build (or find in the cache) and load the `isa` library: (the library, how it was built)."""
    with open(_SOURCE, "rb") as f:
        source = f.read()
    cc = compiler()
    if cc is None:
        raise RuntimeError(f"no C compiler: {os.environ.get('CC', 'cc')!r} is not on PATH")
    folder = _cache_dir()
    errors = []
    for flags, note in _attempts(isa):
        key = hashlib.sha256(source + " ".join([cc, *BASE_FLAGS, *flags, platform.machine(), _cpu_id()]).encode())
        path = os.path.join(folder, f"decode_kernels-{isa}-{key.hexdigest()[:16]}.so")
        if not os.path.exists(path):
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
            os.close(fd)
            try:
                done = compile_source(cc, flags, tmp)
                if done.returncode != 0:
                    errors.append(f"{cc} {' '.join(flags)}: {done.stderr.strip()[-1500:]}")
                    continue
                os.replace(tmp, path)  # atomic: a concurrent build writes the same bytes
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        lib = ctypes.CDLL(path)
        _declare(lib)
        built = lib.openk3_isa().decode()
        if not built.startswith(isa):
            raise RuntimeError(f"the {isa!r} build compiled the {built!r} path ({cc} {' '.join(flags)})")
        record = {"isa": built, "compiler": cc, "flags": flags, "openmp": OPENMP_FLAG in flags, "path": path,
                  "note": note}  # fmt: skip
        if errors:
            log.warning("the %s CPU kernels were built %s; the compiler said: %s", isa, note, errors[0])
        return lib, record
    raise RuntimeError("; ".join(errors[:1]))  # every attempt fails alike on a compile error: the first says why


def _declare(lib: ctypes.CDLL) -> None:
    """The C functions' signatures."""
    lib.openk3_isa.argtypes, lib.openk3_isa.restype = [], ctypes.c_char_p
    fn = lib.openk3_gemv_bf16
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    fn = lib.openk3_experts
    ptrs = ctypes.POINTER(ctypes.c_void_p)
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ptrs, ptrs, ptrs, ctypes.c_void_p, ctypes.c_float, ctypes.c_float, ctypes.c_void_p]  # fmt: skip
    fn.restype = ctypes.c_int
    i64, f32, vp = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    fn = lib.openk3_kda_decode
    fn.argtypes = [ctypes.c_int, i64, i64, i64, i64, i64, vp, ptrs, vp, vp, ptrs, vp, vp, ptrs, vp, vp, ptrs, vp, vp,
                   f32, vp, f32, f32, vp]  # fmt: skip
    fn.restype = ctypes.c_int
    fn = lib.openk3_moe_decode
    fn.argtypes = [ctypes.c_int, i64, i64, i64, i64, i64, i64, vp, vp, vp, ctypes.c_int, f32, ctypes.c_int, vp, vp, vp,
                   vp, vp, vp, vp, vp, f32, vp, vp, vp, vp, f32, f32, vp]  # fmt: skip
    fn.restype = ctypes.c_int
    fn = lib.openk3_mla_decode_in
    fn.argtypes = [ctypes.c_int, i64, i64, i64, i64, i64, i64, i64, vp, vp, vp, vp, vp, vp, vp, f32, vp, vp, vp]
    fn.restype = ctypes.c_int
    fn = lib.openk3_mla_decode_out
    fn.argtypes = [ctypes.c_int, i64, i64, i64, i64, i64, i64, i64, i64, vp, vp, vp, vp, vp, f32, vp, vp, vp]
    fn.restype = ctypes.c_int
    fn = lib.openk3_mix_norm
    fn.argtypes = [ctypes.c_int, i64, i64, i64, ptrs, vp, vp, f32, vp, f32, vp]
    fn.restype = ctypes.c_int
    fn = lib.openk3_decode_stack  # layers: an array of stack.LayerArgs; the MLA rows: a stack.MLARows
    fn.argtypes = [ctypes.c_int, i64, i64, i64, vp, vp, ptrs, ctypes.POINTER(ctypes.c_double), vp, vp]
    fn.restype = ctypes.c_int


def build(isa: str) -> ctypes.CDLL:
    """The library built for `isa` (one of `ISA_FLAGS`), built and loaded once per process; raises RuntimeError
    with the compiler's message where it cannot be built."""
    with _lock:
        if isa not in _libs:
            if "error" in _builds.get(isa, {}):
                raise RuntimeError(_builds[isa]["error"])
            try:
                _libs[isa], _builds[isa] = _build(isa)
            except (OSError, RuntimeError, subprocess.SubprocessError) as err:
                _builds[isa] = {"error": f"{type(err).__name__}: {err}"}
                raise RuntimeError(_builds[isa]["error"]) from err
        return _libs[isa]


def library() -> ctypes.CDLL | None:
    """The kernel library calls use (the default build, or `use_isa`'s), building the default on first call; None
    if it cannot be built here (logged once)."""
    global _lib, _failed, _default
    if _default is None and _failed is None:
        try:
            isa = default_isa()
            lib = build(isa)
        except (RuntimeError, ValueError) as err:
            _failed = str(err)
            log.warning("the CPU decode kernels are unavailable (%s); decode uses the torch path", _failed)
        else:
            _default = isa
            if _lib is None:
                _lib = lib
    return _lib


def available() -> bool:
    return library() is not None


def failure() -> str | None:
    """Why the kernels are unavailable (the compiler's message, or that there is no compiler); None if built."""
    library()
    return _failed


def info() -> dict:
    """What decode runs on this machine: the CPU's features, the builds it runs, the default build (ISA, compiler,
    flags, OpenMP) or why there is none."""
    built = library() is not None
    return {"cpu": features().summary(), "runnable": list(features().isas()), "isa": _default if built else None,
            "build": dict(_builds[_default]) if built else None, "error": _failed}  # fmt: skip


@contextlib.contextmanager
def use_isa(isa: str) -> Iterator[ctypes.CDLL]:
    """Every kernel call inside the block runs the `isa` build (tests compare each build the CPU runs with the
    reference); raises RuntimeError if it cannot be built."""
    global _lib
    library()  # the default first: it is what the block's end puts back
    lib = build(isa)
    previous = _lib
    _lib = lib
    try:
        yield lib
    finally:
        _lib = previous


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _plain(t: torch.Tensor) -> bool:
    """A CPU tensor of plain storage (not a DTensor shard, a meta or a subclass tensor) that autograd does not need."""
    return type(t) in _PLAIN_TYPES and t.is_cpu and not (t.requires_grad and torch.is_grad_enabled())


def _usable(tensors, dtype: torch.dtype) -> bool:
    """Every tensor `_plain`, contiguous and of `dtype` (one loop: these checks run on every decode call)."""
    grad = torch.is_grad_enabled()
    for t in tensors:
        if (t.dtype != dtype or type(t) not in _PLAIN_TYPES or not t.is_cpu or not t.is_contiguous()
                or (grad and t.requires_grad)):  # fmt: skip
            return False
    return True


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


def _pointers(tensors) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])


def _rows(x: torch.Tensor, dtype: torch.dtype, D: int) -> bool:
    """x [N, D] of `dtype`, 0 < N <= MAX_ROWS, `_usable`: the per-call check of a prepared layer kernel's input (its
    weights were checked when it was prepared)."""
    return x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.shape[1] == D and _usable((x,), dtype)


def weights_apply(tensors: list[torch.Tensor], fp32_tensors: list[torch.Tensor] = ()) -> bool:
    """Whether a layer kernel takes these matrices and norm weights (one dtype, fp32 or bf16) and these fp32 tensors
    (the router bias, conv weights, ...): contiguous plain CPU tensors without autograd."""
    if not tensors:
        return False
    dtype = tensors[0].dtype
    return dtype in (torch.float32, torch.bfloat16) and _usable(tensors, dtype) and _usable(fp32_tensors, torch.float32)


# ---- prepared layer kernels ----------------------------------------------------------------------------------------
# Each class takes a layer's weights once (the caller checked `weights_apply`; `ops.cpu_kernels.packs` caches the
# instance per module) and is then called per decode step with that step's inputs, after `applies(...)`.

KDA_MAX_HEAD_DIM = 512  # the C kernel's bound on the KDA head dim (K3: 128)


class KDADecode:
    """A whole KDA layer's decode step (the C file's `openk3_kda_decode`), x [N, D] -> o_proj's output [N, D].
    `projections` = W_q, W_k, W_v, W_g [P, D], W_fa [K, D], W_b [H, D]; w_fb [P, K]; w_o [D, P]; conv_w [P, 1, W]
    each, A_log [H], dt_bias [P], norm_w [K]: fp32. Per call, `io` (model.cache.KDAInOut) says where each
    sequence's conv tails and state are read and written (then `io.commit()` is the caller's)."""

    def __init__(self, projections: list[torch.Tensor], w_fb: torch.Tensor, w_o: torch.Tensor,
                 conv_w: list[torch.Tensor], A_log_H: torch.Tensor, dt_bias_P: torch.Tensor, lower_bound: float,
                 norm_w_K: torch.Tensor, eps: float, scale: float) -> None:  # fmt: skip
        self.dtype = w_o.dtype
        self.D, self.P, self.W, self.H = w_o.shape[0], w_o.shape[1], conv_w[0].shape[-1], A_log_H.shape[0]
        self._weights = (_pointers(projections), w_fb.data_ptr(), w_o.data_ptr())
        self._params = (_pointers(conv_w), A_log_H.data_ptr(), dt_bias_P.data_ptr(), lower_bound, norm_w_K.data_ptr(),
                        eps, scale)  # fmt: skip

    def applies(self, x_ND: torch.Tensor, io) -> bool:
        """x [N, D] of the weights' dtype, and `applies_io`."""
        return _rows(x_ND, self.dtype, self.D) and self.applies_io(io)

    def applies_io(self, io) -> bool:
        """The conv tails of `io` of the weights' dtype, its states fp32 [*, H, K, K] with H K = P and K within the
        kernel's bound."""
        _, H, K, _ = io.state_in.shape
        return (
            H == self.H
            and H * K == self.P
            and K <= KDA_MAX_HEAD_DIM
            and _usable((*io.tails_in, *io.tails_out), self.dtype)
            and _usable((io.state_in, io.state_out), torch.float32)
        )

    @staticmethod
    def io_args(io) -> tuple:
        """`openk3_kda_decode`'s cache arguments for `io`: (tails in, state in, rows in, tails out, state out, rows
        out), the tails and rows as ctypes arrays (the caller keeps them alive through the call)."""
        N = len(io.rows_in)
        return (_pointers(io.tails_in), io.state_in.data_ptr(), (ctypes.c_int64 * N)(*io.rows_in),
                _pointers(io.tails_out), io.state_out.data_ptr(), (ctypes.c_int64 * N)(*io.rows_out))  # fmt: skip

    def __call__(self, x_ND: torch.Tensor, io) -> torch.Tensor:
        N = x_ND.shape[0]
        _, H, K, _ = io.state_in.shape
        out = torch.empty_like(x_ND)
        rc = _lib.openk3_kda_decode(int(self.dtype == torch.bfloat16), N, self.D, H, K, self.W, x_ND.data_ptr(),
                                    *self._weights, *self.io_args(io), *self._params, out.data_ptr())  # fmt: skip
        if rc:
            raise RuntimeError(f"openk3_kda_decode refused N={N} (at most {MAX_ROWS}) H={H} K={K} W={self.W}")
        return out


MIX_MAX_SOURCES = 64  # the C kernel's bound on AttnRes sources (the bank plus the partial sum)


class MixNorm:
    """RMSNorm(attn_res_mix(sources[:-1], sources[-1], mix_w, query, mix_eps); norm_w, norm_eps) for [T, D] sources
    (the bank in order, the partial sum last) in one call (the C file's `openk3_mix_norm`); `norm_w=None` returns
    the mix itself."""

    def __init__(self, mix_w: torch.Tensor, query: torch.Tensor, mix_eps: float, norm_w: torch.Tensor | None,
                 norm_eps: float) -> None:  # fmt: skip
        self.dtype, self.D = mix_w.dtype, mix_w.numel()
        self._args = (mix_w.data_ptr(), query.data_ptr(), mix_eps, None if norm_w is None else norm_w.data_ptr(),
                      norm_eps)  # fmt: skip

    def applies(self, sources: list[torch.Tensor]) -> bool:
        """Sources [T, D] alike (at most MAX_ROWS rows, MIX_MAX_SOURCES of them) of the weights' dtype."""
        first = sources[0]
        return (
            len(sources) <= MIX_MAX_SOURCES
            and _rows(first, self.dtype, self.D)
            and _usable(sources, self.dtype)
            and all(s.shape == first.shape for s in sources)
        )

    def __call__(self, sources: list[torch.Tensor]) -> torch.Tensor:
        T, D = sources[0].shape
        out = torch.empty_like(sources[0])
        rc = _lib.openk3_mix_norm(int(self.dtype == torch.bfloat16), T, D, len(sources), _pointers(sources),
                                  *self._args, out.data_ptr())  # fmt: skip
        if rc:
            raise RuntimeError(f"openk3_mix_norm failed ({rc}) for T={T} D={D} S={len(sources)}")
        return out


MOE_MAX_TOP_K = 64  # the C kernel's bounds
MOE_MAX_EXPERTS = 8192


class MoEDecode:
    """A StableLatentMoE layer's decode step, one kernel call per token (the C file's `openk3_moe_decode`): the
    router (sigmoid scores of W_gate [E, D], the top-k of scores + bias_E with ties to the lower expert id, or the
    replayed routes), the down projection, the experts of the stacked w1, w3 [E, F, Lt] and w2 [E, Lt, F] and their
    weighted sum, the latent norm, the up projection and the shared experts (gate, up, down matrices, or None).
    A call returns (out [T, D], router scores [T, E] fp32, experts [T, k] int64 ascending)."""

    def __init__(self, w_gate: torch.Tensor, bias_E: torch.Tensor, top_k: int, renormalize: bool, scaling: float,
                 w_down: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, norm_w: torch.Tensor,
                 norm_eps: float, w_up: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
                 beta: float, linear_beta: float) -> None:  # fmt: skip
        E, F_, Lt = w1.shape
        if not 0 < top_k <= min(E, MOE_MAX_TOP_K) or E > MOE_MAX_EXPERTS:
            raise ValueError(f"moe_decode takes 0 < top_k <= min(E, {MOE_MAX_TOP_K}) and E <= {MOE_MAX_EXPERTS}, "
                             f"got top_k={top_k}, E={E}")  # fmt: skip
        self.dtype, self.D, self.E, self.top_k = w_gate.dtype, w_gate.shape[1], E, top_k
        gate, up, down = shared if shared is not None else (None, None, None)
        Fs = 0 if gate is None else gate.shape[0]
        self._dims = (int(self.dtype == torch.bfloat16), self.D, Lt, F_, Fs, E, top_k)
        self._router = (w_gate.data_ptr(), bias_E.data_ptr(), int(renormalize), scaling)
        self._rest = (w_down.data_ptr(), w1.data_ptr(), w3.data_ptr(), w2.data_ptr(), norm_w.data_ptr(), norm_eps,
                      w_up.data_ptr(), *(None if t is None else t.data_ptr() for t in (gate, up, down)), beta,
                      linear_beta)  # fmt: skip

    def applies(self, x_TD: torch.Tensor) -> bool:
        return _rows(x_TD, self.dtype, self.D)

    def __call__(self, x_TD: torch.Tensor, routes_Tk: torch.Tensor | None = None):
        T, D = x_TD.shape
        E, top_k = self.E, self.top_k
        out = torch.empty(T, D, dtype=x_TD.dtype)
        scores = torch.empty(T, E, dtype=torch.float32)
        weights = torch.empty(T, top_k, dtype=torch.float32)
        if routes_Tk is None:
            idx = torch.empty(T, top_k, dtype=torch.int64)
        else:
            idx = routes_Tk.to(torch.int64).sort(dim=-1).values.contiguous()
        size = x_TD.element_size()
        x, o, s, w, i = x_TD.data_ptr(), out.data_ptr(), scores.data_ptr(), weights.data_ptr(), idx.data_ptr()
        for t in range(T):
            rc = _lib.openk3_moe_decode(*self._dims, x + t * D * size, *self._router, int(routes_Tk is not None),
                                        i + t * top_k * 8, s + t * E * 4, w + t * top_k * 4, *self._rest,
                                        o + t * D * size)  # fmt: skip
            if rc == 3:
                raise ValueError(f"routed experts of token {t} must be {top_k} distinct ids in [0, {E}), got "
                                 f"{routes_Tk[t].tolist()}")  # fmt: skip
            if rc:
                raise RuntimeError(f"openk3_moe_decode failed ({rc}) for top_k={top_k}, E={E}")
        return out, scores, idx


class MLADecode:
    """A gated MLA layer's decode step in two calls around the cache append (the C file's `openk3_mla_decode_in`
    and `openk3_mla_decode_out`): `inputs(x [N, D])` -> (queries [N, H * (nope + rope)], the new latents
    [N, r + rope] = [normed c ; k_pe], g_proj's output [N, H * Dv]); then `output(q, latents [N, S, R] (sequence
    n's first lens[n]), lens, W_uk [H, nope, r], W_uv^T [H, r, Dv] (fp32, of `absorbed_weights`), scale, g)` ->
    the attention in the absorbed form, the sigmoid gate and o_proj: [N, D]."""

    def __init__(self, w_qa: torch.Tensor, qa_norm: torch.Tensor, w_qb: torch.Tensor, w_kva: torch.Tensor,
                 kv_norm: torch.Tensor, w_g: torch.Tensor, w_o: torch.Tensor, eps: float) -> None:  # fmt: skip
        self.dtype, self.D = w_qa.dtype, w_qa.shape[1]
        self.Q, self.R, self.r, self.G = w_qb.shape[0], w_kva.shape[0], kv_norm.shape[0], w_g.shape[0]
        self._in = (self.D, w_qa.shape[0], self.Q, self.R, self.r, self.G)
        self._in_weights = (w_qa.data_ptr(), qa_norm.data_ptr(), w_qb.data_ptr(), w_kva.data_ptr(),
                            kv_norm.data_ptr(), w_g.data_ptr(), eps)  # fmt: skip
        self._w_o = w_o.data_ptr()

    def applies(self, x_ND: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor) -> bool:
        return _rows(x_ND, self.dtype, self.D) and _usable((w_uk, w_uv), torch.float32)

    def inputs(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        N = x_ND.shape[0]
        q, latent, g = (torch.empty(N, n, dtype=x_ND.dtype) for n in (self.Q, self.R, self.G))
        rc = _lib.openk3_mla_decode_in(int(self.dtype == torch.bfloat16), N, *self._in, x_ND.data_ptr(),
                                       *self._in_weights, q.data_ptr(), latent.data_ptr(), g.data_ptr())  # fmt: skip
        if rc:
            raise RuntimeError(
                f"openk3_mla_decode_in refused N={N} (at most {MAX_ROWS}), r={self.r}, r + rope={self.R}"
            )
        return q, latent, g

    def output(self, q_NQ: torch.Tensor, latent_NSR: torch.Tensor, lens: list[int], w_uk: torch.Tensor,
               w_uv: torch.Tensor, scale: float, g_NG: torch.Tensor) -> torch.Tensor:  # fmt: skip
        N, S, R = latent_NSR.shape
        H, nope, r = w_uk.shape
        Dv = w_uv.shape[2]
        out = torch.empty(N, self.D, dtype=q_NQ.dtype)
        lens_arr = (ctypes.c_int64 * N)(*lens)
        latent = latent_NSR.contiguous()
        rc = _lib.openk3_mla_decode_out(int(self.dtype == torch.bfloat16), N, H, nope, R - r, r, Dv, self.D, S,
                                        q_NQ.data_ptr(), latent.data_ptr(), lens_arr, w_uk.data_ptr(),
                                        w_uv.data_ptr(), scale, g_NG.data_ptr(), self._w_o, out.data_ptr())  # fmt: skip
        if rc:
            raise RuntimeError(f"openk3_mla_decode_out failed ({rc}) for N={N}, S={S}, lengths {lens}")
        return out

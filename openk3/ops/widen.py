"""bf16 products on a CPU without bf16 arithmetic, computed in fp32.

Without bf16 arithmetic (`ops.cpu_features`: no AVX512-BF16, AMX-BF16 or Arm BF16) torch's bf16 matmul on CPU
falls to a slow path: on an AVX2 CPU it ran at 0.8-1.1 GFLOP/s against 148 GFLOP/s in fp32. Wherever the model
multiplies in bf16 there -- bf16 tensors, or fp32 ones under bf16 autocast -- the product is computed from the bf16
operands with fp32 accumulation and rounded to bf16 once. That is what torch's bf16 GEMM computes as well, so the
two differ only in summation order. Without autograd, `linear` calls MKL's bf16 GEMM (`cblas_gemm_bf16bf16f32`,
exported by torch's own CPU library on x86), which widens the operands while it packs them and runs as fast as the
fp32 GEMM; where torch has no MKL it widens the weight to fp32 tile by tile (`TILE_BYTES` at a time) for torch's
fp32 GEMM. Either way the extra memory stays bounded whatever the matrix (a vocabulary head). With autograd the
operands are widened whole, as the backward needs them.

    widens(x, w)              -> whether a product of these operands is widened here
    linear(x, w, bias=None)   -> F.linear(x, w, bias) in bf16, computed in fp32
    matmul(a, b)              -> a @ b, computed in fp32 where `widens(a, b)`
    auto_dtype(dtype, device, fp32_bytes) -> (the dtype "auto" computes a `dtype` checkpoint in, why)

`auto_dtype` is the serving side of the same rule: a bf16 checkpoint served with dtype "auto" on such a CPU is
loaded as fp32 (its weights widened once) where the fp32 weights take at most `AUTO_MEMORY_SHARE` of the memory
available, and kept in bf16 otherwise (then every product is computed as above).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading

import torch
import torch.nn.functional as F

from openk3.ops.cpu_features import features
from openk3.utils import fp32_region

TILE_BYTES = 4 * 2**20  # fp32 bytes of a product tile (and of a widened weight tile): they stay in cache
MIN_TILE_ROWS = 64  # narrower tiles make the GEMMs inefficient
AUTO_MEMORY_SHARE = 0.5  # "auto" widens a bf16 checkpoint's weights once if the fp32 copy takes at most this share


def _bf16_product(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The product of x and w runs in bf16: both bf16, or floating under CPU bf16 autocast."""
    if x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16:
        return True
    return (
        torch.is_autocast_enabled("cpu")
        and torch.get_autocast_dtype("cpu") == torch.bfloat16
        and x.is_floating_point()
        and w.is_floating_point()
    )


def widens(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `linear` / `matmul` of these CPU operands computes a bf16 product in fp32 here (no bf16 arithmetic)."""
    return x.device.type == "cpu" and _bf16_product(x, w) and not features().bf16_native


class _Workspace(threading.local):
    """Per-thread fp32 buffers reused across calls (a widened weight tile, a tile of the product; each about
    TILE_BYTES): a fresh multi-MiB tensor costs its page faults every call (a 16 MiB widened tile took 8 ms to
    allocate and fill, 0.1 ms when reused)."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int) -> torch.Tensor:
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel:
            buf = self.buffers[name] = torch.empty(numel, dtype=torch.float32)
        return buf[:numel]


_workspace = _Workspace()
_INT32_MAX = 2**31 - 1


@functools.cache
def mkl_gemm_bf16():
    """MKL's `cblas_gemm_bf16bf16f32` (bf16 operands, fp32 accumulation and output), as torch's own CPU library
    exports it where torch is built with MKL (x86); None elsewhere. Measured on an AVX2 CPU without bf16
    arithmetic: as fast as MKL's fp32 GEMM on the same shapes (it widens while packing), with results bitwise
    equal to the widened fp32 product."""
    if not torch.backends.mkl.is_available():
        return None
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        fn = lib.cblas_gemm_bf16bf16f32
    except (OSError, AttributeError):
        return None
    i32, f32, vp = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    fn.argtypes = [i32, i32, i32, i32, i32, i32, f32, vp, i32, vp, i32, f32, vp, i32]
    fn.restype = None
    return fn


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, bias)` as a bf16 product, computed in fp32: x [..., I], w [O, I] -> [..., O] bf16. Operands
    of another dtype (fp32 under bf16 autocast) are rounded to bf16 first, as autocast rounds them. Without
    autograd: MKL's bf16 GEMM where torch has it (`mkl_gemm_bf16`), else torch's fp32 GEMM on w widened tile by
    tile; the product is made TILE_BYTES of output columns at a time, each rounded to bf16 as it is done."""
    O, I = w.shape
    with fp32_region():
        grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w, bias))
        if grad or x.device.type != "cpu" or x.numel() == 0 or O == 0:
            b32 = None if bias is None else bias.to(torch.bfloat16).float()
            return F.linear(x.to(torch.bfloat16).float(), w.to(torch.bfloat16).float(), b32).to(torch.bfloat16)
        M = x.numel() // I
        x2 = x.reshape(M, I).to(torch.bfloat16).contiguous()
        w = w.to(torch.bfloat16).contiguous()
        b32 = None if bias is None else bias.to(torch.bfloat16).float()
        out = torch.empty(M, O, dtype=torch.bfloat16)
        gemm = mkl_gemm_bf16() if max(M, O, I) <= _INT32_MAX else None
        # Rows of w per tile: the [M, rows] product (and in torch's path the rows' fp32 copy) within TILE_BYTES.
        per_row = 4 * M if gemm is not None else 4 * max(M, I)
        rows = min(O, max(MIN_TILE_ROWS, TILE_BYTES // per_row))
        y = _workspace.get("y", M * rows)
        x32 = None if gemm is not None else x2.float()
        for s in range(0, O, rows):
            n = min(rows, O - s)
            y_n = y[: M * n].view(M, n)
            if gemm is not None:  # row-major C [M, n] = x [M, I] . w[s:s+n]^T
                gemm(101, 111, 112, M, n, I, 1.0, x2.data_ptr(), I, w[s].data_ptr(), I, 0.0, y_n.data_ptr(), n)
            else:
                w32 = _workspace.get("w", n * I).view(n, I).copy_(w[s : s + n])
                torch.mm(x32, w32.t(), out=y_n)
            if b32 is not None:
                y_n += b32[s : s + n]
            out[:, s : s + n] = y_n  # rounds to nearest even
        return out.view(*x.shape[:-1], O)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b`; a bf16 product on a CPU without bf16 arithmetic is computed in fp32 and rounded to bf16 once."""
    if not widens(a, b):
        return a @ b
    with fp32_region():
        return (a.to(torch.bfloat16).float() @ b.to(torch.bfloat16).float()).to(torch.bfloat16)


def available_memory() -> int | None:
    """Bytes of memory available now (Linux MemAvailable), else the physical memory; None if neither is known."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def auto_dtype(
    dtype: torch.dtype | None, device: str | torch.device, fp32_bytes: int | None
) -> tuple[torch.dtype | None, str]:
    """The dtype a checkpoint that "auto" resolved to `dtype` is computed in on `device`, and why (for the log and
    `k3 info`): fp32 for bf16 on a CPU without bf16 arithmetic when its `fp32_bytes` of weights fit in
    `AUTO_MEMORY_SHARE` of the available memory, else `dtype` itself."""
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu":
        return dtype, f"{dtype} as the checkpoint declares"
    cpu = features()
    if cpu.bf16_native:
        return dtype, f"bf16: this CPU has bf16 arithmetic ({cpu.summary()})"
    avail = available_memory()
    gib = 2**30
    if fp32_bytes is not None and avail is not None and fp32_bytes > AUTO_MEMORY_SHARE * avail:
        return dtype, (f"bf16 weights, fp32 products: this CPU has no bf16 arithmetic, and the fp32 weights "
                       f"({fp32_bytes / gib:.1f} GiB) would take over {AUTO_MEMORY_SHARE:.0%} of the "
                       f"{avail / gib:.1f} GiB available, so each product widens its weight tile by tile")  # fmt: skip
    size = "" if fp32_bytes is None else f" ({fp32_bytes / gib:.2f} GiB in fp32)"
    return torch.float32, f"fp32: this CPU has no bf16 arithmetic, so the bf16 weights are widened once{size}"

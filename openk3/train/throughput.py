"""The machine's own ceiling, measured in the same process: the dense matmul rate that model FLOPs utilisation
(MFU = 6 * active parameters * tokens/s / matmul rate) is reported against."""

from __future__ import annotations

import time

import torch


def matmul_gflops(
    device: torch.device, dtype: torch.dtype = torch.float32, n: int = 1024, seconds: float = 0.3
) -> float:
    """Sustained GFLOP/s of an n x n x n matmul on `device` (best of a short timed loop)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    (a @ b).sum().item()  # warm-up (thread pool, allocator, kernel choice)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        (a @ b).sum().item()
        best = max(best, 2 * n**3 / (time.perf_counter() - start) / 1e9)
    return best

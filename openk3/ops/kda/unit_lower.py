"""The UT transform's inverse (I + L)⁻¹ for strictly lower-triangular L [..., C, C] (spec/kda.md §4.3), for the
three KDA tile paths. All three are exact to rounding (a triangular solve, no power series) and causal: row i of the
result depends only on rows ≤ i of L, which the prefix-invariance tests rely on.

One definition per algorithm; each path keeps its own because each rounds differently, and the paths' results
(and the fixed-seed training loss) are pinned bitwise:

    unit_lower_inverse          LAPACK solve_triangular        tile_ref (the readable reference), the log-space
                                                               baseline (benchmarks/kda_baselines.py)
    unit_lower_inverse_rows     forward substitution by rows   chunk (the fp32 fast path: model and training), and
                                                               chunk_bf16 when C is not a power of two
    unit_lower_inverse_blocked  block doubling, log₂ C steps   chunk_bf16 (C a power of two)

Why the fast paths do not call LAPACK: batched solves on thousands of 16×16 systems were slower and, with threads,
erratic (tens of times slower on some runs). Why the bf16 path does not substitute row by row: doubling needs log₂ C
batched products instead of C − 1 row steps, which matters beside its cheaper bf16 products.
Tested against an fp64 row-by-row substitution in tests/ops/test_kda.py.

Shapes: N batch of tiles (any leading dims), C tile rows.
"""

import torch

__all__ = ["unit_lower_inverse", "unit_lower_inverse_blocked", "unit_lower_inverse_rows"]


def unit_lower_inverse(L_NCC: torch.Tensor) -> torch.Tensor:
    """(I + L)⁻¹ by LAPACK's unit-triangular solve (the reference form)."""
    C = L_NCC.shape[-1]
    eye_CC = torch.eye(C, dtype=L_NCC.dtype, device=L_NCC.device)
    return torch.linalg.solve_triangular(eye_CC + L_NCC, eye_CC.expand_as(L_NCC), upper=False, unitriangular=True)


def unit_lower_inverse_rows(L_NCC: torch.Tensor) -> torch.Tensor:
    """(I + L)⁻¹ by forward substitution, one row at a time: row i = e_i − Σ_{j<i} L_ij · row j (C − 1 batched
    steps)."""
    C = L_NCC.shape[-1]
    Tinv = torch.eye(C, dtype=L_NCC.dtype, device=L_NCC.device).expand_as(L_NCC).contiguous()
    for i in range(1, C):
        Tinv[..., i, :i] = -(L_NCC[..., i, :i, None] * Tinv[..., :i, :i]).sum(-2)
    return Tinv


def unit_lower_inverse_blocked(L_NCC: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(I + L)⁻¹ for C a power of two by block forward substitution, written into `out` when given.

    Doubling the solved diagonal blocks: with T₁₁, T₂₂ the inverses of two adjacent s×s diagonal blocks,
    the 2s×2s block inverse is [[T₁₁, 0], [−T₂₂ L₂₁ T₁₁, T₂₂]].
    """
    C = L_NCC.shape[-1]
    assert C & (C - 1) == 0, C
    L = L_NCC.reshape(-1, C, C)
    N = L.shape[0]
    out = torch.empty_like(L_NCC) if out is None else out
    T = out.view(N, C, C).copy_(torch.eye(C, dtype=L.dtype, device=L.device))
    s = 1
    while s < C:
        T21 = _diagonal_blocks(T, s, s, 0)
        T21.copy_(-(_diagonal_blocks(T, s, s, s) @ _diagonal_blocks(L, s, s, 0) @ _diagonal_blocks(T, s, 0, 0)))
        s *= 2
    return out


def _diagonal_blocks(X_NCC: torch.Tensor, s: int, r0: int, c0: int) -> torch.Tensor:
    """The s×s sub-block at (r0, c0) of every 2s×2s diagonal block of X, as a strided [N, C/2s, s, s] view."""
    N, C, _ = X_NCC.shape
    stride = (C * C, 2 * s * (C + 1), C, 1)
    return X_NCC.as_strided((N, C // (2 * s), s, s), stride, X_NCC.storage_offset() + r0 * C + c0)

"""KDA tile reference: 16-token tiles with dense in-tile matmuls, one tile at a time (spec/kda.md §4.3, §5, §6).

Owns `kda_chunked_tiles`, the readable tile-by-tile chunked op that the fast path (`chunk.kda_chunked`) is tested
against; its UT inverse is the reference triangular solve, `unit_lower.unit_lower_inverse`. It must match
`ref.kda_recurrent` (the specification) to fp32 rounding. It is kept for reading and testing; the model calls the
fast path.

Math, per tile of C rows with entering state S₀, anchored at S₀ (cumsum restarts at the tile):
    Γ    = cumsum(g over the tile)                   Γ ≤ 0 and −Γ ≤ C·|lower_bound|
    Qd   = scale · Q ⊙ e^Γ    Kd = K ⊙ e^Γ    Ki = K ⊙ e^−Γ    Kr = K ⊙ e^(Γ_C − Γ)
    L    = StrictLower(Diag(β) Kd Kiᵀ)           Tinv = (I + L)⁻¹
    U    = Tinv Diag(β) (V − Kd S₀)
    O    = Qd S₀ + LowerInclDiag(Qd Kiᵀ) U
    S₀  ← Diag(e^Γ_C) S₀ + Krᵀ U
Ki reaches e^(C·|lower_bound|), so the op rejects C·|lower_bound| ≥ 88.72 (fp32 exp overflow, spec §5).

Why the layout is as it is (spec §6): the anchor depends only on data before the tile, a ragged last tile is
padded with neutral rows (q = k = v = 0, g = 0, β = 0), and every tile is a separate contiguous block of the
same shape. So outputs before a position never depend on later inputs, even in their rounding, and a
truncated or split run is bitwise a prefix of the full run (split at multiples of C).

Shapes: B batch, T tokens, H heads, K key dim, V value dim, N sequences (cu_seqlens), C tile rows,
n number of tiles.
"""

import torch
import torch.nn.functional as F

from openk3.ops.kda.ref import run_sequences
from openk3.ops.kda.unit_lower import unit_lower_inverse
from openk3.utils import FP32_EXP_LIMIT


def kda_chunked_tiles(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 16,
    lower_bound: float = -5.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tile-by-tile chunked KDA, same contract as `kda_recurrent`.

    `lower_bound` is the gate's bound (g ≥ lower_bound is the caller's promise, as produced by `kda_gate`);
    it is used only to check that the tile's anchor factors e^(chunk_size·|lower_bound|) fit in fp32.
    """
    check_tile(chunk_size, lower_bound)
    scale = q.shape[-1] ** -0.5 if scale is None else scale

    def sequence_fn(q, k, v, g, beta, S_BHKV, scale):
        return _chunked_sequence(q, k, v, g, beta, S_BHKV, scale, chunk_size)

    return run_sequences(sequence_fn, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)


def check_tile(chunk_size: int, lower_bound: float) -> None:
    """Reject tiles whose anchor factor e^(chunk_size * |lower_bound|) would overflow fp32 (spec/kda.md §5)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got chunk_size={chunk_size}")
    if chunk_size * abs(lower_bound) >= FP32_EXP_LIMIT:
        raise ValueError(
            f"chunk_size={chunk_size} with lower_bound={lower_bound}: the in-tile anchor factor "
            f"exp(chunk_size * |lower_bound|) = exp({chunk_size * abs(lower_bound):g}) overflows fp32; "
            f"need chunk_size * |lower_bound| < {FP32_EXP_LIMIT}"
        )


def _to_tiles(x_BTHD: torch.Tensor, C: int) -> torch.Tensor:
    """[B, T, H, D] -> [n, B, H, C, D], zero-padding T up to n·C; each tile is a contiguous block."""
    B, T, H, D = x_BTHD.shape
    n = -(-T // C)
    x_BTHD = F.pad(x_BTHD, (0, 0, 0, 0, 0, n * C - T))
    return x_BTHD.reshape(B, n, C, H, D).permute(1, 0, 3, 2, 4).contiguous()


def _chunked_sequence(q, k, v, g, beta, S_BHKV, scale, C):
    """kda_chunked for one run of tokens, all inputs already in the compute dtype."""
    B, T, H, _ = q.shape
    V = v.shape[-1]
    # Zero padding gives the neutral rows: k = 0 writes nothing, g = 0 keeps the state, q = 0 reads nothing.
    q_nBHCK, k_nBHCK, v_nBHCV, g_nBHCK = (_to_tiles(x, C) for x in (q, k, v, g))
    beta_nBHC1 = _to_tiles(beta[..., None], C)
    lower_CC = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict_lower_CC = lower_CC.tril(-1)

    o_tiles = []
    for i in range(q_nBHCK.shape[0]):
        k_BHCK, beta_BHC1 = k_nBHCK[i], beta_nBHC1[i]
        G_BHCK = g_nBHCK[i].cumsum(dim=-2)
        G_last_BH1K = G_BHCK[..., -1:, :]
        decay_BHCK = G_BHCK.exp()
        Qd_BHCK = (scale * q_nBHCK[i]) * decay_BHCK
        Kd_BHCK = k_BHCK * decay_BHCK
        Ki_BHCK = k_BHCK * (-G_BHCK).exp()
        Kr_BHCK = k_BHCK * (G_last_BH1K - G_BHCK).exp()

        # Above the diagonal Kd Kiᵀ and Qd Kiᵀ hold e^(positive) factors of later rows: large but finite
        # (the chunk_size check), and removed by selection (masked_fill), never by multiplication.
        L_BHCC = (beta_BHC1 * (Kd_BHCK @ Ki_BHCK.mT)).masked_fill(~strict_lower_CC, 0.0)
        Tinv_BHCC = unit_lower_inverse(L_BHCC)
        U_BHCV = Tinv_BHCC @ (beta_BHC1 * (v_nBHCV[i] - Kd_BHCK @ S_BHKV))
        Aqk_BHCC = (Qd_BHCK @ Ki_BHCK.mT).masked_fill(~lower_CC, 0.0)
        o_tiles.append(Qd_BHCK @ S_BHKV + Aqk_BHCC @ U_BHCV)
        S_BHKV = G_last_BH1K.mT.exp() * S_BHKV + Kr_BHCK.mT @ U_BHCV

    if not o_tiles:
        return v.new_zeros(B, 0, H, V), S_BHKV
    o_nBHCV = torch.stack(o_tiles)
    o_BTHV = o_nBHCV.permute(1, 0, 3, 2, 4).reshape(B, -1, H, V)
    return o_BTHV[:, :T], S_BHKV

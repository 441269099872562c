"""Pre-K3 chunked KDA baseline: 64-token chunks, diagonal 16-token sub-tiles evaluated pair by pair in log space.

Owns `kda_chunked_logspace`, kept out of the package (no user calls it) so that `k3 bench kda` can show what the
gate's lower bound buys (spec/kda.md §4.2, §5). It is the algorithm FLA used before `safe_gate` (PR #703), written
in PyTorch with autograd for its backward; same contract and outputs as `kda_recurrent`
(tests/ops/test_kda_baseline.py).

Math, per 64-token chunk with entering state S₀ (Γ = cumsum of g inside the chunk):
    A[i, j] = Σ_d x_{i,d} k_{j,d} exp(Γ_{i,d} − Γ_{j,d})      x = k (A_kk, j < i) or scale·q (A_qk, j ≤ i)
    off-diagonal sub-tile pairs (row sub-tile r after column sub-tile c): one matmul, anchored at the first row a of
        sub-tile r:  (x ⊙ e^{Γ − Γ_a}) (k ⊙ e^{Γ_a − Γ})ᵀ, both factors ≤ 1 for ANY gate;
    diagonal sub-tiles: no safe shared anchor without a lower bound on g, so every pair (i, j ≤ i) exponentiates
        its own Γ_i − Γ_j ≤ 0 per channel: a [16, 16, K] tensor per sub-tile instead of a matmul;
    T̃ = (I + Diag(β) A_kk)⁻¹,  W = T̃ Diag(β)(K ⊙ e^Γ),  Ũ = T̃ Diag(β) V,  U = Ũ − W S₀,
    O = scale (Q ⊙ e^Γ) S₀ + A_qk U,  S₀ ← Diag(e^{Γ_C}) S₀ + (K ⊙ e^{Γ_C − Γ})ᵀ U.

Shapes: B batch, T tokens, H heads, K key dim, V value dim, n chunks, C = 64 chunk rows, c = 16 sub-tile rows,
s = C / c sub-tiles per chunk.
"""

import torch
import torch.nn.functional as F

from openk3.ops.kda.ref import run_sequences
from openk3.ops.kda.unit_lower import unit_lower_inverse

CHUNK = 64
SUBTILE = 16


def kda_chunked_logspace(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The log-space chunked baseline; same contract as `kda_recurrent`. Valid for any g ≤ 0 (no lower bound)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return run_sequences(_logspace_sequence, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)


def _to_chunks(x_BTHD: torch.Tensor, n: int) -> torch.Tensor:
    """[B, T, H, D] -> [B, H, n, C, D], zero (neutral) rows padding T up to n·C."""
    B, T, H, D = x_BTHD.shape
    x_BTHD = F.pad(x_BTHD, (0, 0, 0, 0, 0, n * CHUNK - T))
    return x_BTHD.reshape(B, n, CHUNK, H, D).permute(0, 3, 1, 2, 4)


def _intra_chunk_scores(x_BHnCK, k_BHnCK, G_BHnCK, causal_diag: bool) -> torch.Tensor:
    """A [B, H, n, C, C] with A[i, j] = Σ_d x_i k_j e^{Γ_i − Γ_j} for j < i (j ≤ i when causal_diag)."""
    s = CHUNK // SUBTILE
    A = x_BHnCK.new_zeros(*x_BHnCK.shape[:-1], CHUNK)
    for r in range(s):
        rows = slice(r * SUBTILE, (r + 1) * SUBTILE)
        G_rows = G_BHnCK[..., rows, :]
        if r > 0:
            # Off-diagonal pairs: anchor at the sub-tile's first row; every factor is e^(≤ 0).
            G_a = G_rows[..., :1, :]
            x_a = x_BHnCK[..., rows, :] * (G_rows - G_a).exp()
            k_a = k_BHnCK[..., : r * SUBTILE, :] * (G_a - G_BHnCK[..., : r * SUBTILE, :]).exp()
            A[..., rows, : r * SUBTILE] = x_a @ k_a.mT
        # Diagonal sub-tile, pair by pair in log space: mask the exponent BEFORE exp (non-causal pairs would
        # overflow to inf and give 0·inf = NaN in backward; spec §4.4).
        diff_ccK = G_rows[..., :, None, :] - G_rows[..., None, :, :]
        causal_cc = torch.ones(SUBTILE, SUBTILE, dtype=torch.bool, device=x_BHnCK.device).tril(0 if causal_diag else -1)
        diff_ccK = diff_ccK.masked_fill(~causal_cc[:, :, None], float("-inf"))
        pair_ccK = x_BHnCK[..., rows, None, :] * k_BHnCK[..., None, rows, :] * diff_ccK.exp()
        A[..., rows, rows] = pair_ccK.sum(-1)
    return A


def _logspace_sequence(q, k, v, g, beta, S_BHKV, scale):
    """kda_chunked_logspace for one run of tokens, all inputs already in the compute dtype."""
    B, T, H, _ = q.shape
    V = v.shape[-1]
    n = -(-T // CHUNK)
    q_c, k_c, v_c, g_c = (_to_chunks(x, n) for x in (q, k, v, g))
    beta_c = _to_chunks(beta[..., None], n)  # [B, H, n, C, 1]
    G = g_c.cumsum(-2)
    A_kk = beta_c * _intra_chunk_scores(k_c, k_c, G, causal_diag=False)
    A_qk = _intra_chunk_scores(scale * q_c, k_c, G, causal_diag=True)
    Tinv = unit_lower_inverse(A_kk)
    decay = G.exp()
    W = Tinv @ (beta_c * k_c * decay)
    U_tilde = Tinv @ (beta_c * v_c)
    Qd = scale * q_c * decay
    Kr = k_c * (G[..., -1:, :] - G).exp()
    D = G[..., -1, :].exp()[..., None]  # [B, H, n, K, 1]
    o_chunks = []
    for i in range(n):
        U = U_tilde[:, :, i] - W[:, :, i] @ S_BHKV
        o_chunks.append(Qd[:, :, i] @ S_BHKV + A_qk[:, :, i] @ U)
        S_BHKV = D[:, :, i] * S_BHKV + Kr[:, :, i].mT @ U
    if n == 0:
        return v.new_zeros(B, 0, H, V), S_BHKV
    o_BHnCV = torch.stack(o_chunks, dim=2)
    return o_BHnCV.permute(0, 2, 3, 1, 4).reshape(B, n * CHUNK, H, V)[:, :T], S_BHKV

"""KDA segment summaries for context parallelism: the affine state map of a segment (spec/kda.md §9).

Owns `kda_segment_summary` (a segment's transition M and zero-start state S_ext), `compose_summaries` (the
associative combine) and `entry_states` (the chain that recovers every segment's entering state). No
communication here: `parallel/cp.py` all-gathers the summaries and calls these.

Math (K-first layout, per head): every token step is affine in the state, so a segment is too,
    S_out = M · S_in + S_ext,   M ∈ R^{K×K},   S_ext = the segment's final state from S_in = 0,
and maps compose as (M₂, B₂) ∘ (M₁, B₁) = (M₂ M₁, M₂ B₁ + B₂). M is computed by the same chunked op, on the same
tile grid, as the segment's main run: the state pass applied to S_in = I with v = 0 (Ũ = 0) yields exactly
M_n ⋯ M_1 with M_t = Diag(e^{Γ_C}) − Kr_tᵀ W_t. Everything is fp32 (the chain must stay fp32, FLA PR #740).
A run restarted from a recovered entry state matches the one-pass run to rounding, not bitwise (§9.4).

Shapes: B batch (segments side by side), T tokens, H heads, K key dim, V value dim, N packed sequences.
"""

import torch

from openk3.ops.kda.chunk import kda_chunked


def kda_segment_summary(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M [B or N, H, K, K], S_ext [B or N, H, K, V]) of each segment, fp32; inputs as for `kda_chunked`."""
    B, T, H, K = q.shape
    num_states = B if cu_seqlens is None else len(cu_seqlens) - 1
    _, S_ext = kda_chunked(q, k, v, g, beta, scale=scale, output_final_state=True, cu_seqlens=cu_seqlens,
                           chunk_size=chunk_size)  # fmt: skip
    # With v = 0 the pseudo-values are −W S and the state pass multiplies its state by each tile's transition.
    eye_NHKK = torch.eye(K, dtype=S_ext.dtype, device=q.device).expand(num_states, H, K, K).contiguous()
    zeros_BTHK = torch.zeros(B, T, H, K, dtype=v.dtype, device=v.device)
    _, M = kda_chunked(q, k, zeros_BTHK, g, beta, scale=scale, initial_state=eye_NHKK, output_final_state=True,
                       cu_seqlens=cu_seqlens, chunk_size=chunk_size)  # fmt: skip
    return M, S_ext


def compose_summaries(summaries: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The map of consecutive segments (earliest first): (M_n ⋯ M_1, state from zero after all of them).

    Summaries are [.., H, K, K] and [.., H, K, V]. Folded left to right; any bracketing gives the same map in
    exact arithmetic (the combine is associative), so a log-depth scan may replace this chain.
    """
    M, S = summaries[0]
    for M_next, S_next in summaries[1:]:
        M, S = M_next @ M, M_next @ S + S_next
    return M, S


def entry_states(summaries: list[tuple[torch.Tensor, torch.Tensor]], initial_state: torch.Tensor | None = None):
    """Entering state of every segment (and the final state last): S_{j+1} = M_j S_j + S_ext_j from S_0."""
    _M0, S_ext0 = summaries[0]
    state = torch.zeros_like(S_ext0) if initial_state is None else initial_state.to(S_ext0.dtype)
    states = [state]
    for M, S_ext in summaries:
        state = M @ state + S_ext
        states.append(state)
    return states

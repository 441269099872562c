"""KDA decode step: one token on a recurrent state (spec/kda.md §8).

Owns `kda_step`. It runs `ref.recurrence_step`, the same function as every step of `kda_recurrent`, so a loop
of `kda_step` is bitwise equal to `kda_recurrent` (spec §3 order: decay, delta write, read after write).
It returns a new state and leaves its input untouched; an in-place slot-pool variant is for serving to add.

Shapes: B batch (running sequences), H heads, K key dim, V value dim.
"""

import torch

from openk3.ops.kda.ref import compute_dtype, recurrence_step


def kda_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One KDA token. q, k [B, H, K] (L2-normalised), v [B, H, V], g [B, H, K] log-decay, beta [B, H]
    (after the sigmoid), state [B, H, K, V] fp32.

    Returns (o [B, H, V] in v's dtype, new_state [B, H, K, V] in the compute dtype, fp32 unless given fp64).
    """
    B, H, K = q.shape
    V = v.shape[-1]
    if tuple(state.shape) != (B, H, K, V):
        raise ValueError(f"state must have shape {(B, H, K, V)} (K-first layout), got {tuple(state.shape)}")
    scale = K**-0.5 if scale is None else scale
    dtype = compute_dtype(q, k, v, g, beta, state)
    # Contiguous operands: the same memory layout as the per-step slices inside kda_recurrent.
    q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, S_BHKV = (
        x.to(dtype).contiguous() for x in (q, k, v, g, beta, state)
    )
    o_BHV, S_BHKV = recurrence_step(q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, S_BHKV, scale)
    return o_BHV.to(v.dtype), S_BHKV

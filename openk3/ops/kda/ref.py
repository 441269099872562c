"""KDA reference: the gate and the token-by-token recurrence. This file is the specification of the op.

Owns `kda_gate` (spec/kda.md §2), `kda_recurrent` (§3), the single-token update `recurrence_step` that
`step.py` reuses so decode is literally one step of this loop, and the input checks and per-sequence
(`cu_seqlens`) driver shared with `chunk.py`.

Math, per head and token t, in this order (the read comes AFTER the write):
    g_t = lower_bound · sigmoid(exp(A_log) · (g_raw_t + dt_bias))        ∈ (lower_bound, 0)
    S ← Diag(exp(g_t)) S;   e = v_t − Sᵀ k_t;   S ← S + β_t k_t eᵀ;   o_t = Sᵀ (scale · q_t)
equivalently S_t = (I − β_t k_t k_tᵀ) Diag(exp g_t) S_{t−1} + β_t k_t v_tᵀ (Kimi Linear Eq. 1).

Compute dtype is `promote_types(inputs, float32)`: fp32 for bf16/fp32 inputs, fp64 when given fp64 (tests).
o is returned in v's dtype, states in the compute dtype. States use the K-first layout [.., K, V].

Shapes: B batch, T tokens, H heads, K key dim, V value dim, N sequences (packed with cu_seqlens, B = 1).
"""

from collections.abc import Callable

import torch


def kda_gate(
    g_raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float = -5.0
) -> torch.Tensor:
    """Lower-bounded KDA log-decay g [..., H, K] in (lower_bound, 0), fp32 (fp64 for fp64 inputs).

    g_raw [..., H, K] any float dtype; A_log [H]; dt_bias [H*K], head-major. No softplus: this is K3's gate,
    a different function from Kimi Linear's `-exp(A_log) softplus(.)` (spec §2). In fp32 the sigmoid rounds to
    exactly 0 or 1 for |z| > ~17, so extreme inputs give g = lower_bound or g = -0.0 (still finite).
    """
    H, K = g_raw.shape[-2:]
    dtype = compute_dtype(g_raw, A_log, dt_bias)
    z = A_log.to(dtype).exp()[:, None] * (g_raw.to(dtype) + dt_bias.to(dtype).view(H, K))
    return lower_bound * torch.sigmoid(z)


def kda_recurrent(
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
    """Token-loop KDA. q, k [B, T, H, K] (L2-normalised), v [B, T, H, V], g [B, T, H, K] log-decay,
    beta [B, T, H] (after the sigmoid), initial_state [B or N, H, K, V] or None (zeros).

    Returns (o [B, T, H, V] in v's dtype, final_state [B or N, H, K, V] or None).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return run_sequences(_recurrent_sequence, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)


def recurrence_step(
    q_BHK: torch.Tensor,
    k_BHK: torch.Tensor,
    v_BHV: torch.Tensor,
    g_BHK: torch.Tensor,
    beta_BH: torch.Tensor,
    S_BHKV: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of spec §3 on contiguous compute-dtype tensors; returns (o_BHV, new S_BHKV), never in place.

    Products with the state are elementwise-multiply + sum rather than matmuls: BLAS results may depend on
    memory alignment, and this function must give the same bits wherever its operands live (decode vs loop).
    """
    S_BHKV = g_BHK.exp()[..., None] * S_BHKV
    e_BHV = v_BHV - (S_BHKV * k_BHK[..., None]).sum(-2)
    S_BHKV = S_BHKV + (beta_BH[..., None] * k_BHK)[..., None] * e_BHV[..., None, :]
    o_BHV = (S_BHKV * (scale * q_BHK)[..., None]).sum(-2)
    return o_BHV, S_BHKV


def _recurrent_sequence(q, k, v, g, beta, S_BHKV, scale):
    """kda_recurrent for one run of tokens, all inputs already in the compute dtype."""
    # Time-major copies make every step's operands contiguous [B, H, .] blocks, the layout kda_step sees.
    q_TBHK, k_TBHK, v_TBHV, g_TBHK, beta_TBH = (x.transpose(0, 1).contiguous() for x in (q, k, v, g, beta))
    o_steps = []
    for t in range(q_TBHK.shape[0]):
        o_BHV, S_BHKV = recurrence_step(q_TBHK[t], k_TBHK[t], v_TBHV[t], g_TBHK[t], beta_TBH[t], S_BHKV, scale)
        o_steps.append(o_BHV)
    if not o_steps:
        return v.new_zeros(v.shape), S_BHKV
    return torch.stack(o_steps, dim=1), S_BHKV


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """At least fp32 (spec §7): fp32 for bf16/fp16/fp32 inputs, fp64 when any input is fp64."""
    dtype = torch.float32
    for x in tensors:
        if x is not None:
            dtype = torch.promote_types(dtype, x.dtype)
    return dtype


def run_sequences(
    sequence_fn: Callable,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Checks inputs, casts to the compute dtype and runs `sequence_fn` on each sequence (state reset per sequence).

    sequence_fn(q, k, v, g, beta, S_BHKV, scale) -> (o [B, T, H, V], S_BHKV) on compute-dtype tensors of one
    sequence (or of a padded batch when cu_seqlens is None).
    """
    bounds = _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, _, H, K = q.shape
    V = v.shape[-1]
    dtype = compute_dtype(q, k, v, g, beta, initial_state)
    out_dtype = v.dtype
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    num_states = B if bounds is None else len(bounds) - 1
    if initial_state is None:
        initial_state = q.new_zeros(num_states, H, K, V)
    initial_state = initial_state.to(dtype)

    if bounds is None:
        o_BTHV, S_NHKV = sequence_fn(q, k, v, g, beta, initial_state, scale)
    else:
        o_parts, S_parts = [], []
        for n in range(num_states):
            tokens = slice(bounds[n], bounds[n + 1])
            o_n, S_n = sequence_fn(
                q[:, tokens], k[:, tokens], v[:, tokens], g[:, tokens], beta[:, tokens], initial_state[n : n + 1], scale
            )
            o_parts.append(o_n)
            S_parts.append(S_n)
        o_BTHV, S_NHKV = torch.cat(o_parts, dim=1), torch.cat(S_parts, dim=0)
    return o_BTHV.to(out_dtype), (S_NHKV if output_final_state else None)


def _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens) -> list[int] | None:
    """Validates shapes at the op boundary; returns the sequence bounds of cu_seqlens as a list, or None."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    expected = {"k": (k, (B, T, H, K)), "v": (v, (B, T, H, V)), "g": (g, (B, T, H, K)), "beta": (beta, (B, T, H))}
    for name, (x, shape) in expected.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} to match q {tuple(q.shape)}, got {tuple(x.shape)}")
    bounds = None
    num_states = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens packs sequences along T and needs batch size 1, got B={B}")
        bounds = [int(b) for b in cu_seqlens.tolist()]
        if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != T or any(a > b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"cu_seqlens must rise from 0 to T={T}, got {bounds}")
        num_states = len(bounds) - 1
    if initial_state is not None and tuple(initial_state.shape) != (num_states, H, K, V):
        raise ValueError(
            f"initial_state must have shape {(num_states, H, K, V)} (K-first layout), got {tuple(initial_state.shape)}"
        )
    return bounds

"""KDA on GPU through fla-core's Triton kernels (optional extra `openk3[gpu]`; spec/kda.md §4.2, §11.9).

Owns `fla_available`, `kda_chunked_fla` (training/prefill: fla's `chunk_kda` with the safe gate and lower bound −5,
the dense 16-row diagonal tiles that the bound allows) and `kda_step_fla` (decode: fla's `fused_recurrent_kda`).
fla is imported lazily inside each call: importing `fla.ops` needs triton, which CPU installs do not have.

Contract at the boundary, same as the CPU ops: q, k [B, T, H, K] L2-normalised, v [B, T, H, V], g [B, T, H, K]
log-decay from `kda_gate` (so in [−5, 0) already: no gate, norm or sigmoid in the kernel), beta [B, T, H] after the
sigmoid, states fp32 [N, H, K, V] in our K-first layout. fla-core ≥ 0.6.0 stores states K-first unless
`state_v_first=True`, so we pass `state_v_first=False` and no transpose is needed; fla asserts fp32 initial states.
fla-core 0.6.0 anchors diagonal sub-chunks causally (PR #1242); older versions leak future rounding (§6).

Shapes: B batch, T tokens, H heads, K key dim, V value dim, N sequences (cu_seqlens, B = 1).
"""

import importlib.util

import torch


def fla_available() -> bool:
    """True when CUDA, triton and fla-core are all importable (the GPU path can run)."""
    return (
        torch.cuda.is_available()
        and importlib.util.find_spec("triton") is not None
        and importlib.util.find_spec("fla") is not None
    )


def kda_chunked_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    lower_bound: float = -5.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla `chunk_kda` with safe_gate=True (same contract as `kda_chunked`); differentiable through fla's backward."""
    from fla.ops.kda import chunk_kda

    if initial_state is not None:
        initial_state = initial_state.float().contiguous()
    o, final = chunk_kda(
        q, k, v, g.float(), beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        safe_gate=True, lower_bound=lower_bound, state_v_first=False,
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(device=q.device, dtype=torch.long),
    )  # fmt: skip
    return o, final


def kda_step_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token with fla `fused_recurrent_kda` (same contract as `kda_step`: q, k [B, H, K], v [B, H, V],
    g [B, H, K], beta [B, H], state [B, H, K, V] fp32). Returns (o [B, H, V], new state); the input state is not
    modified (fla's public wrapper writes a new final state)."""
    from fla.ops.kda import fused_recurrent_kda

    o, final = fused_recurrent_kda(
        q[:, None], k[:, None], v[:, None], g[:, None].float(), beta[:, None], scale=scale,
        initial_state=state.float().contiguous(), output_final_state=True, lower_bound=None, state_v_first=False,
    )  # fmt: skip
    return o[:, 0], final

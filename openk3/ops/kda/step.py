"""KDA decode step: one token on a recurrent state (spec/kda.md §8), and the two speculative-decoding ops built on
it (spec/serving.md §4): `kda_verify` runs G decode steps per sequence without touching the caller's state and
returns each step's inputs (`KDASteps`); `kda_fold` replays the first c_n of them onto a state.

Owns `kda_step`. It runs `ref.recurrence_step`, the same function as every step of `kda_recurrent`, so a loop
of `kda_step` is bitwise equal to `kda_recurrent` (spec §3 order: decay, delta write, read after write).
It returns a new state and leaves its input untouched; an in-place slot-pool variant is for serving to add.
Verify and fold call the same step function on the same [N, ...] operands (contiguous position-major slices), so a
fold is bitwise the state the verify pass held after that many steps (spec/serving.md §4.4).

Shapes: B or N batch (running sequences), G steps per sequence, H heads, K key dim, V value dim.
"""

from collections.abc import Callable
from dataclasses import dataclass

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
    q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, S_BHKV = (x.to(dtype).contiguous() for x in (q, k, v, g, beta, state))
    o_BHV, S_BHKV = recurrence_step(q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, S_BHKV, scale)
    return o_BHV.to(v.dtype), S_BHKV


@dataclass
class KDASteps:
    """The inputs of G consecutive decode steps of N sequences, position-major so that step t's [N, ...] operands
    are contiguous blocks, as in decode: q^, k^ [G, N, H, K] (L2-normalised), v [G, N, H, V], the log-decay g
    [G, N, H, K] and beta [G, N, H] after their activations."""

    q_GNHK: torch.Tensor
    k_GNHK: torch.Tensor
    v_GNHV: torch.Tensor
    g_GNHK: torch.Tensor
    beta_GNH: torch.Tensor

    def step(self, t: int) -> tuple[torch.Tensor, ...]:
        return self.q_GNHK[t], self.k_GNHK[t], self.v_GNHV[t], self.g_GNHK[t], self.beta_GNH[t]


StepFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def kda_verify(
    q_NGHK: torch.Tensor,
    k_NGHK: torch.Tensor,
    v_NGHV: torch.Tensor,
    g_NGHK: torch.Tensor,
    beta_NGH: torch.Tensor,
    state_NHKV: torch.Tensor,
    step: StepFn = kda_step,
) -> tuple[torch.Tensor, KDASteps]:
    """G decode steps per sequence on a copy of `state_NHKV` (left untouched). Returns (o [N, G, H, V], the steps'
    inputs for `kda_fold`). `step` is the decode-step implementation (ops.dispatch passes the one for the device);
    the fold must use the same one."""
    steps = KDASteps(*(x.transpose(0, 1).contiguous() for x in (q_NGHK, k_NGHK, v_NGHV, g_NGHK, beta_NGH)))
    outs, state = [], state_NHKV
    for t in range(q_NGHK.shape[1]):
        o_NHV, state = step(*steps.step(t), state)
        outs.append(o_NHV)
    return torch.stack(outs, 1), steps


def kda_fold(
    steps: KDASteps, state_NHKV: torch.Tensor, consumed_N: torch.Tensor, step: StepFn = kda_step
) -> torch.Tensor:
    """The state after sequence n takes its first consumed_N[n] recorded steps (0 keeps its state): every step
    runs on the whole batch, as in verify, and rows past their count keep their state."""
    state = state_NHKV
    for t in range(int(consumed_N.max()) if consumed_N.numel() else 0):
        _, new = step(*steps.step(t), state)
        state = torch.where((t < consumed_N)[:, None, None, None], new, state)
    return state

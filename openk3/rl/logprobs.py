"""Trainer-side log-probabilities of whole trajectories: one packed forward over every sequence (no padding),
optionally replaying the rollout's routed experts (R3), then per sequence
`logp[t] = log softmax(logits[t] / temperature)[seq[t + 1]]`, the log-probability of each token given its prefix.

Only positions 0..n-2 are fed: the last token's logits predict nothing, and causal layers make its position
irrelevant to the others. This is also exactly what the engine fed (the last token is sampled, never fed), so the
recorded routes cover the fed positions with no padding, and the expert groups match the rollout's row for row
(padding a guessed route for an extra position would change the grouped GEMMs' shapes and so the rounding).

The result is differentiable (callers wrap it in `torch.no_grad()` for old/reference log-probs).

Legend: T packed tokens, V vocabulary, M MoE layers (model.moe.moe_layer_indices), k experts per token,
n one sequence's length.
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.model.batch import ForwardBatch
from openk3.train.batch import packed_routes


def sequence_logprobs(
    model: nn.Module,
    sequences: list[list[int]],
    routed_experts: list[torch.Tensor | None] | None = None,
    *,
    temperature: float = 1.0,
) -> list[torch.Tensor]:
    """Per sequence i, `out[i][t] = log p(seq[t + 1] | seq[:t + 1])` for t in 0..n-2: fp32 [n - 1].

    `model`: a K3ForCausalLM (its `forward_batch`). Positions 0..n-2 are fed (module docstring); a sequence of one
    token gets an empty result. `routed_experts[i]`: [>= n - 1, M, k] integer, the experts sequence i's positions
    were routed to at rollout (the engine records every fed position, n - 1 of them); rows past n - 1 (the last
    token's, if recorded) are not used. Replay is all or nothing: every entry given, or `routed_experts` None (or
    all entries None) for natural routing; a mix raises ValueError.
    """
    logp_TV, targets_T, keep, fed = _packed_log_softmax(model, sequences, routed_experts, temperature)
    device = next(model.parameters()).device
    if logp_TV is None:
        return [torch.zeros(0, device=device) for _ in sequences]
    logp_T = logp_TV.gather(-1, targets_T[:, None]).squeeze(-1)
    out = [logp_T.new_zeros(0) for _ in sequences]
    for i, logp_n in zip(keep, logp_T.split([fed[i] for i in keep])):
        out[i] = logp_n
    return out


def sequence_log_softmax(
    model: nn.Module,
    sequences: list[list[int]],
    routed_experts: list[torch.Tensor | None] | None = None,
    *,
    temperature: float = 1.0,
) -> list[torch.Tensor]:
    """Per sequence i, the whole next-token distribution `out[i][t] = log softmax(logits[t] / temperature)`, fp32
    [n - 1, V], for t in 0..n-2 (the same forward as `sequence_logprobs`; distribution-level losses such as a top-k
    distillation target need every row, not only the sampled token's entry)."""
    logp_TV, _, keep, fed = _packed_log_softmax(model, sequences, routed_experts, temperature)
    device = next(model.parameters()).device
    vocab = model.config.text_config.vocab_size if logp_TV is None else logp_TV.shape[-1]
    out = [torch.zeros(0, vocab, device=device) for _ in sequences]
    if logp_TV is not None:
        for i, rows in zip(keep, logp_TV.split([fed[i] for i in keep])):
            out[i] = rows
    return out


def _packed_log_softmax(model, sequences, routed_experts, temperature):
    """(logp_TV, targets_T, kept sequence indices, fed positions per sequence): one packed forward; logp_TV is None
    when no sequence feeds a position."""
    if not sequences or min(len(s) for s in sequences) < 1:
        raise ValueError(f"sequence_logprobs needs non-empty sequences, got lengths {[len(s) for s in sequences]}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    device = next(model.parameters()).device
    fed = [len(s) - 1 for s in sequences]  # positions fed per sequence
    routes_TMk = None if routed_experts is None else packed_routes(routed_experts, fed, device)
    keep = [i for i, n in enumerate(fed) if n > 0]  # a one-token sequence feeds nothing
    if not keep:
        return None, None, keep, fed
    inputs_T = torch.tensor([tok for i in keep for tok in sequences[i][:-1]], dtype=torch.long, device=device)
    targets_T = torch.tensor([tok for i in keep for tok in sequences[i][1:]], dtype=torch.long, device=device)
    batch = ForwardBatch.from_lengths(inputs_T, [fed[i] for i in keep], routed_experts=routes_TMk)
    logp_TV = torch.log_softmax(model.forward_batch(batch).float() / temperature, dim=-1)
    return logp_TV, targets_T, keep, fed

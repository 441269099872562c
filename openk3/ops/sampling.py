"""Token sampling from logits: greedy, temperature, top-k and top-p (nucleus), in fp32.

Legend: B rows, V vocabulary.
"""

from __future__ import annotations

import math

import torch

# Temperatures below this are greedy: the T -> 0 limit of softmax(logits / T) is the argmax (vLLM's rule), and
# dividing by a smaller T only manufactures overflow.
GREEDY_BELOW = 1e-5


def sampling_probs(
    logits_BV: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor | None:
    """The fp32 distribution tokens are drawn from [..., V] (None for greedy: temperature 0, or below
    GREEDY_BELOW): temperature, then top-k, then top-p. top_k 0 and top_p 1.0 disable those filters; the most likely
    token always survives top-p, however small top_p is."""
    if not (temperature >= 0 and math.isfinite(temperature)) or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"invalid sampling settings temperature={temperature}, top_k={top_k}, top_p={top_p}")
    if temperature < GREEDY_BELOW:
        return None
    # Shifted by the row maximum before the division, so a small temperature cannot overflow to inf (and NaN);
    # the caller rejects rows that are not finite to begin with.
    logits = logits_BV.float()
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Drop a token when the tokens strictly more likely than it already reach top_p (the first always stays).
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop_sorted[..., 0] = False  # a top_p below fp32's smallest number compares as 0 and would drop every token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.softmax(logits, dim=-1)


def sample(
    logits_BV: torch.Tensor,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Return token ids [B]. temperature 0 is greedy (argmax); top_k 0 and top_p 1.0 disable those filters."""
    probs = sampling_probs(logits_BV, temperature, top_k, top_p)
    if probs is None:
        return logits_BV.float().argmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)

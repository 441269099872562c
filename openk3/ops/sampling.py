"""Token sampling from logits: greedy, temperature, top-k and top-p (nucleus), in fp32.

`sample` draws every row with one generator (`K3ForCausalLM.generate`). `sample_rows` is the serving engine's batched
sampler: per-row settings, and each row drawn from its own generator, so a request's tokens do not depend on what it
is batched with; `ref_sample_rows` is its plain per-row reference (one `sampling_probs` and one `torch.multinomial`
per row), and the two give identical tokens for the same generator states.

A single multinomial draw is the exponential race torch.multinomial itself uses: argmax(p / q), q ~ Exp(1) drawn
from the row's generator into a fresh [V] fp32 tensor, so `draw` consumes a generator exactly as
`torch.multinomial(p_V, 1, generator=g)` does and picks the same token (the tests pin this against torch).

Legend: B or N rows, V vocabulary.
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


def sampling_probs_rows(
    logits_NV: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float]
) -> torch.Tensor:
    """`sampling_probs` of every row with its own settings, in one pass over the [N, V] block (no greedy rows: the
    caller takes their argmax). Bitwise the per-row result: the same ops on the same values, row by row."""
    for t, k, p in zip(temperature, top_k, top_p, strict=True):
        if not (t >= GREEDY_BELOW and math.isfinite(t)) or not 0 < p <= 1 or k < 0:
            raise ValueError(f"invalid sampling settings temperature={t}, top_k={k}, top_p={p} for a sampled row")
    device = logits_NV.device
    logits = logits_NV.float()
    temperature_N1 = torch.tensor(temperature, dtype=torch.float32, device=device)[:, None]
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature_N1
    V = logits.shape[-1]
    ks = [min(k, V) for k in top_k]
    if max(ks) > 0:
        # The k-th largest value of each row (top_k 0: -inf, which masks nothing).
        top_NK = torch.topk(logits, max(ks), dim=-1).values
        k_N1 = torch.tensor([max(k, 1) - 1 for k in ks], device=device)[:, None]
        kth_N1 = top_NK.gather(-1, k_N1).masked_fill(torch.tensor(ks, device=device)[:, None] == 0, float("-inf"))
        logits = logits.masked_fill(logits < kth_N1, float("-inf"))
    if min(top_p) < 1.0:
        top_p_N1 = torch.tensor(top_p, dtype=torch.float32, device=device)[:, None]
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs_sorted = torch.softmax(sorted_logits, dim=-1)
        drop_sorted = (probs_sorted.cumsum(-1) - probs_sorted) >= top_p_N1
        drop_sorted[..., 0] = False
        # A row with top_p 1.0 keeps everything (its cumsum can reach 1.0 before the end by rounding).
        drop_sorted &= top_p_N1 < 1.0
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.softmax(logits, dim=-1)


def draw(probs_NV: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row [N] from the distributions `probs_NV`, row n's randomness from `generators[n]` (CPU
    generators; the draws move to the rows' device). Identical to `torch.multinomial(probs_NV[n], 1, generator=g)`
    row by row, generator state included."""
    V = probs_NV.shape[-1]
    q_NV = torch.stack([torch.empty(V, dtype=probs_NV.dtype).exponential_(generator=g) for g in generators])
    return (probs_NV / q_NV.to(probs_NV.device)).argmax(-1)


def sample_rows(logits_NV: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
                generators: list[torch.Generator | None]) -> torch.Tensor:  # fmt: skip
    """Token ids [N]: greedy rows (temperature below GREEDY_BELOW) by argmax, the others drawn after
    temperature, top-k and top-p, each from its own generator. The rows must be finite."""
    tokens_N = logits_NV.argmax(-1)
    sampled = [n for n, t in enumerate(temperature) if t >= GREEDY_BELOW]
    if sampled:
        rows = torch.tensor(sampled, device=logits_NV.device)
        probs = sampling_probs_rows(logits_NV.index_select(0, rows), [temperature[n] for n in sampled],
                                    [top_k[n] for n in sampled], [top_p[n] for n in sampled])  # fmt: skip
        tokens_N[rows] = draw(probs, [generators[n] for n in sampled])
    return tokens_N


def ref_sample_rows(logits_NV: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
                    generators: list[torch.Generator | None]) -> torch.Tensor:  # fmt: skip
    """The reference of `sample_rows`: one `sampling_probs` and one `torch.multinomial` per row."""
    out = []
    for n, row_V in enumerate(logits_NV):
        p = sampling_probs(row_V, temperature[n], top_k[n], top_p[n])
        out.append(int(row_V.argmax()) if p is None else int(torch.multinomial(p, 1, generator=generators[n])))
    return torch.tensor(out, dtype=torch.long, device=logits_NV.device)

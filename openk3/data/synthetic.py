"""Synthetic long-context recall tasks, token-id based, as `PackedBatch`es with the answer positions marked.

- `mqar`: multi-query associative recall (Arora et al. 2023, "Zoology"): key-value pairs, then queries (a key seen
  before) scattered through filler; the answer is the key's value.
- `needle`: one key-value "needle" hidden at a depth fraction of filler (random tokens, or spans of real text), then
  `sep` and the key again; the answer is the value.
- `copying`: a random span, `sep`, then the span again; the answer is the second span.

Every row is one document of exactly L tokens (`doc_lens = [[L]] * B`): a sequence of L + 1 tokens starting with
bos, shifted into inputs/labels as in `packing`. `answer_mask[b, t]` is True where `labels[b, t]` is an answer token,
i.e. where the prediction made at input position t is scored; accuracy = (argmax logits == labels)[answer_mask].
With `answers_only=True` (default) labels are -100 everywhere else; otherwise they are the full next-token targets
(still -100 on padding). Tokens are drawn from `token_range = (lo, hi)` (half open; use base ranks, not specials)
with a `torch.Generator` seeded by `seed`, so a (task, arguments, seed) triple always gives the same batch.

Legend: B rows, L seq_len (inputs per row), N = L + 1 tokens per generated sequence.
"""

from __future__ import annotations

import torch

from openk3.data.packing import IGNORE_INDEX, PackedBatch


def _finish(seq_BN: torch.Tensor, answer_BN: torch.Tensor, no_label_BN: torch.Tensor, answers_only: bool):
    """Shift [B, N] sequences into a PackedBatch; `answer_BN` / `no_label_BN` mark positions of the sequence."""
    B, N = seq_BN.shape
    answer_BL = answer_BN[:, 1:]
    drop_BL = ~answer_BL if answers_only else no_label_BN[:, 1:]
    labels_BL = seq_BN[:, 1:].masked_fill(drop_BL, IGNORE_INDEX)
    return PackedBatch(seq_BN[:, :-1].clone(), labels_BL, [[N - 1] for _ in range(B)], answer_BL.clone())


def _check_range(token_range: tuple[int, int], need: int, what: str) -> tuple[int, int]:
    lo, hi = token_range
    if hi - lo < need:
        raise ValueError(f"token_range {token_range} has {hi - lo} ids; {what} needs at least {need}")
    return lo, hi


def mqar(
    batch_size: int, seq_len: int, num_kv_pairs: int, num_queries: int, token_range: tuple[int, int],
    bos_id: int, filler_id: int, seed: int = 0, answers_only: bool = True,
) -> PackedBatch:  # fmt: skip
    """`[bos] k1 v1 … kn vn` then `num_queries` query pairs `k v` (distinct keys from the context, in random order)
    at random pair slots of the remaining positions, which hold `filler_id`. Keys come from the lower half of
    `token_range`, values from the upper half (so a key is never mistaken for a value); keys are distinct per row."""
    N = seq_len + 1
    if num_queries > num_kv_pairs:
        raise ValueError(f"mqar: num_queries ({num_queries}) must be <= num_kv_pairs ({num_kv_pairs})")
    slots = (N - 1 - 2 * num_kv_pairs) // 2
    if slots < num_queries:
        raise ValueError(f"mqar: seq_len {seq_len} cannot hold {num_kv_pairs} pairs and {num_queries} queries "
                         f"(needs seq_len >= {2 * num_kv_pairs + 2 * num_queries})")  # fmt: skip
    lo, hi = _check_range(token_range, 2 * num_kv_pairs, f"mqar with {num_kv_pairs} distinct keys")
    mid = (lo + hi) // 2
    g = torch.Generator().manual_seed(seed)
    seq_BN = torch.full((batch_size, N), filler_id, dtype=torch.long)
    answer_BN = torch.zeros(batch_size, N, dtype=torch.bool)
    seq_BN[:, 0] = bos_id
    for b in range(batch_size):
        keys = lo + torch.randperm(mid - lo, generator=g)[:num_kv_pairs]
        values = torch.randint(mid, hi, (num_kv_pairs,), generator=g)
        seq_BN[b, 1 : 1 + 2 * num_kv_pairs : 2] = keys
        seq_BN[b, 2 : 2 + 2 * num_kv_pairs : 2] = values
        which = torch.randperm(num_kv_pairs, generator=g)[:num_queries]
        slot = torch.randperm(slots, generator=g)[:num_queries]
        key_pos = 1 + 2 * num_kv_pairs + 2 * slot
        seq_BN[b, key_pos] = keys[which]
        seq_BN[b, key_pos + 1] = values[which]
        answer_BN[b, key_pos + 1] = True
    return _finish(seq_BN, answer_BN, torch.zeros_like(answer_BN), answers_only)


def needle(
    batch_size: int, seq_len: int, depth: float, token_range: tuple[int, int], bos_id: int, sep_id: int,
    key_len: int = 4, value_len: int = 4, seed: int = 0, filler: torch.Tensor | None = None,
    answers_only: bool = True, kv_range: tuple[int, int] | None = None,
) -> PackedBatch:  # fmt: skip
    """`[bos] hay[:p] key value hay[p:] [sep] key value` with p = round(depth * len(hay)): `depth` 0.0 puts the needle
    right after bos, 1.0 right before sep. The hay fills the row: len(hay) = seq_len - 1 - 2 * (key_len + value_len).
    `filler` (1-D token ids, e.g. a tokenized validation text) gives real-text hay as random contiguous spans;
    otherwise the hay is uniform random tokens from `token_range`. `kv_range` (default `token_range`) draws the key
    and value from separate ids, so the key cannot also occur in the hay."""
    N = seq_len + 1
    hay_len = N - 2 - 2 * (key_len + value_len)
    if hay_len < 0:
        raise ValueError(f"needle: seq_len {seq_len} is too short for key_len {key_len} + value_len {value_len}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"needle: depth must be in [0, 1], got {depth}")
    if filler is not None and len(filler) < hay_len:
        raise ValueError(f"needle: filler has {len(filler)} tokens, the hay needs {hay_len}")
    lo, hi = _check_range(token_range, 2, "needle")
    p = round(depth * hay_len)
    g = torch.Generator().manual_seed(seed)
    rows, answers = [], []
    for _ in range(batch_size):
        if filler is None:
            hay = torch.randint(lo, hi, (hay_len,), generator=g)
        else:
            start = int(torch.randint(0, len(filler) - hay_len + 1, (1,), generator=g))
            hay = filler[start : start + hay_len].long()
        kv_lo, kv_hi = kv_range if kv_range is not None else (lo, hi)
        kv = torch.randint(kv_lo, kv_hi, (key_len + value_len,), generator=g)
        bos, sep = torch.tensor([bos_id]), torch.tensor([sep_id])
        rows.append(torch.cat([bos, hay[:p], kv, hay[p:], sep, kv]))
        answer = torch.zeros(N, dtype=torch.bool)
        answer[N - value_len :] = True
        answers.append(answer)
    seq_BN, answer_BN = torch.stack(rows), torch.stack(answers)
    return _finish(seq_BN, answer_BN, torch.zeros_like(answer_BN), answers_only)


def copying(
    batch_size: int, seq_len: int, token_range: tuple[int, int], bos_id: int, sep_id: int, pad_id: int,
    span_len: int | None = None, seed: int = 0, answers_only: bool = True,
) -> PackedBatch:  # fmt: skip
    """`[bos] span [sep] span` then `pad_id` to the end of the row. `span_len` defaults to the longest that fits,
    (seq_len - 1) // 2; the answer is the whole second span."""
    N = seq_len + 1
    span_len = (N - 2) // 2 if span_len is None else span_len
    if span_len < 1 or 2 * span_len + 2 > N:
        raise ValueError(f"copying: span_len {span_len} does not fit seq_len {seq_len} (max {(N - 2) // 2})")
    lo, hi = _check_range(token_range, 2, "copying")
    g = torch.Generator().manual_seed(seed)
    span_BS = torch.randint(lo, hi, (batch_size, span_len), generator=g)
    seq_BN = torch.full((batch_size, N), pad_id, dtype=torch.long)
    seq_BN[:, 0] = bos_id
    seq_BN[:, 1 : 1 + span_len] = span_BS
    seq_BN[:, 1 + span_len] = sep_id
    seq_BN[:, 2 + span_len : 2 + 2 * span_len] = span_BS
    answer_BN = torch.zeros(batch_size, N, dtype=torch.bool)
    answer_BN[:, 2 + span_len : 2 + 2 * span_len] = True
    pad_BN = torch.zeros_like(answer_BN)
    pad_BN[:, 2 + 2 * span_len :] = True
    return _finish(seq_BN, answer_BN, pad_BN, answers_only)


def answer_accuracy(logits_BLV: torch.Tensor, batch: PackedBatch) -> float:
    """Fraction of answer tokens whose argmax prediction is right (exact-match per token)."""
    mask_BL = batch.answer_mask.to(logits_BLV.device)
    hits_BL = logits_BLV.argmax(-1) == batch.labels.to(logits_BLV.device)
    return float(hits_BL[mask_BL].float().mean())


TASKS = {"mqar": mqar, "needle": needle, "copying": copying}

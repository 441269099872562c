"""Synthetic tasks: the marked answer positions hold exactly the right tokens, batches are deterministic per seed,
and the batches have the PackedBatch layout the trainer consumes."""

from __future__ import annotations

import pytest
import torch

from openk3.data.packing import IGNORE_INDEX
from openk3.data.synthetic import answer_accuracy, copying, mqar, needle

BOS, SEP, PAD, FILL = 768, 771, 1023, 0
RANGE = (1, 768)


def _same(a, b) -> bool:
    return torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)


def test_mqar_answers_are_the_values_of_the_queried_keys():
    n, q, L = 8, 5, 64
    batch = mqar(4, L, n, q, RANGE, BOS, FILL, seed=1)
    assert batch.input_ids.shape == (4, L) and batch.doc_lens == [[L]] * 4
    for b in range(4):
        ids = batch.input_ids[b].tolist()
        assert ids[0] == BOS
        keys, values = ids[1 : 1 + 2 * n : 2], ids[2 : 2 + 2 * n : 2]
        assert len(set(keys)) == n and max(keys) < min(values)  # distinct keys, disjoint from values
        kv = dict(zip(keys, values))
        answer_t = batch.answer_mask[b].nonzero().squeeze(-1).tolist()
        assert len(answer_t) == q and min(answer_t) >= 2 * n
        # The prediction at position t (the query key) must be the key's value.
        assert [int(batch.labels[b, t]) for t in answer_t] == [kv[ids[t]] for t in answer_t]
        assert len({ids[t] for t in answer_t}) == q  # distinct queries
        assert (batch.labels[b][~batch.answer_mask[b]] == IGNORE_INDEX).all()
        rest = [x for t, x in enumerate(ids) if t > 2 * n and t not in answer_t and t - 1 not in answer_t]
        assert set(rest) <= {FILL} | set(keys)
    assert _same(batch, mqar(4, L, n, q, RANGE, BOS, FILL, seed=1))
    assert not _same(batch, mqar(4, L, n, q, RANGE, BOS, FILL, seed=2))
    full = mqar(4, L, n, q, RANGE, BOS, FILL, seed=1, answers_only=False)
    assert torch.equal(full.labels, torch.cat([batch.input_ids[:, 1:], full.labels[:, -1:]], 1))
    with pytest.raises(ValueError, match="cannot hold"):
        mqar(1, 20, 8, 5, RANGE, BOS, FILL)


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_needle_answer_is_the_value_after_the_hidden_key(depth):
    L, kl, vl = 100, 3, 4
    batch = needle(3, L, depth, RANGE, BOS, SEP, key_len=kl, value_len=vl, seed=5)
    hay_len = L + 1 - 2 - 2 * (kl + vl)
    p = 1 + round(depth * hay_len)  # sequence position of the needle
    for b in range(3):
        seq = batch.input_ids[b].tolist() + [int(batch.labels[b, -1])]
        key, value = seq[p : p + kl], seq[p + kl : p + kl + vl]
        assert seq[0] == BOS and seq[L + 1 - 1 - kl - vl] == SEP and seq[L + 1 - kl - vl : L + 1 - vl] == key
        answer_t = batch.answer_mask[b].nonzero().squeeze(-1).tolist()
        assert answer_t == list(range(L - vl, L))
        assert batch.labels[b, answer_t].tolist() == value
    real = torch.arange(1000, 1300)
    hay = needle(2, L, 0.5, RANGE, BOS, SEP, key_len=kl, value_len=vl, seed=5, filler=real).input_ids[0, 1:10]
    assert (hay[1:] - hay[:-1] == 1).all()  # a contiguous span of the real filler


def test_copying_answer_is_the_second_span():
    batch = copying(2, 20, RANGE, BOS, SEP, PAD, span_len=6, seed=3)
    for b in range(2):
        ids = batch.input_ids[b].tolist()
        span = ids[1:7]
        assert ids[0] == BOS and ids[7] == SEP and ids[8:14] == span and ids[14:] == [PAD] * 6
        answer_t = batch.answer_mask[b].nonzero().squeeze(-1).tolist()
        assert answer_t == list(range(7, 13)) and batch.labels[b, answer_t].tolist() == span
    full = copying(2, 20, RANGE, BOS, SEP, PAD, span_len=6, seed=3, answers_only=False)
    assert (full.labels[:, 13:] == IGNORE_INDEX).all() and (full.labels[:, :13] != IGNORE_INDEX).all()
    longest = copying(1, 21, RANGE, BOS, SEP, PAD)
    assert int(longest.answer_mask.sum()) == 10
    with pytest.raises(ValueError, match="does not fit"):
        copying(1, 10, RANGE, BOS, SEP, PAD, span_len=6)


def test_answer_accuracy_scores_only_answers():
    batch = copying(2, 20, RANGE, BOS, SEP, PAD, span_len=6, seed=3)
    logits = torch.zeros(2, 20, 1024)
    logits.scatter_(2, batch.labels.clamp(min=0)[..., None], 1.0)
    assert answer_accuracy(logits, batch) == 1.0
    logits[0, 7] = 0
    logits[0, 7, 5] = 1.0
    assert answer_accuracy(logits, batch) == pytest.approx(11 / 12)


def test_needle_kv_range_keeps_the_key_out_of_the_hay():
    from openk3.data.synthetic import needle

    batch = needle(4, 128, 0.5, (0, 32), 768, 771, key_len=2, value_len=2, seed=1, kv_range=(32, 64))
    for row, labels, mask in zip(batch.input_ids, batch.labels, batch.answer_mask):
        hay = row[(row < 32)]
        assert len(hay) == 119  # 128 inputs: bos, 119 hay, needle key+value (4), sep, query key (2), first value
        kv = row[(row >= 32) & (row < 64)]
        assert len(kv) == 4 + 2 + 1
        assert torch.equal(labels[mask], kv[2:4])  # the answers are the needle's value

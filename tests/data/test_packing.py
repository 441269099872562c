"""Packing: labels never cross a document boundary, doc_lens match the documents, every in-document pair is a label
exactly once, long documents continue in the next row as a new segment, and the tail is padded."""

from __future__ import annotations

import pytest
import torch

from openk3.data.packing import IGNORE_INDEX, pack_documents

BOS, EOS, PAD = 100, 102, 127


def _docs(seed: int, n: int, max_len: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, max_len, (n,), generator=g).tolist()
    return [torch.randint(0, 100, (k,), generator=g).tolist() for k in lens]


def _pairs_of(docs):
    """Every (token, next token) pair inside a wrapped document, in stream order."""
    out = []
    for doc in docs:
        w = [BOS, *doc, EOS]
        out += list(zip(w[:-1], w[1:]))
    return out


@pytest.mark.parametrize(("seq_len", "batch_size", "max_doc"), [(16, 3, 10), (7, 2, 40), (32, 4, 5), (1, 5, 3)])
def test_labels_are_exactly_the_in_document_pairs(seq_len, batch_size, max_doc):
    docs = _docs(seq_len, 30, max_doc)
    batches = list(pack_documents(docs, seq_len, batch_size, BOS, EOS, PAD))
    kept = []
    for batch in batches:
        assert batch.input_ids.shape == batch.labels.shape == (batch_size, seq_len)
        assert batch.input_ids.dtype == batch.labels.dtype == torch.long
        for b in range(batch_size):
            assert sum(batch.doc_lens[b]) == seq_len and min(batch.doc_lens[b]) > 0
            for t in range(seq_len):
                if batch.labels[b, t] != IGNORE_INDEX:
                    kept.append((int(batch.input_ids[b, t]), int(batch.labels[b, t])))
    # No label crosses eos -> bos, none is lost, none is repeated, and the order is the stream order.
    assert kept == _pairs_of(docs)


def test_segments_follow_documents():
    docs = _docs(1, 40, 12)
    for batch in pack_documents(docs, 24, 2, BOS, EOS, PAD):
        for b, lens in enumerate(batch.doc_lens):
            start = 0
            for k, n in enumerate(lens):
                seg = batch.input_ids[b, start : start + n].tolist()
                lab = batch.labels[b, start : start + n].tolist()
                if k > 0 and seg[0] != PAD:
                    assert seg[0] == BOS  # a segment after the first starts a document
                if seg[0] != PAD:
                    assert BOS not in seg[1:] and EOS not in seg[:-1]
                    # only the last position of a segment may lack a label (the eos -> bos transition)
                    assert IGNORE_INDEX not in lab[:-1]
                    # an eos is followed by another document's bos (or padding); anything else continues the document
                    assert (lab[-1] == IGNORE_INDEX) == (seg[-1] == EOS)
                start += n


def test_long_document_continues_as_new_segment_in_next_row():
    doc = list(range(1, 21))  # 22 tokens wrapped
    batch = next(pack_documents([doc, [50, 51]], 8, 4, BOS, EOS, PAD))
    assert batch.input_ids[0].tolist() == [BOS, 1, 2, 3, 4, 5, 6, 7]
    assert batch.labels[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    # Row 1 starts mid-document (no bos): a new segment, its KDA state and attention start fresh.
    assert batch.input_ids[1].tolist() == [8, 9, 10, 11, 12, 13, 14, 15]
    assert batch.doc_lens[1] == [8]
    assert batch.input_ids[2].tolist() == [16, 17, 18, 19, 20, EOS, BOS, 50]
    assert batch.labels[2].tolist() == [17, 18, 19, 20, EOS, IGNORE_INDEX, 50, 51]
    assert batch.doc_lens[2] == [6, 2]
    # Tail: [51, EOS] then padding as its own segment, and one all-padding row fills the batch.
    assert batch.input_ids[3].tolist() == [51, EOS] + [PAD] * 6
    assert batch.labels[3].tolist() == [EOS] + [IGNORE_INDEX] * 7
    assert batch.doc_lens[3] == [2, 6]
    cu = batch.cu_seqlens()
    assert cu.tolist() == [0, 8, 16, 22, 24, 26, 32]
    assert batch.num_loss_tokens() == 8 + 8 + 7 + 1


def test_padding_and_drop_last():
    docs = [[1, 2, 3]] * 3  # 15 stream tokens -> rows at 0, 4, 8, 12 for seq_len 4
    full = list(pack_documents(docs, 4, 3, BOS, EOS, PAD))
    assert len(full) == 2
    assert full[1].input_ids[0].tolist() == [2, 3, EOS, PAD] and full[1].doc_lens[0] == [3, 1]
    assert full[1].labels[0].tolist() == [3, EOS, IGNORE_INDEX, IGNORE_INDEX]
    assert full[1].input_ids[1].tolist() == [PAD] * 4 and full[1].doc_lens[1] == [4]
    assert (full[1].labels[1] == IGNORE_INDEX).all()
    dropped = list(pack_documents(docs, 4, 3, BOS, EOS, PAD, drop_last=True))
    assert len(dropped) == 1 and torch.equal(dropped[0].input_ids, full[0].input_ids)
    assert list(pack_documents([], 4, 2, BOS, EOS, PAD)) == []
    with pytest.raises(ValueError, match="seq_len"):
        next(pack_documents(docs, 0, 2, BOS, EOS, PAD))

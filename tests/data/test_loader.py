"""TokenLoader: same rows as the in-memory packer, exact resume (also across a seq_len change and an epoch boundary),
data-parallel rank slicing, per-epoch shuffling that covers every token, and the token cache."""

from __future__ import annotations

import pytest
import torch

from openk3.data.corpus import Document
from openk3.data.loader import TokenLoader, TokenStream, tokenize_documents
from openk3.data.packing import IGNORE_INDEX, pack_documents
from openk3.data.tokenizer import ByteTokenizer

BOS, EOS, PAD = 300, 302, 511


def _stream(num_docs: int = 25, max_len: int = 30, seed: int = 0) -> TokenStream:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, max_len, (num_docs,), generator=g)
    tokens = torch.randint(0, 256, (int(lens.sum()),), generator=g).to(torch.int32)
    return TokenStream(tokens, torch.nn.functional.pad(lens.cumsum(0), (1, 0)))


def _equal(a, b) -> bool:
    return torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels) and a.doc_lens == b.doc_lens


def test_unshuffled_single_pass_equals_pack_documents():
    stream = _stream()
    docs = [stream.doc(d).tolist() for d in range(stream.num_docs)]
    want = list(pack_documents(docs, 16, 3, BOS, EOS, PAD))
    got = list(TokenLoader(stream, 3, 16, BOS, EOS, PAD, shuffle=False, loop=False))
    assert len(got) == len(want) and all(_equal(a, b) for a, b in zip(got, want))


def test_resume_is_exact_across_seq_len_change_and_epochs():
    stream = _stream()  # ~400 tokens per epoch: 12 steps of 2 rows of 24-32 tokens cross several epochs

    def run(loader, steps: range):
        out = []
        for step in steps:
            loader.set_seq_len(32 if step < 6 else 24)  # a context-length curriculum keyed on the step
            out.append(next(loader))
        return out

    full = run(TokenLoader(stream, 2, 32, BOS, EOS, PAD, seed=3), range(12))
    assert full[0].input_ids.shape == (2, 32) and full[-1].input_ids.shape == (2, 24)
    for k in (0, 4, 6, 9):
        first = TokenLoader(stream, 2, 32, BOS, EOS, PAD, seed=3)
        head = run(first, range(k))
        resumed = TokenLoader(stream, 2, 32, BOS, EOS, PAD, seed=3)
        resumed.load_state_dict(first.state_dict())
        tail = run(resumed, range(k, 12))
        assert all(_equal(a, b) for a, b in zip(head + tail, full, strict=True)), k
    assert resumed.epoch >= 1


def test_seq_len_change_neither_skips_nor_repeats_tokens():
    stream = _stream(seed=1)
    loader = TokenLoader(stream, 1, 10, BOS, EOS, PAD, shuffle=False, loop=False)
    rows = [next(loader).input_ids[0].tolist() for _ in range(3)]
    loader.set_seq_len(7)
    rows += [next(loader).input_ids[0].tolist() for _ in range(3)]
    docs = [stream.doc(d).tolist() for d in range(stream.num_docs)]
    flat = [t for doc in docs for t in (BOS, *doc, EOS)]
    assert [t for row in rows for t in row] == flat[: 3 * 10 + 3 * 7]


def test_ranks_take_disjoint_slices_of_the_global_batch():
    stream = _stream(seed=2)
    whole = TokenLoader(stream, 4, 8, BOS, EOS, PAD, seed=5)
    ranks = [TokenLoader(stream, 2, 8, BOS, EOS, PAD, seed=5, rank=r, world_size=2) for r in range(2)]
    for _ in range(5):
        w, parts = next(whole), [next(r) for r in ranks]
        assert torch.equal(w.input_ids, torch.cat([p.input_ids for p in parts]))
        assert torch.equal(w.labels, torch.cat([p.labels for p in parts]))
        assert w.doc_lens == parts[0].doc_lens + parts[1].doc_lens


def test_each_epoch_is_a_permutation_of_the_documents():
    stream = _stream(num_docs=40, seed=4)
    pairs = []
    for batch in TokenLoader(stream, 2, 16, BOS, EOS, PAD, seed=7, loop=False):
        keep = batch.labels != IGNORE_INDEX
        pairs += list(zip(batch.input_ids[keep].tolist(), batch.labels[keep].tolist()))
    want = []
    for d in range(stream.num_docs):
        w = [BOS, *stream.doc(d).tolist(), EOS]
        want += list(zip(w[:-1], w[1:]))
    assert sorted(pairs) == sorted(want) and pairs != want  # every pair once, in a shuffled order

    a, b = TokenLoader(stream, 2, 16, BOS, EOS, PAD, seed=7), TokenLoader(stream, 2, 16, BOS, EOS, PAD, seed=8)
    first_a, first_b = next(a), next(b)
    assert not torch.equal(first_a.input_ids, first_b.input_ids)
    assert _equal(first_a, next(TokenLoader(stream, 2, 16, BOS, EOS, PAD, seed=7)))


def test_state_from_a_different_corpus_is_rejected():
    state = TokenLoader(_stream(seed=0), 2, 8, BOS, EOS, PAD).state_dict()
    with pytest.raises(ValueError, match="epoch_tokens"):
        TokenLoader(_stream(seed=9), 2, 8, BOS, EOS, PAD).load_state_dict(state)


def test_tokenize_documents_cache_returns_the_same_tokens(tmp_path):
    docs = [Document("hello world", "a"), Document("", "empty"), Document("héllo ✓", "b")]
    tok = ByteTokenizer(512, BOS, EOS, PAD)
    fresh = tokenize_documents(docs, tok, progress=False)
    assert fresh.tokens.dtype == torch.int32 and fresh.offsets.tolist() == [0, 11, 11, 11 + len("héllo ✓".encode())]
    assert fresh.doc(2).tolist() == list("héllo ✓".encode())
    first = tokenize_documents(docs, tok, cache_dir=tmp_path, progress=False)
    assert len(list(tmp_path.iterdir())) == 1

    class Exploding(ByteTokenizer):
        def encode_batch(self, texts):
            raise AssertionError("cache miss")

    cached = tokenize_documents(docs, Exploding(512, BOS, EOS, PAD), cache_dir=tmp_path, progress=False)
    for s in (first, cached):
        assert torch.equal(s.tokens, fresh.tokens) and torch.equal(s.offsets, fresh.offsets)
    # A different tokenizer or corpus is a different cache entry.
    tokenize_documents(docs, ByteTokenizer(512, BOS, EOS, 500), cache_dir=tmp_path, progress=False)
    tokenize_documents(docs[:2], tok, cache_dir=tmp_path, progress=False)
    assert len(list(tmp_path.iterdir())) == 3


def test_random_windows_resume_exactly_and_spread_over_documents():
    import random
    import string

    from openk3.data.corpus import Document
    from openk3.data.loader import TokenLoader, tokenize_documents
    from openk3.data.tokenizer import ByteTokenizer

    docs = [Document("".join(random.Random(i).choices(string.ascii_letters, k=400)), f"d{i}") for i in range(30)]
    stream = tokenize_documents(docs, ByteTokenizer(1024, 768, 770, 1023), progress=False)
    make = lambda: TokenLoader(stream, 4, 32, 768, 770, 1023, seed=5, random_windows=True)
    full = make()
    batches = [next(full) for _ in range(6)]
    part = make()
    for _ in range(3):
        next(part)
    resumed = make()
    resumed.load_state_dict(part.state_dict())
    for want in batches[3:]:
        got = next(resumed)
        assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.labels, want.labels)
        assert got.doc_lens == want.doc_lens
    # Rows of one batch come from different places: more distinct documents than consecutive windows give.
    first_tokens = {tuple(row[:8].tolist()) for b in batches for row in b.input_ids}
    assert len(first_tokens) >= 20

"""The incremental detokenizer against a full decode: at every token, committed + pending text is exactly
`tokenizer.decode(ids so far)` and the committed text is a prefix of the final text (nothing shown is taken back),
for the byte tokenizer, our BPE and a tiktoken encoding, on random id streams (which split multi-byte characters
and mix in special ids) and on encoded multilingual text; stop strings are found at the token and cut at the index
that searching the whole text would give."""

from __future__ import annotations

import pytest
import torch
from serve_helpers import bpe_tokenizer

from openk3.data.detokenizer import IncrementalDetokenizer
from openk3.data.tokenizer import ByteTokenizer, TikTokenTokenizer

VOCAB, BOS, EOS, PAD = 1024, 768, 770, 1023
TEXT = "héllo wörld — 你好，世界 🎉🎉 naïve café\n\tdef f(x): return x ** 2  # ∑ résumé ✓ " * 3


def _tiktoken() -> TikTokenTokenizer:
    """A small tiktoken encoding: the 256 bytes plus merges of frequent pairs, and the 256 specials on top."""
    ranks = {bytes([b]): b for b in range(256)}
    for word in (b"he", b"ll", b"o ", b"\xc3\xa9", b"\xe4\xbd", b"\xa0\xe5", b"\xf0\x9f", b"def", b"re", b"  "):
        ranks.setdefault(word, len(ranks))
    base = len(ranks)
    names = {base + i: f"<|reserved_token_{base + i}|>" for i in range(256)}
    return TikTokenTokenizer(ranks, names, r"\S+|\s+", base, base + 2, base + 255, "test")


TOKENIZERS = {
    "byte": lambda: ByteTokenizer(VOCAB, BOS, EOS, PAD),
    "bpe": lambda: bpe_tokenizer(VOCAB, BOS, EOS, PAD),
    "tiktoken": _tiktoken,
}


def _streams(tok, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    V = tok.vocab_size
    out = [
        torch.randint(0, V, (300,), generator=g).tolist(),  # anything, special ids included
        torch.randint(128, 256, (200,), generator=g).tolist(),  # mostly high bytes for the byte tokenizer
        tok.encode(TEXT),
    ]
    ids = tok.encode(TEXT)  # the text with a special id dropped in at random places
    for at in torch.randint(0, len(ids), (8,), generator=g).tolist():
        ids.insert(at, V - 1 - int(torch.randint(0, 256, (), generator=g)))
    out.append(ids)
    return out


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_incremental_text_is_the_full_decode_at_every_token(name):
    tok = TOKENIZERS[name]()
    for seed in range(3):
        for ids in _streams(tok, seed):
            final = tok.decode(ids)
            detok = IncrementalDetokenizer(tok)
            taker, taken = IncrementalDetokenizer(tok), ""  # hands its committed text over at each token
            longest = 0
            for n, t in enumerate(ids, 1):
                detok.append(t)
                taker.append(t)
                taken += taker.take()
                assert taken == detok.text and taker.pending == detok.pending
                assert detok.text + detok.pending == tok.decode(ids[:n])
                assert final.startswith(detok.text)  # what was committed is never revised
                longest = max(longest, len(detok.window))
            if ids == tok.encode(TEXT):
                assert longest <= 8  # valid text keeps the decoded window short: a step costs O(1), not O(output)
            assert detok.output(finished=True) == final
            assert detok.output(finished=False) == detok.text
    # The text does split characters across tokens, so the pending path is exercised.
    ids = tok.encode(TEXT)
    assert any(tok.decode(ids[:n]).endswith("\ufffd") for n in range(1, len(ids)))


def _full_search(tok, ids: list[int], stop: list[str]) -> tuple[int, str, str] | None:
    """The old rule: after each token decode everything and stop at the first stop string (in list order) found."""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n])
        for s in stop:
            if s in text:
                return n, s, text[: text.index(s)]
    return None


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_stop_strings_match_a_full_search(name):
    tok = TOKENIZERS[name]()
    g = torch.Generator().manual_seed(1)
    found = 0
    for ids in _streams(tok, 0):
        final = tok.decode(ids)
        for _ in range(12):
            a = int(torch.randint(0, max(1, len(final) - 6), (), generator=g))
            L = int(torch.randint(1, 6, (), generator=g))
            stop = [final[a : a + L], "never-in-the-text", final[a + 1 : a + 3] or "x"]
            stop = [s for s in stop if s]
            want = _full_search(tok, ids, stop)
            detok = IncrementalDetokenizer(tok, stop)
            got = None
            for n, t in enumerate(ids, 1):
                detok.append(t)
                s = detok.find_stop()
                if s is not None:
                    got = n, s, detok.output(finished=True)
                    break
            assert got == want
            found += want is not None
    assert found >= 20

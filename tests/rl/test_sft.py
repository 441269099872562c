"""The SFT warm start's demonstration stream: the guess share, its determinism and its resumable state."""

from __future__ import annotations

import pytest

from openk3.config import K3Config
from openk3.data.tokenizer import train_bpe
from openk3.rl.sft import COPY_SPAN, CopyStream, DemoStream

FAMILIES = ["calculator", "files", "code-fix"]


@pytest.fixture(scope="module")
def tokenizer():
    text = K3Config.preset("tiny").text_config
    special = {"bos": text.bos_token_id, "eos": text.eos_token_id, "pad": text.pad_token_id}
    return train_bpe(["print(12 * 34) cat grep done"] * 20, text.vocab_size, special)


def _calls(tokenizer, ids: list[int]) -> bool:
    """Whether the episode holds a tool result (an XTML tool message)."""
    return 'message role="tool"' in tokenizer.decode(ids)


def test_guess_share_zero_and_one(tokenizer):
    with_tools = DemoStream(FAMILIES, tokenizer, seed=1).batch(9)
    guesses = DemoStream(FAMILIES, tokenizer, seed=1, guess_share=1.0).batch(9)
    assert all(_calls(tokenizer, ids) for ids, _ in with_tools)
    assert not any(_calls(tokenizer, ids) for ids, _ in guesses)
    # A guess episode is the prompt and one short answer: shorter than the demonstration of the same task.
    for (demo, _), (guess, mask) in zip(with_tools, guesses):
        assert len(guess) < len(demo) and any(mask)


def test_guess_share_is_a_seeded_share_and_resumes(tokenizer):
    stream = DemoStream(FAMILIES, tokenizer, seed=2, guess_share=0.5)
    first = stream.batch(20)
    guessed = sum(not _calls(tokenizer, ids) for ids, _ in first)
    assert 4 <= guessed <= 16  # binomial(20, 0.5): outside this with p < 0.012
    state = stream.state_dict()
    rest = stream.batch(6)
    again = DemoStream(FAMILIES, tokenizer, seed=2, guess_share=0.5)
    assert again.batch(20) == first
    again.load_state_dict(state)
    assert again.batch(6) == rest


def test_guess_share_out_of_range_is_refused(tokenizer):
    with pytest.raises(ValueError, match="guess_share"):
        DemoStream(FAMILIES, tokenizer, seed=0, guess_share=1.5)


def test_copy_sequences_are_a_span_then_itself(tokenizer):
    stream = CopyStream(FAMILIES, tokenizer, seed=3)
    sep = tokenizer.encode("\n")
    for ids, mask in stream.batch(12):
        n = sum(mask)
        assert COPY_SPAN[0] <= n <= COPY_SPAN[1] or n == (len(ids) - len(sep)) // 2
        assert len(ids) == 2 * n + len(sep) and mask == [False] * (n + len(sep)) + [True] * n
        assert ids[:n] == ids[n + len(sep) :] and ids[n : n + len(sep)] == sep
    state = stream.state_dict()
    rest = stream.batch(3)
    again = CopyStream(FAMILIES, tokenizer, seed=3)
    again.load_state_dict(state)
    assert again.batch(3) == rest

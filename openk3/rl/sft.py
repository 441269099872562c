"""The SFT warm start: a fresh tiny policy, its tokenizer, and supervised steps on generated demonstrations.

RL needs a policy whose success rate is low but not zero (a group whose samples all score the same has zero
advantage and teaches nothing). A fresh tiny model knows neither XTML nor the tools, so `k3 rl --sft-steps N` first
trains it on the task families' scripted demonstrations (`TaskFamily.demonstration`): the episode's tokens built
exactly as rollouts build them (`transcript.episode_ids`), cross-entropy on the assistant's tokens only.

The fresh policy's tokenizer is a byte-level BPE with K3's special layout (so it speaks XTML), trained on the text
of the training split's demonstrations: the tiny vocabulary then spends its merges on the tool markup and the
tasks' words, which keeps episodes short; digits are single tokens, so a number copied from the prompt into a tool
call, or from a tool's output into the answer, is the same tokens in both places (a byte-level BPE would merge
" 5804" and "(5804" differently, which a tiny model cannot learn to copy).

A fresh tiny model is not a pretrained language model, and the one skill every task here needs, copying a span
of the context, is what pretraining gives a real model (induction heads; Olsson et al., 2022). On this policy 300
SFT steps on whole episodes had not taught it to copy (held-out success 0%), while short sequences did within about
220 steps (docs/rl.md, "The warm start of a fresh policy"). So `k3 rl --copy-steps N` first pre-trains on
`CopyStream`: short spans of the families' text, each followed by itself, with the loss on the copy; the SFT steps
then only learn what to copy where.

`--sft-guess-share g` replaces a share g of the demonstrations by tool-free guesses (`TaskFamily.guess`: an answer
of the right form, given without looking), so the warm-started policy calls its tools only part of the time, as a
cold start from mixed data does; RL then has two behaviours to choose between by their rewards. The share is off
(0) by default.
"""

from __future__ import annotations

import random

import torch

from openk3.config import K3Config
from openk3.data.tokenizer import train_bpe
from openk3.data.xtml import render_xtml
from openk3.rl.envs import Task, get_family, initial_messages
from openk3.rl.transcript import episode_ids

TOKENIZER_EPISODES = 600  # demonstrations per family the tokenizer is trained on


def demonstration_ids(task: Task, tokenizer, guess_rng: random.Random | None = None) -> tuple[list[int], list[bool]]:
    """(tokens, loss mask) of the task's demonstration episode; of a tool-free guess when `guess_rng` is given."""
    family = get_family(task.family)
    turns = family.demonstration(task) if guess_rng is None else family.guess(task, guess_rng)
    return episode_ids(initial_messages(task), turns, task.tools, tokenizer)


def train_policy_tokenizer(families: list[str], text_config, seed: int = 0):
    """A BPE for the policy, trained on the text (not the markers) of training-split demonstrations."""
    texts = []
    for name in families:
        family = get_family(name)
        for i in range(TOKENIZER_EPISODES):
            task = family.generate("train", seed * 1_000_003 + i)
            messages = initial_messages(task) + family.demonstration(task)
            segments = render_xtml(messages, task.tools, add_generation_prompt=True, thinking=False)
            texts.append("".join(s.text for s in segments if not s.allow_special))
    special = {"bos": text_config.bos_token_id, "eos": text_config.eos_token_id, "pad": text_config.pad_token_id}
    return train_bpe(texts, text_config.vocab_size, special, split_digits=True)


def fresh_policy(preset: str, families: list[str], seed: int):
    """(model, tokenizer): a freshly initialised fp32 model of `preset` and a tokenizer trained for `families`."""
    from openk3.train.checkpoint import build_model

    config = K3Config.preset(preset)
    tokenizer = train_policy_tokenizer(families, config.text_config, seed)
    model = build_model(config)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model, tokenizer


class _SeededStream:
    """A stream of examples made from training-split tasks, round-robin over the families; a seeded RNG and the count
    drawn are its whole (resumable) state."""

    def __init__(self, families: list[str], tokenizer, seed: int):
        self.families, self.tokenizer = families, tokenizer
        self.rng = random.Random(seed)
        self.drawn = 0

    def _next_task(self) -> Task:
        family = get_family(self.families[self.drawn % len(self.families)])
        self.drawn += 1
        return family.generate("train", self.rng.randrange(2**31))

    def state_dict(self) -> dict:
        return {"drawn": self.drawn, "rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.drawn = state["drawn"]
        version, internal, gauss = state["rng"]  # JSON-ish checkpoints turn the state's tuple into a list
        self.rng.setstate((version, tuple(internal), gauss))


COPY_SPAN = (6, 24)  # tokens per copied span
COPY_BATCH = 32  # sequences per copy pre-training step


class CopyStream(_SeededStream):
    """Copy pre-training sequences: `span + "\n" + span`, the span a random window of the tokenized text of a
    training-split demonstration (prompt, tool arguments, observations, answer: the tokens episodes copy), the loss
    mask on the second copy."""

    def __init__(self, families: list[str], tokenizer, seed: int):
        super().__init__(families, tokenizer, seed ^ 0x5EED)
        self.sep = tokenizer.encode("\n")

    def _text(self, task: Task) -> str:
        messages = initial_messages(task) + get_family(task.family).demonstration(task)
        parts = [m.get("content") or "" for m in messages]
        parts += [c["function"]["arguments"] for m in messages for c in m.get("tool_calls", [])]
        return " ".join(p for p in parts if p)

    def batch(self, n: int) -> list[tuple[list[int], list[bool]]]:
        out = []
        for _ in range(n):
            ids = self.tokenizer.encode(self._text(self._next_task()))
            length = min(self.rng.randint(*COPY_SPAN), len(ids))
            start = self.rng.randrange(len(ids) - length + 1)
            span = ids[start : start + length]
            out.append((span + self.sep + span, [False] * (length + len(self.sep)) + [True] * length))
        return out


class DemoStream(_SeededStream):
    """Demonstrations of the training split, round-robin over the families, in a seeded order; a share `guess_share`
    of them are tool-free guesses instead."""

    def __init__(self, families: list[str], tokenizer, seed: int, guess_share: float = 0.0):
        if not 0 <= guess_share <= 1:
            raise ValueError(f"guess_share must be in [0, 1], got {guess_share}")
        super().__init__(families, tokenizer, seed)
        self.guess_share = guess_share

    def batch(self, n: int) -> list[tuple[list[int], list[bool]]]:
        out = []
        for _ in range(n):
            task = self._next_task()
            guess = self.guess_share > 0 and self.rng.random() < self.guess_share
            out.append(demonstration_ids(task, self.tokenizer, self.rng if guess else None))
        return out

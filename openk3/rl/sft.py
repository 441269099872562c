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

Legend: T packed tokens.
"""

from __future__ import annotations

import random

import torch

from openk3.config import K3Config
from openk3.data.tokenizer import train_bpe
from openk3.data.xtml import render_xtml
from openk3.rl.envs import Task, get_family, initial_messages
from openk3.rl.logprobs import sequence_logprobs
from openk3.rl.transcript import episode_ids

TOKENIZER_EPISODES = 600  # demonstrations per family the tokenizer is trained on


def demonstration_ids(task: Task, tokenizer) -> tuple[list[int], list[bool]]:
    """(tokens, loss mask) of the task's demonstration episode."""
    turns = get_family(task.family).demonstration(task)
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


class DemoStream:
    """Demonstrations of the training split, round-robin over the families, in a seeded order."""

    def __init__(self, families: list[str], tokenizer, seed: int):
        self.families, self.tokenizer = families, tokenizer
        self.rng = random.Random(seed)
        self.drawn = 0

    def batch(self, n: int) -> list[tuple[list[int], list[bool]]]:
        out = []
        for _ in range(n):
            family = get_family(self.families[self.drawn % len(self.families)])
            self.drawn += 1
            out.append(demonstration_ids(family.generate("train", self.rng.randrange(2**31)), self.tokenizer))
        return out

    def state_dict(self) -> dict:
        return {"drawn": self.drawn, "rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.drawn = state["drawn"]
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))


def sft_loss(model, batch: list[tuple[list[int], list[bool]]]) -> tuple[torch.Tensor, int]:
    """Mean cross-entropy over the batch's assistant tokens (one packed forward), and their count."""
    logps = sequence_logprobs(model, [ids for ids, _ in batch])
    mask_T = torch.tensor([m for _, mask in batch for m in mask[1:]], dtype=torch.bool)
    logp_T = torch.cat(logps)
    n = int(mask_T.sum())
    return -(logp_T * mask_T).sum() / max(n, 1), n

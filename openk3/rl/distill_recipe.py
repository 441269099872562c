"""The worked distillation recipe on CPU (`benchmarks/distill.py`): a cold-start student and one teacher per domain
and effort, all tiny, all from the RL issue's task families, all built with SFT on scripted demonstrations.

    domains     calculator, code-fix (no effort tag: thinking off, as `k3 rl` episodes)
                files:low, files:max (thinking on; the effort decides how much the think channel says)

Effort is the length of the think channel. `effort_turns(task, effort)` adds to each demonstration message a
reasoning of the effort's size: none at `low`, a few words at `high`, at `max` a plan that names the tool, copies its
arguments twice and says how the output will be checked, and for the answer a check that repeats the value. Success
does not depend on it (the tool calls and the answer are the same), so a low-effort expert is as right as a
max-effort one in fewer tokens: what K3's effort levels aim at. The max demonstrations are about 2.4x the low ones in
the recipe tokenizer's tokens (files: 208 against 87), so the teachers themselves are further apart than the
target's 0.6x; an earlier one-sentence max reasoning gave only 0.65x, which no student could beat.

The cold start (the student's init, and b0's model) is copy pre-training then SFT on a mixture of every domain with a
share of tool-free guesses (a weak, partly tool-using policy, as in the RL recipe); its effort-tagged episodes carry
a random effort tag and a reasoning that is mostly the top effort's (`long_share`), else the tag's: it has seen the
format and the tag, thinks at length and does not follow the tag when greedy.
Each teacher is the cold start trained further by SFT on its own domain and effort alone, without guesses, with the
reasoning of its effort and no effort tag (the teacher is the expert of that effort; Eq. 15's π_teacher(y | x)).

Legend: (ids, mask) an episode's tokens and its loss mask (the assistant's tokens).
"""

from __future__ import annotations

import json
import math
import random

import torch

from openk3.data.tokenizer import train_bpe
from openk3.data.xtml import render_xtml
from openk3.rl.envs import Task, get_family, initial_messages
from openk3.rl.evaluate import check_selection, episode_results, held_out_episodes, summarize
from openk3.rl.sft import COPY_BATCH, CopyStream
from openk3.rl.teachers import TeacherKey, top_efforts
from openk3.rl.transcript import episode_ids
from openk3.train.balance import Balancer
from openk3.train.batch import TokenBatch
from openk3.train.core import TrainCore
from openk3.train.distributed import Layout
from openk3.train.optim import param_groups

TOKENIZER_EPISODES = 400  # demonstrations per (domain, effort) the recipe's tokenizer is trained on


def reasoning(message: dict, answer: str | None, effort: str) -> str:
    """The think channel of a demonstration message at `effort` ("" at low)."""
    calls = message.get("tool_calls") or []
    if effort == "low":
        return ""
    if effort == "high":
        return "use " + ", ".join(c["function"]["name"] for c in calls) if calls else "answer"
    if calls:
        parts, values = [], []
        for c in calls:
            args = json.loads(c["function"]["arguments"])
            parts.append(f"call {c['function']['name']} with " + ", ".join(f"{k} {v}" for k, v in args.items()))
            values.append(f"{c['function']['name']} " + " ".join(str(v) for v in args.values()))
        plan, check = " and ".join(parts), "; ".join(values)
        return (
            f"The question needs a tool. I will {plan}, then read its output. Plan: first {check}; then read "
            f"the line it prints; then check that the line answers the question; then give only the value. "
            f"Before the call, once more: {check}."
        )
    shown = message.get("content") or answer or ""
    return (
        f"The output gives {shown}. The question asks for one value, and {shown} is that value. Check: the "
        f"output line contains {shown}, so it answers the question. The answer is {shown}."
    )


def effort_turns(task: Task, effort: str | None) -> list[dict]:
    """The family's demonstration with every assistant message's reasoning at `effort` (None: unchanged)."""
    turns = get_family(task.family).demonstration(task)
    if effort is None:
        return turns
    return [{**m, "reasoning_content": reasoning(m, task.answer, effort)} if m["role"] == "assistant" else m
            for m in turns]  # fmt: skip


def demo_ids(task: Task, tokenizer, *, style: str | None, tag: str | None, guess_rng=None) -> tuple[list, list]:
    """(ids, mask) of a demonstration: reasoning of `style` (None: thinking off), effort tag `tag` in the prompt; a
    tool-free guess when `guess_rng` is given."""
    family = get_family(task.family)
    turns = family.guess(task, guess_rng) if guess_rng is not None else effort_turns(task, style)
    if guess_rng is not None and style is not None:
        turns = [{**m, "reasoning_content": reasoning(m, task.answer, style)} for m in turns]
    return episode_ids(initial_messages(task), turns, task.tools, tokenizer, thinking=style is not None, effort=tag)


def recipe_tokenizer(keys: list[TeacherKey], text_config, seed: int = 0, episodes: int = TOKENIZER_EPISODES):
    """A BPE for the recipe, trained on the text of `episodes` training-split demonstrations of every key at its
    effort."""
    texts = []
    for key in keys:
        family = get_family(key.domain)
        for i in range(episodes):
            task = family.generate("train", seed * 1_000_003 + i)
            messages = initial_messages(task) + effort_turns(task, key.effort)
            segments = render_xtml(messages, task.tools, add_generation_prompt=True, thinking=key.thinking)
            texts.append("".join(s.text for s in segments if not s.allow_special))
    special = {"bos": text_config.bos_token_id, "eos": text_config.eos_token_id, "pad": text_config.pad_token_id}
    return train_bpe(texts, text_config.vocab_size, special, split_digits=True)


class RecipeStream:
    """Seeded demonstrations for one stage: round-robin over `keys`; `student=True` gives the cold start's mixture
    (a random effort tag; the reasoning of the domain's top effort with probability `long_share`, else of the tag's
    own effort; `guess_share` tool-free guesses), else a teacher's data (its effort's reasoning, no tag, no guesses).

    The cold start mostly thinks at length, whatever the tag says: its greedy episodes are long at every effort, and
    b0(x) (measured at the top effort) is the natural thinking length that the budget cuts down at lower efforts, as
    in K3. The tag is not meaningless to it, though: a low tag comes with short reasoning in 1 − `long_share` of its
    demonstrations, as a cold-start SFT set with some effort-matched data would give. A cold start that had never
    seen the tag matter (reasoning size drawn independently of it) did not learn to follow it in 30 steps of
    distillation at 2e-4 (the greedy lengths at low and max stayed within 1%; at 1e-3 success collapsed instead):
    the one token that decides the length gets its −R_max, but the gradient must build the tag's use from
    nothing (docs/distill.md)."""

    def __init__(self, keys: list[TeacherKey], tokenizer, seed: int, *, student: bool, guess_share: float = 0.0,
                 long_share: float = 0.75):  # fmt: skip
        if not 0 <= long_share <= 1:
            raise ValueError(f"long_share must be in [0, 1], got {long_share}")
        self.keys, self.tokenizer, self.student, self.guess_share = keys, tokenizer, student, guess_share
        self.long_share = long_share
        self.rng = random.Random(seed)
        self.drawn = 0
        self.efforts = {k.domain: sorted(x.effort for x in keys if x.domain == k.domain and x.effort) for k in keys}
        self.top = top_efforts(keys)

    def batch(self, n: int) -> list[tuple[list[int], list[bool]]]:
        out = []
        for _ in range(n):
            key = self.keys[self.drawn % len(self.keys)]
            self.drawn += 1
            task = get_family(key.domain).generate("train", self.rng.randrange(2**31))
            guess = self.rng if self.student and self.rng.random() < self.guess_share else None
            if not self.student:
                out.append(demo_ids(task, self.tokenizer, style=key.effort, tag=None))
            elif key.effort is None:
                out.append(demo_ids(task, self.tokenizer, style=None, tag=None, guess_rng=guess))
            else:
                efforts = self.efforts[key.domain]
                tag = self.rng.choice(efforts)
                style = self.top[key.domain] if self.rng.random() < self.long_share else tag
                out.append(demo_ids(task, self.tokenizer, style=style, tag=tag, guess_rng=guess))
        return out


def supervised(model, batches, steps: int, lr: float, *, decay: bool = True, progress=None) -> list[float]:
    """`steps` AdamW steps of the `lm` loss on `batches()` on the training core, in this process (the rate linear
    to a tenth when `decay`); the losses."""
    optimizer = torch.optim.AdamW(param_groups(model, 0.0), lr=lr, betas=(0.9, 0.95), foreach=False)
    core = TrainCore(model, Layout.single(), optimizer, balancer=Balancer(model, "none"), grad_clip=1.0)
    model.train()
    losses = []
    for i in range(steps):
        examples = batches()
        batch = TokenBatch.from_sequences([ids for ids, _ in examples], [mask for _, mask in examples])
        losses.append(core.step([batch], "lm", lr * (1 - 0.9 * i / steps if decay else 1.0))["loss"])
        if progress is not None:
            progress(i + 1, losses[-1])
    return losses


def copy_pretrain(model, tokenizer, keys: list[TeacherKey], steps: int, seed: int, lr: float = 2e-3, progress=None):
    """The RL recipe's copy pre-training (sft.CopyStream) over the recipe's domains."""
    stream = CopyStream(sorted({k.domain for k in keys}), tokenizer, seed)
    return supervised(model, lambda: stream.batch(COPY_BATCH), steps, lr, decay=False, progress=progress)


def save_policy(model, tokenizer, path: str) -> str:
    """A release-format checkpoint folder with its tokenizer (what `--init` and `--teachers` take)."""
    model.save_pretrained(path)
    tokenizer.save(path)
    return path


def policy_episodes(model, tokenizer, keys: list[TeacherKey], tasks: int, fleet, *, tagged: bool,
                    max_turns: int = 4, max_tokens: int = 256, max_tokens_per_turn: int = 128,
                    temperature: float = 0.0, wall_clock_s: float = math.inf, first: int = 0,
                    split: str = "test", samples: int = 1) -> dict:  # fmt: skip
    """{key: the finished trajectories of the `split`'s tasks `first` .. `first + tasks - 1`, `samples` per task in
    task order} of `model` on its own engine: `rl.evaluate.held_out_episodes` (which says what the options mean).
    `first` > 0 gives a second held-out set, one no checkpoint was chosen on; `split` "train" gives training tasks
    (what a teacher generates for offpolicy distillation).

    No wall clock by default: the turn and token budgets bound every episode (and each tool call keeps its own
    timeout), and all episodes share one batched engine, so an episode's time since reset is the whole batch's and
    depends on the machine's load (with 600 s, an evaluation run beside training scored 5% where the same checkpoint
    scores 55% alone, most likely so). `evaluate_policy` counts the episodes a finite `wall_clock_s` cut."""
    from openk3.rl.config import RLConfig
    from openk3.rl.env import Budgets, TaskSnapshots
    from openk3.rl.loop import engine_config
    from openk3.rl.rollout import RolloutWorker
    from openk3.serve.engine import LLMEngine

    check_selection(first, samples)
    episodes = tasks * samples * len(keys)
    engine = LLMEngine(model, tokenizer, engine_config(RLConfig(out="-"), episodes))
    snapshots = TaskSnapshots(fleet, max_tasks=tasks * len(keys))
    worker = RolloutWorker(engine, tokenizer, fleet, Budgets(max_turns=max_turns, max_tokens=max_tokens,
                                                             wall_clock_s=wall_clock_s),
                           snapshots=snapshots, max_tokens_per_turn=max_tokens_per_turn)  # fmt: skip
    try:
        return held_out_episodes(worker, keys, tasks, tagged=tagged, first=first, samples=samples,
                                 temperature=temperature, split=split)  # fmt: skip
    finally:
        snapshots.close()


def evaluate_policy(model, tokenizer, keys: list[TeacherKey], tasks: int, fleet, *, tagged: bool,
                    **options) -> dict:  # fmt: skip
    """Held-out success, mean response length and the episodes the wall clock cut (`wall_clock_cut`, counted as
    failures) per key's name, over `policy_episodes` (same arguments): `rl.evaluate.summarize`."""
    return summarize(episode_results(policy_episodes(model, tokenizer, keys, tasks, fleet, tagged=tagged, **options)))

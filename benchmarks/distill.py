"""The distillation benchmark and worked recipe (the multi-teacher distillation targets), one run on this machine, written to
runs/bench/distill-cpu.{json,md} unless `--out` names the place (`--out benchmarks/results/distill-cpu` replaces the
committed results):

1. the recipe (the first section below): a recipe tokenizer; a fresh tiny policy with copy pre-training and SFT
   on a mixture of every domain with tool-free guesses (the cold start: the student's init, and b0's model); four
   teachers, each the cold start trained further by SFT on its own domain and effort: calculator, code-fix,
   files:low, files:max (effort = how much the think channel says);
2. each teacher's held-out success and response length in its own context (greedy, the same test tasks);
3. `k3 distill` from the cold start with each method at equal gradient steps: opd (Eq. 15), rl (task reward only),
   topk (forward KL to the teacher's top-k), offpolicy (SFT on teacher samples); held-out success and length per
   key every `--eval-every` steps;
4. targets: `student_over_teacher` per key (the opd student's final success / the teacher's; every distilling
   method's in `student_over_teacher_by_method`, each with its own target row); the steps opd needs
   to reach RL's final score vs the steps RL needed; at low effort the student's length vs at max, and the success
   gap (opd's in `effort`, every distilling method's in `effort_by_method`, each with its own target row). Success
   and length for the targets and tables come from a final greedy evaluation on --final-eval-tasks (144) held-out
   tasks per key of each teacher, the start and each method's last checkpoint; the curves use the runs' own
   --eval-tasks (24) evaluations.

Every stage's output stays in `--work` (checkpoints, run folders); a rerun skips what is done and resumes a run cut
short, so the benchmark can be continued after an interruption.

    python benchmarks/distill.py (or k3 bench distill) [--copy-steps 400] [--cold-steps 120] [--teacher-steps 100]
        [--steps 30] [--methods opd,rl,topk,offpolicy] [--work runs/bench-distill]

`--from-rl RUN` replaces step 1 with a finished RL run (`k3 rl` or benchmarks/rl.py): its step-0 checkpoint (the
warm start, before any RL step) is the student's init and its last checkpoint is the teacher of each of its task
families, so the student starts exactly where that RL run started and "RL from the same start" is measured twice:
by the run itself and by `--method rl` here. The methods then run with that RL run's settings (learning rate,
groups, sampling budgets, KL to the start, held-out tasks), not this script's defaults:

    python benchmarks/distill.py --from-rl runs/bench-c1600 --work runs/bench-distill-rl \
        --out benchmarks/results/distill-rl-expert
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time

import torch
from report import machine_info, out_help, scratch_out, targets_table, write_report

from openk3.config import K3Config
from openk3.data.tokenizer import load_tokenizer, train_bpe
from openk3.data.xtml import render_xtml
from openk3.rl.distill import DistillTrainer
from openk3.rl.distill_config import METHODS, OFFPOLICY_KEEP, OFFPOLICY_WEIGHTS, DistillConfig
from openk3.rl.envs import Task, get_family, initial_messages
from openk3.rl.evaluate import evaluate_policy
from openk3.rl.sft import COPY_BATCH, CopyStream
from openk3.rl.teachers import TeacherKey, parse_teachers, top_efforts
from openk3.rl.transcript import episode_ids
from openk3.train.balance import Balancer
from openk3.train.batch import TokenBatch
from openk3.train.checkpoint import build_model, load_model, resolve_checkpoint
from openk3.train.core import TrainCore
from openk3.train.distributed import Layout
from openk3.train.optim import param_groups

# ---- the recipe ------------------------------------------------------------------------------------------------------
# The worked distillation recipe on CPU (step 1 above): a cold-start student and one teacher per domain
# and effort, all tiny, all from the RL task families, all built with SFT on scripted demonstrations.
#
#     domains     calculator, code-fix (no effort tag: thinking off, as `k3 rl` episodes)
#                 files:low, files:max (thinking on; the effort decides how much the think channel says)
#
# Effort is the length of the think channel. `effort_turns(task, effort)` adds to each demonstration message a
# reasoning of the effort's size: none at `low`, a few words at `high`, at `max` a plan that names the tool, copies its
# arguments twice and says how the output will be checked, and for the answer a check that repeats the value. Success
# does not depend on it (the tool calls and the answer are the same), so a low-effort expert is as right as a
# max-effort one in fewer tokens: what K3's effort levels aim at. The max demonstrations are about 2.4x the low ones in
# the recipe tokenizer's tokens (files: 208 against 87), so the teachers themselves are further apart than the
# target's 0.6x; an earlier one-sentence max reasoning gave only 0.65x, which no student could beat.
#
# The cold start (the student's init, and b0's model) is copy pre-training then SFT on a mixture of every domain with a
# share of tool-free guesses (a weak, partly tool-using policy, as in the RL recipe); its effort-tagged episodes carry
# a random effort tag and a reasoning that is mostly the top effort's (`long_share`), else the tag's: it has seen the
# format and the tag, thinks at length and does not follow the tag when greedy.
# Each teacher is the cold start trained further by SFT on its own domain and effort alone, without guesses, with the
# reasoning of its effort and no effort tag (the teacher is the expert of that effort; Eq. 15's π_teacher(y | x)).
#
# Legend: (ids, mask) an episode's tokens and its loss mask (the assistant's tokens).

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


# ---- the benchmark ---------------------------------------------------------------------------------------------------
KEYS = "calculator,code-fix,files:low,files:max"


def parse_keys(text: str) -> list[TeacherKey]:
    return sorted(parse_teachers(",".join(f"{k}=-" for k in text.split(","))))


def progress_bar(desc: str, total: int):
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, leave=False, disable=None)

    def tick(i: int, loss: float) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")
        if bar.disable and (i % 10 == 0 or i == total):  # no terminal: a line every 10 steps for the log
            print(f"{desc}: step {i}/{total}, loss {loss:.3f}", flush=True)

    return bar, tick


def teacher_folder(work: str, key: TeacherKey) -> str:
    """Where the recipe saves the teacher of `key` under --work (files:low -> WORK/teacher-files-low)."""
    return os.path.join(work, f"teacher-{str(key).replace(':', '-')}")


def build_recipe(args, keys: list[TeacherKey], times: dict) -> dict[TeacherKey, str]:
    """The cold start and the teachers, each saved once under --work; returns {key: teacher folder}."""
    cold = os.path.join(args.work, "cold")
    config = K3Config.preset("tiny")
    if not os.path.exists(os.path.join(cold, "config.json")):
        t0 = time.perf_counter()
        tokenizer = recipe_tokenizer(keys, config.text_config, args.seed)
        model = build_model(config)
        model.init_weights(torch.Generator().manual_seed(args.seed))
        bar, tick = progress_bar("copy", args.copy_steps)
        copy_pretrain(model, tokenizer, keys, args.copy_steps, args.seed, progress=tick)
        bar.close()
        stream = RecipeStream(keys, tokenizer, args.seed, student=True, guess_share=args.guess_share,
                              long_share=args.long_share)  # fmt: skip
        bar, tick = progress_bar("cold start", args.cold_steps)
        supervised(model, lambda: stream.batch(args.batch), args.cold_steps, args.sft_lr, progress=tick)
        bar.close()
        save_policy(model, tokenizer, cold)
        times["cold_start_s"] = time.perf_counter() - t0
        print(f"cold start: {times['cold_start_s']:.0f} s", flush=True)
    teachers = {}
    for key in keys:
        path = teacher_folder(args.work, key)
        teachers[key] = path
        if os.path.exists(os.path.join(path, "config.json")):
            continue
        t0 = time.perf_counter()
        model, folder = load_model(cold, dtype=torch.float32)
        tokenizer = load_tokenizer(folder, model.text_config)
        stream = RecipeStream([key], tokenizer, args.seed + 1, student=False)
        bar, tick = progress_bar(f"teacher {key}", args.teacher_steps)
        supervised(model, lambda s=stream: s.batch(args.batch), args.teacher_steps, args.sft_lr / 2, progress=tick)
        bar.close()
        save_policy(model, tokenizer, path)
        times[f"teacher_{key}_s"] = time.perf_counter() - t0
        print(f"teacher {key}: {times[f'teacher_{key}_s']:.0f} s", flush=True)
    return teachers


RECIPE_BUDGETS = {"max_turns": 4, "max_tokens": 384, "max_tokens_per_turn": 192}  # the recipe's episode budgets
# What --from-rl takes from the RL run's rl_config.json.
RL_RUN_SETTINGS = ("lr", "groups_per_step", "group_size", "max_turns", "max_tokens", "max_tokens_per_turn",
                   "kl_coef", "eval_tasks")  # fmt: skip


def from_rl_run(run: str) -> tuple[str, dict[TeacherKey, str], dict]:
    """(the student's init: the run's step-0 checkpoint, saved before its first RL step; {family key: the run's
    last checkpoint}; the run's settings of RL_RUN_SETTINGS) of a finished `k3 rl` run folder."""
    config_file, ckpts = os.path.join(run, "rl_config.json"), os.path.join(run, "checkpoints")
    rl_cfg, latest = _load(config_file), os.path.join(ckpts, "latest")
    if rl_cfg is None or not os.path.exists(latest):
        raise SystemExit(f"--from-rl {run}: not a finished k3 rl run (needs rl_config.json and checkpoints/latest)")
    with open(latest, encoding="utf-8") as f:
        last = os.path.join(ckpts, f.read().strip())
    first = os.path.join(ckpts, "step-00000000")  # saved before the first RL step; keep_checkpoints may prune it
    if not os.path.isdir(first):
        raise SystemExit(f"--from-rl {run}: its warm start {first} was pruned (k3 rl --keep-checkpoints)")
    if first == last:
        raise SystemExit(f"--from-rl {run}: the run has one checkpoint; the teacher must be a later one than the start")
    return first, {k: last for k in parse_keys(rl_cfg["task"])}, {k: rl_cfg[k] for k in RL_RUN_SETTINGS}


def run_method(args, method: str, teachers: dict[TeacherKey, str], init: str, settings: dict) -> list[dict]:
    """`k3 distill --method METHOD` from `init` (resumed if cut short) with `settings` (DistillConfig fields);
    its metrics rows."""
    out = os.path.join(args.work, f"run-{method}")
    metrics = os.path.join(out, "metrics.jsonl")
    rows = _rows(metrics)
    if rows and rows[-1].get("step") == args.steps and "eval_success" in rows[-1]:
        return rows
    cfg = DistillConfig(teachers=",".join(f"{k}={p}" for k, p in sorted(teachers.items())), out=out, init=init,
                        steps=args.steps, method=method, seed=args.seed, eval_every=args.eval_every, save_every=5,
                        resume=os.path.exists(metrics), tau_anneal_steps=args.tau_anneal_steps,
                        **settings)  # fmt: skip
    t0 = time.perf_counter()
    trainer = DistillTrainer(cfg, log=lambda *a, **k: print(f"[{method}]", *a, flush=True))
    try:
        trainer.run()
    finally:
        trainer.close()
    print(f"{method}: {time.perf_counter() - t0:.0f} s", flush=True)
    return _rows(metrics)


def evaluate_models(models: list[tuple[str, str, list[TeacherKey], bool]], tasks: int, budgets: dict, *,
                    temperature: float = 0.0, tokenizer=None, first: int = 0):  # fmt: skip
    """For each (name, checkpoint, keys, tagged) of `models` in turn: (name, checkpoint, `evaluate_policy`'s {key:
    {success, length}} on the test split's `tasks` tasks per key from task `first` (0: its first), seconds), in one
    sandbox fleet. A model's own tokenizer unless `tokenizer` is given."""
    from openk3.sandbox.fleet import Fleet

    with Fleet(max_sandboxes=tasks * max(len(ks) for _, _, ks, _ in models) + 8, warm=2, memory_mb=256) as fleet:
        for name, path, keys, tagged in models:
            t0 = time.perf_counter()
            model, folder = load_model(path, dtype=torch.float32)
            tok = tokenizer if tokenizer is not None else load_tokenizer(folder, model.text_config)
            got = evaluate_policy(model.eval(), tok, keys, tasks, fleet, tagged=tagged, temperature=temperature,
                                  first=first, **budgets)  # fmt: skip
            yield name, path, got, time.perf_counter() - t0


def effort_targets(keys: list[TeacherKey], finals: dict[str, dict]) -> tuple[dict, list[dict]]:
    """The effort target for each distilling method's final evaluation (opd's first; rl is no distillation): at the
    lowest effort the student's length is at most 0.6x its length at the highest, and its success there within 10
    points of it, either way. ({method: {length_ratio, success_gap (max - low), low, max}}, target rows); nothing
    without two efforts of one domain."""
    efforts = sorted({k.effort for k in keys if k.effort}, key=["low", "high", "max"].index)
    if len(efforts) < 2:
        return {}, []
    domain = next(k.domain for k in keys if k.effort)
    lo, hi = f"{domain}:{efforts[0]}", f"{domain}:{efforts[-1]}"
    by_method, rows = {}, []
    for method in sorted((m for m in finals if m != "rl"), key=lambda m: m != "opd"):
        final = finals[method]
        length_ratio = final["eval_length"][lo] / max(final["eval_length"][hi], 1e-9)
        gap = final["eval_success"][hi] - final["eval_success"][lo]
        by_method[method] = {"length_ratio": length_ratio, "success_gap": gap, "low": lo, "max": hi}
        rows.append({"target": f"{method}: {lo} length <= 0.6x {hi}, success within 10 points",
                     "measured": f"{final['eval_length'][lo]:.0f} / {final['eval_length'][hi]:.0f} tokens = "
                                 f"{length_ratio:.2f}x; success {final['eval_success'][lo]:.0%} vs "
                                 f"{final['eval_success'][hi]:.0%}",
                     "met": length_ratio <= 0.6 and abs(gap) <= 0.10 + 1e-9})  # fmt: skip
    return by_method, rows


def success_ratio(student: dict[str, float], teacher: dict[str, float]) -> dict[str, float | None]:
    """{key: the student's success / the teacher's} over the teacher's keys; None where the teacher solves nothing."""
    return {k: student[k] / t if t > 0 else None for k, t in teacher.items()}


def _budgets(settings: dict) -> dict:
    return {k: settings[k] for k in ("max_turns", "max_tokens", "max_tokens_per_turn")}


def final_evaluation(args, teachers: dict[TeacherKey, str], init: str, methods: list[str], settings: dict) -> dict:
    """The evaluation the targets are judged on: greedy, the test split's first --final-eval-tasks tasks per key (the
    curves' --eval-tasks among them; 24 tasks are 4.2 points each, too coarse for a 95% ratio). Each teacher on its
    own key without the tag, the student's start and each method's last checkpoint on every key with it.
    {name: {"path": checkpoint, "eval": {key: {success, length}}}}, names "teacher KEY", "start" and the methods;
    cached in --work/final_eval_N.json by checkpoint path and contents (`fingerprint`), so a rerun only re-renders,
    and a continued run (a later last checkpoint) or one run again in a cleared folder (the same path, new weights)
    is evaluated again. The file holds paths under --work relative to it, so a copied work folder keeps its cache;
    the returned paths are whole."""
    n = args.final_eval_tasks
    keys = sorted(teachers)
    cache_file = os.path.join(args.work, f"final_eval_{n}.json")
    cache = _load(cache_file) or {}  # as stored: paths under --work relative to it
    models = [(f"teacher {k}", path, [k], False) for k, path in sorted(teachers.items())]
    models += [("start", init, keys, True)]
    models += [(m, resolve_checkpoint(os.path.join(args.work, f"run-{m}")), keys, True) for m in methods]
    todo = [m for m in models if m[0] not in cache or _stale(args.work, cache[m[0]], m[1])]
    if todo:
        for name, path, got, seconds in evaluate_models(todo, n, _budgets(settings)):
            cache[name] = {"path": _in_work(args.work, path), "fingerprint": fingerprint(path), "eval": got}
            with open(cache_file, "w", encoding="utf-8") as f:  # each model as it finishes: resumable
                json.dump(cache, f, indent=1)
            print(f"final evaluation ({n} tasks per key) {name}: {got} ({seconds:.0f} s)", flush=True)
    return {name: {"path": _from_work(args.work, got["path"]), "eval": got["eval"]} for name, got in cache.items()}


def fingerprint(path: str) -> str:
    """sha256 over a checkpoint folder's file names and bytes (nothing there: the hash of nothing). The path alone
    cannot tell a checkpoint apart from the one evaluated before: a run folder deleted and run again with other
    settings (a new --lr) ends at the same step-N path."""
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(path) if os.path.isdir(path) else ():
        dirs.sort()
        for name in sorted(files):
            digest.update(os.path.relpath(os.path.join(root, name), path).encode() + b"\0")
            with open(os.path.join(root, name), "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()


def _stale(work: str, entry: dict, path: str) -> bool:
    """Whether a cached final evaluation is not of the checkpoint at `path` now: another path, or other contents
    (an entry written before fingerprints were kept is trusted by its path)."""
    if os.path.normpath(_from_work(work, entry["path"])) != os.path.normpath(path):
        return True
    return "fingerprint" in entry and entry["fingerprint"] != fingerprint(path)


def _in_work(work: str, path: str) -> str:
    """`path` relative to `work` when it lies under it (how the cache stores it), else whole."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(work))
    return path if rel == ".." or rel.startswith(".." + os.sep) else rel


def _from_work(work: str, path: str) -> str:
    """The inverse of `_in_work`: a whole path (a cache written before paths were relative keeps its whole ones)."""
    return path if os.path.isabs(path) else os.path.join(work, path)


def _eval_row(evaluation: dict) -> dict:
    """{key: {success, length}} as a metrics row's {"eval_success": {key: ...}, "eval_length": {key: ...}}."""
    return {"eval_success": {k: v["success"] for k, v in evaluation.items()},
            "eval_length": {k: v["length"] for k, v in evaluation.items()}}  # fmt: skip


def _rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _load(path: str):
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _score(row: dict) -> float:
    """The mean held-out success over the keys."""
    return sum(row["eval_success"].values()) / len(row["eval_success"])


def steps_to(curve: list[tuple[int, float]], score: float) -> int | None:
    """The first evaluated step whose score is at least `score` (None: never)."""
    return next((step for step, s in curve if s >= score - 1e-9), None)


def lr_segments(rows: list[dict]) -> list[dict]:
    """The learning rate a run trained at, read back from its metrics rows: runs of steps at one constant rate, or
    moving one way (a decay), as {first, last, lr_first, lr_last}. A run resumed with another --lr or schedule
    shows as more than one segment, so its report says what it trained at rather than its last command's rate."""
    segments: list[dict] = []
    for row in rows:
        if "lr" not in row:
            continue  # an evaluation row
        step, lr = row["step"], row["lr"]
        seg = segments[-1] if segments else None
        if seg is not None and step == seg["last"] + 1:
            same = abs(lr - seg["lr_last"]) <= 1e-9 * max(abs(lr), abs(seg["lr_last"]))
            if seg["first"] == seg["last"]:
                fits = True  # a second step fixes the segment's direction (or constancy)
            elif seg["lr_first"] == seg["lr_last"]:
                fits = same
            else:
                fits = not same and (lr < seg["lr_last"]) == (seg["lr_last"] < seg["lr_first"])
            if fits:
                seg["last"], seg["lr_last"] = step, (seg["lr_last"] if same else lr)
                continue
        segments.append({"first": step, "last": step, "lr_first": lr, "lr_last": lr})
    return segments


def lr_history(segments: list[dict]) -> str:
    """segments as 'steps 1-100: 1.98e-03 -> 2.00e-04, 101-200: 2.00e-04'."""
    parts = []
    for s in segments:
        rate = f"{s['lr_first']:.2e}" + ("" if s["lr_first"] == s["lr_last"] else f" -> {s['lr_last']:.2e}")
        parts.append(f"{s['first']}-{s['last']}: {rate}" if s["last"] > s["first"] else f"{s['first']}: {rate}")
    return "steps " + ", ".join(parts) if parts else "not in the metrics"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="runs/bench-distill", help="checkpoints and run folders (reused when present)")
    p.add_argument("--keys", default=KEYS, help="the teachers' keys, domain[:effort],...")
    p.add_argument("--copy-steps", type=int, default=400)
    p.add_argument("--cold-steps", type=int, default=120, help="SFT steps of the cold start on the mixture")
    p.add_argument("--teacher-steps", type=int, default=100, help="SFT steps of each teacher on its own data")
    p.add_argument("--guess-share", type=float, default=0.5, help="tool-free guesses in the cold start's SFT")
    p.add_argument(
        "--long-share",
        type=float,
        default=0.75,
        help="cold start: share of effort-tagged demonstrations reasoning at the top effort",
    )
    p.add_argument("--batch", type=int, default=12, help="demonstrations per SFT step")
    p.add_argument("--sft-lr", type=float, default=2e-3)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--steps", type=int, default=30, help="gradient steps of every method")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--lr-decay-steps", type=int, default=0,
                   help="the rate decays linearly over the last N steps to --lr-min-ratio of it (k3 distill's)")  # fmt: skip
    p.add_argument("--lr-min-ratio", type=float, default=0.1)
    p.add_argument("--groups", type=int, default=4, help="tasks per step (round-robin over the keys)")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=RECIPE_BUDGETS["max_tokens"], help="generated tokens per episode")
    p.add_argument("--max-tokens-per-turn", type=int, default=RECIPE_BUDGETS["max_tokens_per_turn"])
    p.add_argument("--eval-tasks", type=int, default=24, help="held-out tasks per key")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--final-eval-tasks", type=int, default=144,
                   help="held-out tasks per key on which the targets are judged: the teachers, the start and each "
                        "method's last checkpoint (0: judge on the curves' last evaluation, --eval-tasks)")  # fmt: skip
    p.add_argument("--tau-anneal-steps", type=int, default=15)
    p.add_argument("--task-weight", type=float, default=0.0,
                   help="weight of the task reward beside the per-token one (k3 distill --task-weight)")  # fmt: skip
    p.add_argument("--budget-weight", type=float, default=1.0,
                   help="weight of the effort budget reward, -1 above tau*b0 (k3 distill --budget-weight)")  # fmt: skip
    p.add_argument("--teacher-temperature", type=float, default=1.0,
                   help="the teacher's distribution is softmax(logits / this) (k3 distill --teacher-temperature)")  # fmt: skip
    p.add_argument("--offpolicy-keep", default="all", choices=OFFPOLICY_KEEP,
                   help="offpolicy trains on all teacher samples or on those that solve their task only")  # fmt: skip
    p.add_argument("--offpolicy-weight", default="tokens", choices=OFFPOLICY_WEIGHTS,
                   help="offpolicy weighs every kept token the same, or each teacher key the same")  # fmt: skip
    p.add_argument("--offpolicy-draws", default="",
                   help="offpolicy, solved only: teacher samples per task, the first --group-size solved kept "
                        "(k3 distill --offpolicy-draws: N or key=N,...)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help=out_help("distill-cpu"))
    p.add_argument("--from-rl", default=None, metavar="RUN",
                   help="student = this RL run's warm start, teachers = its final policy (module docstring)")  # fmt: skip
    args = p.parse_args(argv)
    args.out = args.out or scratch_out("distill-cpu")
    machine = machine_info()
    os.makedirs(args.work, exist_ok=True)
    times_file = os.path.join(args.work, "times.json")
    times = _load(times_file) or {}
    if args.from_rl:
        init, teachers, settings = from_rl_run(args.from_rl)
        keys = sorted(teachers)
        args.eval_tasks = settings["eval_tasks"]
    else:
        keys = parse_keys(args.keys)
        init, teachers = os.path.join(args.work, "cold"), build_recipe(args, keys, times)
        settings = {"lr": args.lr, "groups_per_step": args.groups, "group_size": args.group_size,
                    "max_turns": RECIPE_BUDGETS["max_turns"],
                    "max_tokens": args.max_tokens, "max_tokens_per_turn": args.max_tokens_per_turn,
                    "eval_tasks": args.eval_tasks}  # fmt: skip
    k3_distill_flags = ("task_weight", "budget_weight", "teacher_temperature", "offpolicy_keep", "offpolicy_weight",
                        "lr_decay_steps", "lr_min_ratio", "offpolicy_draws")  # fmt: skip
    for name in k3_distill_flags:  # k3 distill's, when set
        if getattr(args, name) != p.get_default(name):
            settings[name] = getattr(args, name)
    with open(times_file, "w") as f:
        json.dump(times, f, indent=1)

    teacher_eval_file = os.path.join(args.work, "teacher_eval.json")
    teacher_eval = _load(teacher_eval_file)
    if teacher_eval is None and not args.final_eval_tasks:  # else the final evaluation judges the teachers
        teacher_eval = {}
        models = [(f"teacher {k}", path, [k], False) for k, path in sorted(teachers.items())]
        for name, _, got, _ in evaluate_models(models, args.eval_tasks, _budgets(settings)):
            teacher_eval.update(got)
            print(f"{name}: {got}", flush=True)
        with open(teacher_eval_file, "w") as f:
            json.dump(teacher_eval, f, indent=1)

    runs = {}
    for method in args.methods.split(","):
        t0 = time.perf_counter()
        done_before = _rows(os.path.join(args.work, f"run-{method}", "metrics.jsonl"))
        runs[method] = run_method(args, method, teachers, init, settings)
        if runs[method] != done_before:  # it trained: from scratch (a stale time is replaced) or resumed (added)
            key = f"run_{method}_s"
            times[key] = (times.get(key, 0.0) if done_before else 0.0) + time.perf_counter() - t0
    with open(times_file, "w") as f:
        json.dump(times, f, indent=1)

    curves = {m: [(r["step"], _score(r)) for r in rows if "eval_success" in r] for m, rows in runs.items()}
    finals = {m: [r for r in rows if "eval_success" in r][-1] for m, rows in runs.items()}
    start = next(r for r in runs[next(iter(runs))] if "eval_success" in r)
    judged_tasks = args.final_eval_tasks or args.eval_tasks
    if args.final_eval_tasks:  # the targets and tables on more tasks than the curves
        judged = final_evaluation(args, teachers, init, list(runs), settings)
        teacher_eval = {str(k): judged[f"teacher {k}"]["eval"][str(k)] for k in sorted(teachers)}
        start = _eval_row(judged["start"]["eval"])
        finals = {m: _eval_row(judged[m]["eval"]) for m in runs}
    result: dict = {"machine": machine, "args": vars(args), "settings": settings, "times_s": times,
                    "judged_on_tasks": judged_tasks, "teachers": teacher_eval,
                    "student_start": {"eval_success": start["eval_success"], "eval_length": start["eval_length"]},
                    "final": {m: {"eval_success": r["eval_success"], "eval_length": r["eval_length"],
                                  "score": _score(r)} for m, r in finals.items()},
                    "curves": curves, "lr_by_step": {m: lr_segments(rows) for m, rows in runs.items()}}  # fmt: skip
    targets = []
    result["student_over_teacher_by_method"] = {}
    for method, final in finals.items():  # opd's row first: `student_over_teacher` is opd's (the interface)
        if method == "rl":
            continue  # not a distillation
        ratio = success_ratio(final["eval_success"], {k: v["success"] for k, v in teacher_eval.items()})
        result["student_over_teacher_by_method"][method] = ratio
        if method == "opd":
            result["student_over_teacher"] = ratio
        shown = ", ".join(f"{k} {final['eval_success'][k]:.0%}/{teacher_eval[k]['success']:.0%}" for k in ratio)
        targets.append({"target": f"{method} student >= 95% of each teacher's held-out success (student/teacher)",
                        "measured": shown, "met": all(r is not None and r >= 0.95 for r in ratio.values())})  # fmt: skip
    targets.sort(key=lambda t: not t["target"].startswith("opd "))
    if "opd" in curves and "rl" in curves:
        rl_final = curves["rl"][-1][1]
        n_rl, n_opd = steps_to(curves["rl"], rl_final), steps_to(curves["opd"], rl_final)
        step_ratio = None if n_opd is None or not n_rl else n_opd / n_rl
        result["steps_to_rl_final"] = {"rl_final_score": rl_final, "rl_steps": n_rl, "opd_steps": n_opd,
                                       "ratio": step_ratio}  # fmt: skip
        equal = ", ".join(f"{m} {finals[m]['eval_success'] and _score(finals[m]):.0%}" for m in finals)
        targets.append({"target": "opd reaches RL's final score in <= 1/3 of RL's steps; methods at equal steps",
                        "measured": f"RL final {rl_final:.0%} at step {n_rl}; opd reached it at step {n_opd} "
                                    f"(ratio {step_ratio if step_ratio is None else f'{step_ratio:.2f}'}); "
                                    f"mean success at step {args.steps}: {equal}",
                        "met": step_ratio is not None and step_ratio <= 1 / 3})  # fmt: skip
    result["effort_by_method"], rows = effort_targets(keys, finals)
    if "opd" in result["effort_by_method"]:
        result["effort"] = result["effort_by_method"]["opd"]  # the interface, as student_over_teacher
    targets += rows
    result["targets"] = targets
    header = (f"Machine: {machine['cpu']}, {machine['threads']} threads, torch {machine['torch']}; load before: "
              f"{machine['load_before']}.")  # fmt: skip
    teachers_title = f"## Teachers (own context, greedy, {judged_tasks} test tasks each)"
    title = "# Multi-teacher distillation on CPU (`python benchmarks/distill.py"
    title += f" --from-rl {args.from_rl}`): from an RL expert" if args.from_rl else "`)"
    lines = [title, "", header, "",
             *targets_table(targets, "multi-teacher distillation"), "", teachers_title, "", "| key | success | length |",
             "|---|---|---|"]  # fmt: skip
    lines += [f"| {k} | {v['success']:.0%} | {v['length']:.0f} |" for k, v in sorted(teacher_eval.items())]
    tagged = " (effort-tagged)" if any(k.effort for k in keys) else ""
    student_title = (
        f"## Student{tagged}, held-out success / length after {args.steps} steps ({judged_tasks} tasks per key)"
    )
    lines += ["", student_title, "",
              "| method | " + " | ".join(sorted(start["eval_success"])) + " | mean |",
              "|---|" + "---|" * (len(start["eval_success"]) + 1)]  # fmt: skip
    for name, row in [("cold start", start), *finals.items()]:
        cells = [f"{row['eval_success'][k]:.0%} / {row['eval_length'][k]:.0f}" for k in sorted(row["eval_success"])]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {_score(row):.0%} |")
    lines += ["", f"## Curves (step: mean held-out success on {args.eval_tasks} test tasks per key)", ""]
    lines += [f"- {m}: " + " · ".join(f"{s}: {v:.0%}" for s, v in c) for m, c in curves.items()]
    lines += ["", "## Times", "", *(f"- {k}: {v:.0f} s" for k, v in sorted(times.items()))]
    source = f"`--from-rl {args.from_rl}`: init {init}" if args.from_rl else f"the recipe's cold start ({init})"
    lines += ["", "## Settings", "", f"- student: {source}; teachers: "
              + ", ".join(f"{k}={v}" for k, v in sorted(teachers.items())),
              "- every method: " + ", ".join(f"{k} {v}" for k, v in settings.items())
              + f", {args.steps} steps, held-out evaluation every {args.eval_every}",
              *(f"- {m}'s learning rate as trained (its metrics; a resumed run's parts in turn, their times added): "
                + lr_history(segs) for m, segs in result["lr_by_step"].items()),
              "- run: `python benchmarks/distill.py " + " ".join(sys.argv[1:] if argv is None else argv) + "` (a rerun "
              "with the same --work only re-renders this report)"]  # fmt: skip
    write_report(result, args.out, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

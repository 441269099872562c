"""A control for the three-domain recipe's calculator gap: do the calculator teacher's own solved samples teach what
its scripted demonstrations teach, trained the same way?

The distilled student copies long numbers into its call less reliably than its teacher, while a student trained on
scripted demonstrations copies them as well as the teacher does (docs/distill.md). The two differ in three ways at
once: the data (the teacher's sampled episodes against the scripted ones), which tasks it covers (only those the
teacher solved, so fewer long-number ones), and how it is trained (a quarter of a mixed batch at 2e-4 against a
schedule of its own). This script holds the training fixed and varies the data only. From the cold start, with
an SFT schedule of the teachers' shape (`--steps`, `--batch`, linear to a tenth; `--constant` keeps the rate) at
the cold start's rate (`--lr`; the teachers' own is half of it), it trains one student on each of:

    teacher     the teacher's samples of training tasks (`--samples` per task at `--temperature`, the offpolicy
                settings) that solve their task: what `k3 distill --method offpolicy --offpolicy-keep solved` trains on
    scripted    the scripted demonstration of each of those samples' tasks, as many times (same tasks; the tokens
                differ only where a solved sample differs from the script)
    all-tasks   the scripted demonstrations of as many training tasks, each once, none left out (no selection)

and evaluates each (greedy, `--eval-tasks` held-out tasks, the benchmark's view) with `distill_copy.py`'s sorting:
success, the share of the numbers copied exactly, solved tasks by the task's digits. It also reports how the teacher's solved
samples differ from the scripted demonstrations token by token, and the digits of the tasks kept against all drawn.

    python experiments/distill_data_control.py --work WORK --out benchmarks/results/distill-cpu-data-control.json

WORK is a `benchmarks/distill.py` work folder holding `cold` and `teacher-calculator`; the students are saved to
WORK/NAME-{arm} (`--name`, default control; reused when present).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch
from bench import distill  # benchmarks/distill.py, loaded by path (experiments/bench.py)
from distill_copy import CALCULATOR, DIGIT_BUCKETS, calculator_copy, copy_table, digit_bucket

from openk3.data.tokenizer import load_tokenizer
from openk3.rl.evaluate import SUCCESS, policy_episodes
from openk3.train.checkpoint import load_model

ARMS = ("teacher", "scripted", "all-tasks")
CHUNK = 128  # training tasks a teacher samples at once (the fleet's sandboxes and the engine's batch stay small)


def teacher_data(teacher, tokenizer, fleet, tasks: int, samples: int, temperature: float) -> list:
    """The teacher's sampled episodes of the first `tasks` training tasks, `samples` each, in task order."""
    out = []
    for first in range(0, tasks, CHUNK):
        n = min(CHUNK, tasks - first)
        out += policy_episodes(teacher, tokenizer, [CALCULATOR], n, fleet, tagged=False, temperature=temperature,
                               first=first, split="train", samples=samples,
                               **distill.RECIPE_BUDGETS)[CALCULATOR]  # fmt: skip
        solved = sum(t.reward >= SUCCESS for t in out)
        print(f"teacher samples: {first + n}/{tasks} tasks, {solved} of {len(out)} samples solved", flush=True)
    return out


def arms_data(trajs: list, tokenizer, samples: int) -> tuple[dict, dict]:
    """({arm: [(ids, mask)]}, facts): the three arms' examples from the teacher's episodes, and how the kept samples
    compare with the scripted demonstrations (token-identical share, first difference) and the drawn tasks."""
    kept, kept_tasks = [], []
    for t in trajs:
        if t.reward >= SUCCESS:  # at most `samples` a task: every sample of a task is drawn once
            kept.append((list(t.tokens), list(t.generated)))
            kept_tasks.append(t.task)
    distinct = [t.task for t in trajs[::samples]]  # the samples of a task are consecutive
    scripted = [distill.demo_ids(task, tokenizer, style=None, tag=None) for task in kept_tasks]
    all_tasks = [distill.demo_ids(task, tokenizer, style=None, tag=None) for task in distinct[: len(kept)]]
    same, diffs = 0, []
    for (ids, _), (demo, _) in zip(kept, scripted):
        same += ids == demo
        if ids != demo and len(diffs) < 5:
            at = next((i for i, (a, b) in enumerate(zip(ids, demo)) if a != b), min(len(ids), len(demo)))
            diffs.append(
                {"teacher": tokenizer.decode(ids[at : at + 12]), "scripted": tokenizer.decode(demo[at : at + 12])}
            )
    buckets = [label for label, _, _ in DIGIT_BUCKETS]

    def by_digits(tasks) -> dict:
        counts = {label: 0 for label in buckets}
        for task in tasks:
            counts[digit_bucket(task.meta["expression"])] += 1
        return {label: c / max(len(tasks), 1) for label, c in counts.items()}

    facts = {"tasks": len(distinct), "samples": len(trajs), "solved_samples": len(kept),
             "tasks_with_a_solved_sample": len({t.task_id for t in kept_tasks}),
             "token_identical_to_scripted": same / max(len(kept), 1), "first_differences": diffs,
             "digits_of_drawn_tasks": by_digits(distinct), "digits_of_kept_samples": by_digits(kept_tasks),
             "all_tasks_covers": min(len(kept), len(distinct))}  # fmt: skip
    return {"teacher": kept, "scripted": scripted, "all-tasks": all_tasks}, facts


def train_arm(cold: str, tokenizer, examples: list, args, path: str) -> str:
    """The cold start trained on `examples` (shuffled once by the seed, then cycled) with the control's SFT
    schedule (`main`'s flags)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(args.seed)
    model, _ = load_model(cold, dtype=torch.float32)
    order = list(range(len(examples)))
    random.Random(args.seed).shuffle(order)
    cursor = [0]

    def batch():
        out = [examples[order[(cursor[0] + i) % len(order)]] for i in range(args.batch)]
        cursor[0] += args.batch
        return out

    bar, tick = distill.progress_bar(os.path.basename(path), args.steps)
    distill.supervised(model, batch, args.steps, args.lr, decay=not args.constant, progress=tick)
    bar.close()
    return distill.save_policy(model, tokenizer, path)


def main(argv: list[str] | None = None) -> int:
    from openk3.sandbox.fleet import Fleet

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", required=True, help="a distill.py work folder (cold, teacher-calculator)")
    p.add_argument("--tasks", type=int, default=1000, help="training tasks the teacher samples")
    p.add_argument("--samples", type=int, default=2, help="teacher samples per task (distill.py --group-size)")
    p.add_argument("--temperature", type=float, default=0.5, help="the teacher's (distill.py --teacher-temperature)")
    p.add_argument("--steps", type=int, default=100, help="SFT steps (the teacher's: distill.py --teacher-steps)")
    p.add_argument("--batch", type=int, default=12, help="examples per step (distill.py --batch)")
    p.add_argument("--lr", type=float, default=2e-3, help="to a tenth (distill.py --sft-lr; teachers: half)")
    p.add_argument("--constant", action="store_true", help="keep the rate constant (the distillation's schedule)")
    p.add_argument("--name", default="control", help="the students are saved to WORK/NAME-{arm}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-tasks", type=int, default=144, help="held-out tasks (the test split's first)")
    p.add_argument("--out", required=True, help="the result's JSON (a markdown table beside it)")
    args = p.parse_args(argv)
    cold, teacher_path = os.path.join(args.work, "cold"), os.path.join(args.work, "teacher-calculator")
    for needed in (cold, teacher_path):
        if not os.path.exists(os.path.join(needed, "config.json")):
            raise SystemExit(f"--work {args.work}: no checkpoint at {needed} (run benchmarks/distill.py first)")
    for name in ("tasks", "samples", "steps", "batch", "eval_tasks"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    teacher, folder = load_model(teacher_path, dtype=torch.float32)
    tokenizer = load_tokenizer(folder, teacher.text_config)
    result: dict = {"settings": vars(args), "times_s": {}, "models": {}}
    with Fleet(max_sandboxes=CHUNK * args.samples + 8, warm=2, memory_mb=256) as fleet:
        t0 = time.perf_counter()
        trajs = teacher_data(teacher.eval(), tokenizer, fleet, args.tasks, args.samples, args.temperature)
        result["times_s"]["teacher_samples"] = time.perf_counter() - t0
        data, result["data"] = arms_data(trajs, tokenizer, args.samples)
        print(json.dumps(result["data"], indent=1), flush=True)
        models = {"teacher model": teacher_path, "cold start": cold}
        for arm in ARMS:
            t0 = time.perf_counter()
            models[arm] = train_arm(cold, tokenizer, data[arm], args, os.path.join(args.work, f"{args.name}-{arm}"))
            result["times_s"][f"train {arm}"] = time.perf_counter() - t0
        for name, path in models.items():
            t0 = time.perf_counter()
            result["models"][name] = calculator_copy(path, tokenizer, fleet, args.eval_tasks, tagged=False)
            result["times_s"][f"eval {name}"] = time.perf_counter() - t0
            print(f"{name}: {result['models'][name]['success']:.1%} solved", flush=True)
    write_tables(result, args.out)
    return 0


def write_tables(result: dict, out: str) -> None:
    d, s = result["data"], result["settings"]
    lines = [
        "# Calculator: the teacher's solved samples against its scripted demonstrations (`experiments/distill_data_control.py`)",
        "",
        (f"From the cold start, calculator alone, {s['steps']} SFT steps of {s['batch']} examples at {s['lr']:g}, "
        + ("constant" if s["constant"] else "linear to a tenth (the teachers' steps, batch and decay)")
        + f"; {s['tasks']} training tasks, {s['samples']} teacher samples "
        f"each at temperature {s['temperature']:g}; greedy evaluation on {s['eval_tasks']} held-out tasks."),
        "",
        (f"- teacher samples solving their task: {d['solved_samples']} of {d['samples']} "
        f"({d['tasks_with_a_solved_sample']} of {d['tasks']} tasks); token-identical to the task's scripted "
        f"demonstration: {d['token_identical_to_scripted']:.1%}"),
        "- tasks by digits (" + ", ".join(d["digits_of_drawn_tasks"]) + "): drawn "
        + " / ".join(f"{v:.0%}" for v in d["digits_of_drawn_tasks"].values()) + ", kept samples "
        + " / ".join(f"{v:.0%}" for v in d["digits_of_kept_samples"].values()),
        "",
        *copy_table(result["models"]),
        "",
    ]  # fmt: skip
    print("\n".join(lines))
    if out.endswith(".json"):
        with open(out[: -len(".json")] + ".md", "w", encoding="utf-8") as f:
            f.write("\n".join(lines))
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())

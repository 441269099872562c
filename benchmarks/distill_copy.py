"""Why a distilled student trails its calculator teacher: each model's held-out calculator episodes, sorted by what
went wrong, and how often each number of a task reaches the tool call exactly.

A calculator task (`rl/envs/calculator.py`) is solved by copying three or four 2-4 digit numbers from the question
into one `python` call and the printed result into the answer. Every failure is one of: no call, a call whose
expression is not the task's (a number or operator miscopied), or the right expression but no right final answer
(the printed result miscopied, or none given). The per-number copy rate p is what success hangs on: three numbers
right take p^3, so 0.8 a number is about 50% a task and 0.6 about 22% (docs/distill.md).

    python benchmarks/distill_copy.py --tokenizer WORK/cold --teachers calculator=WORK/teacher-calculator \\
        --students start=WORK/cold,offpolicy=WORK/run-offpolicy/checkpoints/step-00000150 --tasks 144 --out FILE.json

Greedy by default, on the test split's tasks from `--first`, as `benchmarks/distill.py` judges: a teacher in its own
view, a student with the effort tag (none for calculator). Prints a table and writes {"tasks", "first",
"temperature", "models": {name: counts and rates}}.
"""

from __future__ import annotations

import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distill import RECIPE_BUDGETS
from distill_reeval import model_runs, runs_parser, write_result

from openk3.rl.distill_recipe import policy_episodes
from openk3.rl.loop import SUCCESS
from openk3.rl.teachers import parse_teachers
from openk3.train.checkpoint import load_model

NUMBER = re.compile(r"\d+")
KINDS = ("solved", "no_call", "wrong_expression", "wrong_answer")


def first_expression(text: str) -> str | None:
    """The argument of the first `print(...)` in an episode's decoded text (the calculator's one call), or None."""
    m = re.search(r"print\(([^()]*)\)", text)
    return m.group(1).strip() if m else None


def copy_errors(episodes: list[tuple[str, str, float]]) -> dict:
    """Counts and rates over (task expression, the episode's decoded text, reward) triples: each episode's kind
    (KINDS) and `number_copy`, the share of the task's numbers whose call has the same number in the same place."""
    counts = dict.fromkeys(KINDS, 0)
    right = total = 0
    for expression, text, reward in episodes:
        called = first_expression(text)
        if reward >= SUCCESS:
            kind = "solved"
        elif called is None:
            kind = "no_call"
        elif called.replace(" ", "") != expression:
            kind = "wrong_expression"
        else:
            kind = "wrong_answer"
        counts[kind] += 1
        wanted = NUMBER.findall(expression)
        got = NUMBER.findall(called or "")
        total += len(wanted)
        right += sum(a == b for a, b in zip(wanted, got))
    n = max(len(episodes), 1)
    return {**counts, "episodes": len(episodes), "success": counts["solved"] / n,
            "number_copy": right / total if total else None}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from openk3.sandbox.fleet import Fleet

    parser = runs_parser(__doc__, "0: greedy, as the benchmark judges; > 0: one sampled episode per task")
    args = parser.parse_args(argv)
    keys = [str(k) for k in parse_teachers(args.teachers)]
    if keys != ["calculator"]:
        parser.error(f"--teachers: give the calculator teacher only (calculator=CKPT), got {keys}")
    tokenizer, _, _, runs = model_runs(args)
    result: dict = {"tasks": args.tasks, "first": args.first, "temperature": args.temperature, "models": {}}
    with Fleet(max_sandboxes=args.tasks + 8, warm=2, memory_mb=256) as fleet:
        for name, path, model_keys, tagged in runs:
            t0 = time.perf_counter()
            model, _ = load_model(path, dtype=torch.float32)
            trajs = policy_episodes(model.eval(), tokenizer, model_keys, args.tasks, fleet, tagged=tagged,
                                    temperature=args.temperature, first=args.first, **RECIPE_BUDGETS)  # fmt: skip
            episodes = [(t.task.meta["expression"], tokenizer.decode(t.tokens[t.prompt_len:]), t.reward)
                        for t in trajs[model_keys[0]]]  # fmt: skip
            result["models"][name] = copy_errors(episodes)
            print(f"{name}: {result['models'][name]} ({time.perf_counter() - t0:.0f} s)", flush=True)
    table = ["| model | solved | wrong expression | right expression, wrong answer | no call | numbers copied |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in result["models"].items():
        table.append(f"| {name} | {r['success']:.1%} | {r['wrong_expression']} | {r['wrong_answer']} | "
                     f"{r['no_call']} | {r['number_copy']:.1%} |")  # fmt: skip
    print("\n".join(table))
    if args.out.endswith(".json"):  # the table beside the JSON, for the results folder
        with open(args.out[: -len(".json")] + ".md", "w", encoding="utf-8") as f:
            title = (
                f"# Calculator copy errors (`python benchmarks/distill_copy.py`), {args.tasks} tasks from {args.first}"
            )
            f.write("\n".join([title, "", *table, ""]))
    write_result(result, "models", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

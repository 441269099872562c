"""Why a distilled student trails its calculator teacher: each model's held-out calculator episodes, sorted by what
went wrong, and how often each number of a task reaches the tool call exactly.

A calculator task (`rl/envs/calculator.py`) is solved by copying three or four 2-4 digit numbers from the question
into one `python` call and the printed result into the answer. Every failure is one of: no call, a call whose
expression is not the task's (a number or operator miscopied), or the right expression but no right final answer
(the printed result miscopied, or none given). The per-number copy rate p is what success hangs on: three numbers
right take p^3, so 0.8 a number is about 50% a task and 0.6 about 22% (docs/distill.md).

    python experiments/distill_copy.py --tokenizer WORK/cold --teachers calculator=WORK/teacher-calculator \\
        --students start=WORK/cold,offpolicy=WORK/run-offpolicy/checkpoints/step-00000150 --tasks 144 --out FILE.json

Greedy by default, on the test split's tasks from `--first`, as `benchmarks/distill.py` judges: a teacher in its own
view, a student with the effort tag (none for calculator). Prints a table and writes {"tasks", "first",
"temperature", "models": {name: counts and rates}}. A second table splits each model's solved tasks by difficulty
(the digits of the task's numbers together) and compares them task by task with the first model's, the teacher's:
where a student's gap to its teacher lies, and whether it solves tasks the teacher does not.
"""

from __future__ import annotations

import re
import time

import torch
from bench import distill  # benchmarks/distill.py, loaded by path (experiments/bench.py)
from distill_reeval import model_runs, runs_parser, write_result

from openk3.rl.evaluate import SUCCESS, policy_episodes
from openk3.rl.teachers import TeacherKey, parse_teachers
from openk3.train.checkpoint import load_model

NUMBER = re.compile(r"\d+")
KINDS = ("solved", "no_call", "wrong_expression", "wrong_answer")
CALCULATOR = TeacherKey("calculator", None)
# A task's difficulty: the digits of all its numbers together (7-12 on the test split; the buckets hold about a
# quarter of its first 144 tasks each).
DIGIT_BUCKETS = (("<=8", 0, 8), ("9", 9, 9), ("10", 10, 10), (">=11", 11, 99))


def digit_bucket(expression: str) -> str:
    digits = sum(len(n) for n in NUMBER.findall(expression))
    return next(label for label, lo, hi in DIGIT_BUCKETS if lo <= digits <= hi)


def first_expression(text: str) -> str | None:
    """The argument of the first `print(...)` in an episode's decoded text (the calculator's one call), or None."""
    m = re.search(r"print\(([^()]*)\)", text)
    return m.group(1).strip() if m else None


def copy_errors(episodes: list[tuple[str, str, float]]) -> dict:
    """Counts and rates over (task expression, the episode's decoded text, reward) triples: each episode's kind
    (KINDS); `number_copy`, the share of the task's numbers whose call has the same number in the same place;
    `by_digits`, episodes and solved ones by the task's digits (DIGIT_BUCKETS); `solved_tasks`, the solved episodes'
    positions (the task order, so two models' lists compare task by task)."""
    counts = dict.fromkeys(KINDS, 0)
    by_digits = {label: {"episodes": 0, "solved": 0} for label, _, _ in DIGIT_BUCKETS}
    solved_tasks = []
    right = total = 0
    for i, (expression, text, reward) in enumerate(episodes):
        called = first_expression(text)
        bucket = by_digits[digit_bucket(expression)]
        bucket["episodes"] += 1
        if reward >= SUCCESS:
            kind = "solved"
            bucket["solved"] += 1
            solved_tasks.append(i)
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
            "number_copy": right / total if total else None, "by_digits": by_digits,
            "solved_tasks": solved_tasks}  # fmt: skip


def difficulty_table(models: dict[str, dict]) -> list[str]:
    """Markdown rows: each model's success by the task's digits, and against the first model (the teacher) the
    tasks it solves that the first does not (gained) and the other way (lost)."""
    first_name, first = next(iter(models.items()))
    labels = [label for label, _, _ in DIGIT_BUCKETS]
    sizes = [first["by_digits"][label]["episodes"] for label in labels]
    rows = ["| model | " + " | ".join(f"{label} digits ({n} tasks)" for label, n in zip(labels, sizes)) +
            f" | gained over {first_name} | lost |", "|---|" + "---|" * (len(labels) + 2)]  # fmt: skip
    for name, r in models.items():
        cells = [f"{b['solved']} ({b['solved'] / b['episodes']:.0%})" if b["episodes"] else "-" for b in
                 (r["by_digits"][label] for label in labels)]  # fmt: skip
        mine, theirs = set(r["solved_tasks"]), set(first["solved_tasks"])
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {len(mine - theirs)} | {len(theirs - mine)} |")
    return rows


def calculator_copy(path: str, tokenizer, fleet, tasks: int, *, tagged: bool, temperature: float = 0.0,
                    first: int = 0) -> dict:  # fmt: skip
    """`copy_errors` of the checkpoint at `path` on the test split's calculator tasks `first` .. `first + tasks - 1`
    (`policy_episodes` with the recipe's budgets: greedy by default)."""
    model, _ = load_model(path, dtype=torch.float32)
    trajs = policy_episodes(model.eval(), tokenizer, [CALCULATOR], tasks, fleet, tagged=tagged,
                            temperature=temperature, first=first, **distill.RECIPE_BUDGETS)[CALCULATOR]  # fmt: skip
    return copy_errors([(t.task.meta["expression"], tokenizer.decode(t.tokens[t.prompt_len :]), t.reward)
                        for t in trajs])  # fmt: skip


def copy_table(models: dict[str, dict]) -> list[str]:
    """Markdown: each model's failure kinds and numbers copied, then `difficulty_table` under its own heading."""
    table = ["| model | solved | wrong expression | right expression, wrong answer | no call | numbers copied |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in models.items():
        table.append(f"| {name} | {r['success']:.1%} | {r['wrong_expression']} | {r['wrong_answer']} | "
                     f"{r['no_call']} | {r['number_copy']:.1%} |")  # fmt: skip
    heading = "Solved tasks by the task's digits (all its numbers together), and task by task against the first model:"
    return [*table, "", heading, "", *difficulty_table(models)]


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
        for name, path, _, tagged in runs:
            t0 = time.perf_counter()
            result["models"][name] = calculator_copy(path, tokenizer, fleet, args.tasks, tagged=tagged,
                                                     temperature=args.temperature, first=args.first)  # fmt: skip
            print(f"{name}: {result['models'][name]} ({time.perf_counter() - t0:.0f} s)", flush=True)
    table = copy_table(result["models"])
    print("\n".join(table))
    if args.out.endswith(".json"):  # the table beside the JSON, for the results folder
        with open(args.out[: -len(".json")] + ".md", "w", encoding="utf-8") as f:
            title = (
                f"# Calculator copy errors (`python experiments/distill_copy.py`), {args.tasks} tasks from {args.first}"
            )
            f.write("\n".join([title, "", *table, ""]))
    write_result(result, "models", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

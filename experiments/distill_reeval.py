"""Re-evaluate distillation students and teachers on more held-out tasks than the benchmark's evaluations use
(24 per key: one task is 4.2 points, the standard error about 10), greedy, as `benchmarks/distill.py` evaluates, or
sampled (`--temperature 1`).

    python experiments/distill_reeval.py --tokenizer WORK/cold --tasks 144 \\
        --students g8=WORK/run-opd/checkpoints/step-00000030 \\
        --teachers files:low=WORK/teacher-files-low,files:max=WORK/teacher-files-max --out FILE.json

`--first 144` evaluates a second held-out set (tasks 144..287 with `--tasks 144`), disjoint from the one the
benchmark judges its targets on: a checkpoint picked on the first set is confirmed or not on tasks it was not
picked on.

A student is evaluated with the effort tag on every teacher's key; a teacher on its own key without the tag (the
benchmark's views). Prints and writes {name: {key: {success, length}}}, and each student's success over each
teacher's.
"""

from __future__ import annotations

import argparse
import json

import torch
from bench import distill  # benchmarks/distill.py, loaded by path (experiments/bench.py)

from openk3.data.tokenizer import load_tokenizer
from openk3.rl.teachers import parse_teachers
from openk3.train.checkpoint import load_model


def runs_parser(description: str, temperature_help: str) -> argparse.ArgumentParser:
    """The arguments of a re-evaluation of students and teachers (this script, distill_decisive.py)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="a checkpoint folder holding the recipe's tokenizer (cold)")
    p.add_argument("--students", required=True, help="name=checkpoint,... (evaluated with the effort tag)")
    p.add_argument("--teachers", required=True, help="domain[:effort]=checkpoint,...")
    p.add_argument("--tasks", type=int, default=144, help="held-out tasks per key (the test split's N from --first)")
    p.add_argument("--first", type=int, default=0,
                   help="start at this test-split task (e.g. 144: a second held-out set, disjoint from the one the "
                        "benchmark judges on, so no checkpoint was chosen on it)")  # fmt: skip
    p.add_argument("--temperature", type=float, default=0.0, help=temperature_help)
    p.add_argument("--out", required=True)
    return p


def model_runs(args) -> tuple:
    """(tokenizer, teachers {key: path}, keys, runs): `runs` lists (name, checkpoint, keys, tagged), the teachers
    first, each on its own key untagged, then the students on every key tagged (the benchmark's views)."""
    teachers = parse_teachers(args.teachers)
    keys = sorted(teachers)
    model, folder = load_model(args.tokenizer, dtype=torch.float32)
    tokenizer = load_tokenizer(folder, model.text_config)
    runs = [(f"teacher {k}", path, [k], False) for k, path in sorted(teachers.items())]
    runs += [(name, path, keys, True) for name, path in (s.split("=", 1) for s in args.students.split(","))]
    return tokenizer, teachers, keys, runs


def write_result(result: dict, shown: str, path: str) -> None:
    """Print `result[shown]` and write `result` to `path` as JSON."""
    print(json.dumps(result[shown], indent=1))
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    args = runs_parser(__doc__, "0: greedy, as the benchmark judges; > 0: one sampled episode per task (the "
                                "distribution the student is trained to match)").parse_args(argv)  # fmt: skip
    tokenizer, _, keys, runs = model_runs(args)
    result: dict = {"tasks": args.tasks, "first": args.first, "temperature": args.temperature, "eval": {}}
    evaluations = distill.evaluate_models(
        runs, args.tasks, distill.RECIPE_BUDGETS, temperature=args.temperature, tokenizer=tokenizer, first=args.first
    )
    for name, _, got, seconds in evaluations:
        result["eval"][name] = got
        print(f"{name}: {got} ({seconds:.0f} s)", flush=True)
    teacher_success = {str(k): result["eval"][f"teacher {k}"][str(k)]["success"] for k in keys}
    result["student_over_teacher"] = {
        name: distill.success_ratio({k: v["success"] for k, v in result["eval"][name].items()}, teacher_success)
        for name, _, _, tagged in runs if tagged
    }  # fmt: skip
    write_result(result, "student_over_teacher", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

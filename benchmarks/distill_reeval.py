"""Re-evaluate distillation students and teachers on more held-out tasks than the benchmark's evaluations use
(24 per key: one task is 4.2 points, the standard error about 10), greedy, as `benchmarks/distill.py` evaluates, or
sampled (`--temperature 1`).

    python benchmarks/distill_reeval.py --tokenizer WORK/cold --tasks 144 \\
        --students g8=WORK/run-opd/checkpoints/step-00000030 \\
        --teachers files:low=WORK/teacher-files-low,files:max=WORK/teacher-files-max --out FILE.json

A student is evaluated with the effort tag on every teacher's key; a teacher on its own key without the tag (the
benchmark's views). Prints and writes {name: {key: {success, length}}}, and each student's success over each
teacher's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from distill import evaluate_models, success_ratio  # benchmarks/distill.py: the benchmark's evaluation

from openk3.data.tokenizer import load_tokenizer
from openk3.rl.teachers import parse_teachers
from openk3.train.checkpoint import load_model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="a checkpoint folder holding the recipe's tokenizer (cold)")
    p.add_argument("--students", required=True, help="name=checkpoint,...")
    p.add_argument("--teachers", required=True, help="domain[:effort]=checkpoint,...")
    p.add_argument("--tasks", type=int, default=144, help="held-out tasks per key (the test split's first N)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy, as the benchmark judges; > 0: one sampled episode per task (the distribution "
                        "the student is trained to match)")  # fmt: skip
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    teachers = parse_teachers(args.teachers)
    keys = sorted(teachers)
    model, folder = load_model(args.tokenizer, dtype=torch.float32)
    tokenizer = load_tokenizer(folder, model.text_config)
    budgets = {"max_turns": 4, "max_tokens": 384, "max_tokens_per_turn": 192}  # the effort runs' settings
    runs = [(f"teacher {k}", path, [k], False) for k, path in sorted(teachers.items())]
    runs += [(name, path, keys, True) for name, path in (s.split("=", 1) for s in args.students.split(","))]
    result: dict = {"tasks": args.tasks, "temperature": args.temperature, "eval": {}}
    for name, _, got, seconds in evaluate_models(runs, args.tasks, budgets, temperature=args.temperature,
                                                 tokenizer=tokenizer):  # fmt: skip
        result["eval"][name] = got
        print(f"{name}: {got} ({seconds:.0f} s)", flush=True)
    teacher_success = {str(k): result["eval"][f"teacher {k}"][str(k)]["success"] for k in keys}
    result["student_over_teacher"] = {
        name: success_ratio({k: v["success"] for k, v in result["eval"][name].items()}, teacher_success)
        for name, _, _, tagged in runs if tagged
    }  # fmt: skip
    print(json.dumps(result["student_over_teacher"], indent=1))
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

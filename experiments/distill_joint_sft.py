"""A control for the effort recipe's first target: can one tagged student hold both teachers at all?

Every distilled student of `benchmarks/distill.py --keys files:low,files:max` plateaus near a 62% mean, below its
teachers' 67% and 79% (docs/distill.md). Either one tiny student cannot hold both efforts (capacity, or the two
efforts interfering), or distillation does not carry what the teachers know. This script trains the student the way
the teachers were trained instead: the cold start plus SFT on the teachers' own scripted demonstrations (every one of
them right), both efforts at once, each behind its own effort tag (`distill.RecipeStream(student=True, guess_share=0,
long_share=0)`), the teachers' learning rate and as many demonstrations per effort as each teacher saw
(`--steps` 200 x `--batch` 12 = 1,200 per effort at the default). It then evaluates it beside the teachers with
`distill_reeval.py` (greedy, the benchmark's views). If it reaches the teachers, one student can hold both and what
the distilled students lack is the signal; if not, the first target asks more than this student can hold.

    python experiments/distill_joint_sft.py --work WORK --tasks 144 --out FILE.json

WORK is a `benchmarks/distill.py` work folder holding `cold` and `teacher-files-{low,max}`; the student is saved to
WORK/joint-sft (reused when present).
"""

from __future__ import annotations

import argparse
import os
import time

import distill_reeval
import torch
from bench import distill  # benchmarks/distill.py, loaded by path (experiments/bench.py)

from openk3.data.tokenizer import load_tokenizer
from openk3.train.checkpoint import load_model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", required=True, help="a distill.py work folder (cold, teacher-files-low, -max)")
    p.add_argument("--keys", default="files:low,files:max")
    p.add_argument("--steps", type=int, default=200, help="SFT steps (each teacher had 100 on its effort alone)")
    p.add_argument("--batch", type=int, default=12, help="demonstrations per step, round-robin over the keys")
    p.add_argument("--lr", type=float, default=1e-3, help="the teachers' rate (distill.py --sft-lr / 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tasks", type=int, default=144, help="held-out tasks per key")
    p.add_argument("--out", required=True, help="the evaluation's JSON (distill_reeval.py's)")
    args = p.parse_args(argv)
    keys = distill.parse_keys(args.keys)
    cold, path = os.path.join(args.work, "cold"), os.path.join(args.work, "joint-sft")
    teachers = {k: distill.teacher_folder(args.work, k) for k in keys}
    for needed in (cold, *teachers.values()):
        if not os.path.exists(os.path.join(needed, "config.json")):
            raise SystemExit(f"--work {args.work}: no checkpoint at {needed} (run benchmarks/distill.py first)")
    if not os.path.exists(os.path.join(path, "config.json")):
        t0 = time.perf_counter()
        model, folder = load_model(cold, dtype=torch.float32)
        tokenizer = load_tokenizer(folder, model.text_config)
        # the seed differs from the cold start's (seed) and the teachers' (seed + 1) streams: new demonstrations
        stream = distill.RecipeStream(keys, tokenizer, args.seed + 2, student=True, guess_share=0.0, long_share=0.0)
        bar, tick = distill.progress_bar("joint sft", args.steps)
        distill.supervised(model, lambda: stream.batch(args.batch), args.steps, args.lr, progress=tick)
        bar.close()
        distill.save_policy(model, tokenizer, path)
        print(f"joint sft: {args.steps} steps in {time.perf_counter() - t0:.0f} s -> {path}", flush=True)
    return distill_reeval.main(["--tokenizer", cold, "--students", f"joint-sft={path}",
                                "--teachers", ",".join(f"{k}={v}" for k, v in sorted(teachers.items())),
                                "--tasks", str(args.tasks), "--out", args.out])  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())

"""`k3 rl` at several process layouts, side by side in one run: the same short run (a fixed init, the same seed and
task stream) at `--nproc 1` and at `--nproc 2 --ep 2` (more with `--layouts`), each through the real command line
(torchrun for N > 1), written to benchmarks/results/rl-layouts-cpu.{json,md}.

Reported per layout, over the RL steps after the first (warm-up): seconds per step, generated tokens per second of
the rollout, the step's shares of inference, sandboxes and training, and the loss of each step (the layouts train on
different rollouts: each rank samples its own groups, so losses agree in scale, not in value).

The init is a fresh `tiny` policy with the RL recipe's task tokenizer and no warm start: its episodes run to the
token budgets, which is what the timings need (the quality of the policy does not enter them).

    python benchmarks/rl_layouts.py [--steps 6] [--layouts "1;2 --ep 2"] [--out benchmarks/results/rl-layouts-cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import machine_info, write_report

from openk3.rl.sft import fresh_policy


def make_init(folder: str, task: str, seed: int) -> str:
    model, tokenizer = fresh_policy("tiny", task.split(","), seed)
    model.save_pretrained(folder)
    tokenizer.save(folder)
    return folder


def run_layout(layout: str, init: str, run: str, args) -> dict:
    """`k3 rl` at `layout` ("N [flags]"); the metrics rows of its RL steps and its wall time."""
    nproc, *flags = shlex.split(layout)
    cmd = [sys.executable, "-m", "openk3.cli", "rl", "--init", init, "--out", run, "--task", args.task,
           "--steps", str(args.steps), "--groups-per-step", str(args.groups_per_step), "--group-size",
           str(args.group_size), "--eval-tasks", "2", "--eval-every", str(10 * args.steps), "--save-every",
           str(10 * args.steps), "--seed", str(args.seed), "--no-progress", "--nproc", nproc, *flags]  # fmt: skip
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - t0
    with open(os.path.join(run, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return {"rows": [r for r in rows if r["step"] > 0], "wall_s": wall}


def summary(rows: list[dict]) -> dict:
    timed = rows[1:] or rows  # the first step warms the engine and the fleet up

    def mean(key):
        return sum(r[key] for r in timed) / len(timed)

    return {"step_s": mean("step_s"), "rollout_tokens_per_s": mean("rollout_tokens_per_s"),
            "inference_share": mean("inference_share"), "sandbox_share": mean("sandbox_share"),
            "train_share": mean("train_share"), "losses": [r["loss"] for r in rows]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="1;2 --ep 2", help="';'-separated: the process count, then k3 rl flags")
    p.add_argument("--task", default="calculator,files")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--groups-per-step", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/rl-layouts-cpu")
    args = p.parse_args(argv)
    info = machine_info()
    layouts = [x.strip() for x in args.layouts.split(";") if x.strip()]
    with tempfile.TemporaryDirectory(prefix="k3-rl-layouts-") as tmp:
        init = make_init(os.path.join(tmp, "init"), args.task, args.seed)
        results = {}
        for i, layout in enumerate(layouts):
            got = run_layout(layout, init, os.path.join(tmp, f"run-{i}"), args)
            results[layout] = {**summary(got["rows"]), "wall_s": got["wall_s"]}
    md = ["# `k3 rl` at several layouts (`python benchmarks/rl_layouts.py`)", "",
          (f"Machine: {info['cpu']}, {info['threads']} threads, torch {info['torch']}; load before: "
           f"{info['load_before']}. Measured side by side in one run: {args.steps} RL steps each, "
           f"{args.groups_per_step} groups x {args.group_size} samples, task {args.task}, a fresh tiny policy; means "
           f"over steps 2-{args.steps}."), "",
          "| --nproc and flags | s/step | rollout tokens/s | inference | sandboxes | training | wall (s) |",
          "|---|---|---|---|---|---|---|"]  # fmt: skip
    for layout, r in results.items():
        md.append(f"| {layout} | {r['step_s']:.2f} | {r['rollout_tokens_per_s']:.0f} | {r['inference_share']:.0%} | "
                  f"{r['sandbox_share']:.1%} | {r['train_share']:.0%} | {r['wall_s']:.0f} |")  # fmt: skip
    md += ["", ("Losses per step (each layout samples its own rollouts; a fresh policy solves nothing, so its group "
                "advantages and losses are 0: this benchmark measures time, the tests measure equality):"), ""]
    md += [f"- {layout}: {', '.join(f'{v:.4g}' for v in r['losses'])}" for layout, r in results.items()]
    write_report({"machine": info, "settings": vars(args), "layouts": results}, args.out, "\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

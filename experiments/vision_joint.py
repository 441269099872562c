"""Does the tiny-vl model learn to read through the language model? The real `k3 train --preset tiny-vl`
loop, next-token prediction on the answer only, on `vision_glyph.py`'s one-letter images and on the text task.

    python experiments/vision_joint.py [--tasks glyph-bw-aligned,text] [--steps 400] [--lr 3e-4]
        [--vision-lr 3e-4] [--out benchmarks/results/vision-joint]

`vision_glyph.py` trains the tower with a linear head. This benchmark asks the same question of the joint model,
so a failure to read on the text task can be put either on the joint loop (the projector, the language model
learning the answers' prior first, the tower's share of the gradient) or on the images. Tasks:

- `glyph-<colours>-<placement>`: one capital letter per 56x56 image exactly as `vision_glyph.glyph` draws it
  (colours `bw` or `random`, placement `aligned` or `free`), prompt "Which letter is this?", answer the letter
  (chance 1/24 = 4.2%). The training stream swaps `vision_tasks.example` for the glyph sampler while this process
  runs `k3 train`; tokenizer, encoder, trainer, evaluation and metrics are the real ones.
- `text`: the embedded rendered-text task itself (`--vision-kinds text`).

Each task is one `k3 train` run with `--batch-size 32 --eval-every <steps/4>`; the table gives the held-out exact
match (greedy answers, `--eval-examples` examples) at each evaluation and the tower's gradient norm at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import vision_glyph
from bench import report  # benchmarks/report.py, loaded by path (experiments/bench.py)

from openk3.cli import main as k3_main
from openk3.data import vision_tasks as vt

GLYPH_PROMPT = "Which letter is this?"


@contextlib.contextmanager
def glyph_stream(bw: bool, aligned: bool):
    """`vision_tasks.example` replaced by one-letter images while the block runs (seed s shifts the index, so held-out
    and training images come from different `vision_glyph` splits and seeds give different streams)."""

    def example(index: int, seed: int = 0, split: str = "train", kinds=vt.KINDS) -> vt.VisionExample:
        image, label = vision_glyph.glyph(index + 10_000_000 * seed, split, bw, aligned)
        return vt.VisionExample(image, GLYPH_PROMPT, vision_glyph.LETTERS[label], "text", {"question": "read"})

    original, vt.example = vt.example, example
    try:
        yield
    finally:
        vt.example = original


def glyph_options(task: str) -> tuple[bool, bool] | None:
    """`task` -> (bw, aligned) for a glyph task, None for `text`; ValueError for anything else."""
    if task == "text":
        return None
    parts = task.split("-")
    if (
        len(parts) != 3
        or parts[0] != "glyph"
        or parts[1] not in ("bw", "random")
        or parts[2] not in ("aligned", "free")
    ):
        raise ValueError(f"--tasks: unknown task {task!r} (glyph-{{bw,random}}-{{aligned,free}} or text)")
    return parts[1] == "bw", parts[2] == "aligned"


def run(task: str, args, work: str) -> dict:
    out = os.path.join(work, task)
    argv = ["train", "--preset", "tiny-vl", "--data", "vision", "--vision-kinds", "text", "--steps", str(args.steps),
            "--batch-size", "32", "--lr", str(args.lr), "--vision-lr", str(args.vision_lr), "--seed", str(args.seed),
            "--eval-every", str(max(args.steps // 4, 1)), "--vision-eval-examples", str(args.eval_examples),
            "--out", out]  # fmt: skip
    options = glyph_options(task)
    stream = contextlib.nullcontext() if options is None else glyph_stream(*options)
    timing = os.path.join(out, "bench_seconds.txt")  # written when the run finished: a rerun only re-renders
    if not os.path.exists(timing):
        if os.path.exists(out):  # a run cut short: continue it from its last checkpoint
            argv.append("--resume")
        start = time.perf_counter()
        with stream:
            if k3_main(argv) != 0:
                raise SystemExit(f"k3 train failed for task {task}")
        with open(timing, "w", encoding="utf-8") as f:
            f.write(f"{time.perf_counter() - start:.1f}\n")
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    with open(timing, encoding="utf-8") as f:
        seconds = float(f.read())
    evals = [(r["step"], r["vision_exact"], r["vision_cer"]) for r in rows if "vision_exact" in r]
    last = rows[-1]
    return {"task": task, "evals": evals, "grad_norm_tower": last.get("grad_norm_tower"),
            "val_loss": last.get("val_loss"), "seconds": seconds, "argv": argv}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="glyph-bw-aligned,text",
                   help="comma-separated: glyph-{bw,random}-{aligned,free} and/or text")  # fmt: skip
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--vision-lr", type=float, default=3e-4)
    p.add_argument("--eval-examples", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default="runs/bench-vision-joint",
                   help="run folders (a finished task is not rerun, one cut short is resumed)")  # fmt: skip
    p.add_argument(
        "--out",
        default="runs/experiments/vision-joint",
        help="JSON path or the path without .json, the .md beside it (default under runs/, not committed; "
        "--out benchmarks/results/vision-joint replaces the committed result)",
    )
    args = p.parse_args(argv)
    for task in args.tasks.split(","):
        try:
            glyph_options(task)
        except ValueError as err:
            p.error(str(err))
    machine = report.machine_info()
    runs = [run(task, args, args.work) for task in args.tasks.split(",")]
    steps = [s for s, _, _ in runs[0]["evals"]]
    lines = ["# Reading through the language model: tiny-vl joint training (`python experiments/vision_joint.py`)", "",
             (f"Machine: {machine['cpu']}, {machine['threads']} threads, torch {machine['torch']}. `k3 train --preset "
              f"tiny-vl`, {args.steps} steps of 32 fresh examples, lr {args.lr}, tower and projector lr "
              f"{args.vision_lr}, seed {args.seed}; held-out exact match of greedy answers on {args.eval_examples} "
              "examples."), "",
             "Run: `python experiments/vision_joint.py " + " ".join(argv if argv is not None else sys.argv[1:]) + "`",
             "", "| task | " + " | ".join(f"step {s}" for s in steps) + " | tower grad norm at the end | time |",
             "|---|" + "---|" * (len(steps) + 2)]  # fmt: skip
    for r in runs:
        cells = " | ".join(f"{acc:.1%}" for _, acc, _ in r["evals"])
        lines.append(f"| {r['task']} | {cells} | {r['grad_norm_tower']:.3g} | {r['seconds']:.0f} s |")
    report.write_report({"machine": machine, "args": vars(args), "runs": runs}, args.out, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

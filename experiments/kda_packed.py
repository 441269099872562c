"""Packed sequences in the fast KDA op: one tile stream against padded lockstep rows, side by side in one run.

`kda_chunked` with `cu_seqlens` lays the sequences out either as one stream of tiles (the state pass walks every
sequence's tiles in turn, with H state rows) or as N padded rows in lockstep (it walks the longest sequence's tiles
once, with N·H rows; `chunk.lockstep_pays` picks it while the padded work is at most `_LOCKSTEP_MAX_WORK` times the
packed work). This measures forward + backward of both layouts on batches shaped like the RL update, the SFT and
copy warm-start batches and more ragged ones, interleaved (ABAB) so the machine's drift hits both alike, and writes
benchmarks/results/kda-packed.{json,md}. With `--update-from RUN` (a `k3 rl` run's warm start) it also times one RL
update (`RLTrainer.update`, 64 sampled episodes) as it was (stream layout, the other log-prob gap every step) and as it
is (lockstep, the other gap every `--gap-check-every` steps), interleaved:

    python experiments/kda_packed.py [--repeats 5] [--update-from runs/bench-rl] [--out benchmarks/results/kda-packed]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from bench import report  # benchmarks/report.py, loaded by path (experiments/bench.py)

from openk3.ops.kda import chunk
from openk3.ops.kda.chunk import kda_chunked, lockstep_pays, lockstep_work
from openk3.rl.config import RLConfig

H, K, V = 3, 64, 64  # the tiny preset's KDA heads (the RL and SFT policy)


def batches() -> dict[str, list[int]]:
    """Sequence lengths per batch, fixed by a seed: what `k3 rl`'s update and warm start pack."""
    gen = torch.Generator().manual_seed(0)

    def lens(n, lo, hi):
        return torch.randint(lo, hi + 1, (n,), generator=gen).tolist()

    return {
        "RL micro-batch: 16 episodes of 150-300": lens(16, 150, 300),
        "SFT batch: 16 demonstrations of 200-280": lens(16, 200, 280),
        "copy batch: 32 spans of 13-49": lens(32, 13, 49),
        "ragged: 8 of 20-400": lens(8, 20, 400),
        "one long, 7 short: 1000 + 7 of 20-60": [1000] + lens(7, 20, 60),
    }


def timed(lens: list[int], max_work: float, x) -> float:
    """Seconds for one forward + backward with `_LOCKSTEP_MAX_WORK = max_work`."""
    chunk._LOCKSTEP_MAX_WORK = max_work
    leaves = [t.clone().requires_grad_() for t in x]
    cu = torch.tensor([0] + lens).cumsum(0)
    t0 = time.perf_counter()
    o, _ = kda_chunked(*leaves, cu_seqlens=cu)
    o.sum().backward()
    return time.perf_counter() - t0


def rl_update_ab(run: str, repeats: int) -> dict:
    """Seconds of one RL update on the same 64 episodes: before (stream layout, gap_check_every = 1) and after."""
    import shutil
    import tempfile

    from openk3.rl.loop import RLTrainer

    out = tempfile.mkdtemp(prefix="kda-packed-rl-")
    trainer = RLTrainer(RLConfig(out=out, init=run, progress=False, eval_tasks=1), log=lambda *a: None)
    default = chunk._LOCKSTEP_MAX_WORK
    try:
        trajs = trainer._new_trajectories()
        trainer.worker.run(trajs, trainer.version)
        times = {"before": [], "after": []}
        settings = {"before": (0.0, 1, 0), "after": (default, RLConfig.gap_check_every, 1)}  # max work, every, step
        for i in range(repeats + 1):  # the first round warms up
            for name, (max_work, every, step) in settings.items():
                chunk._LOCKSTEP_MAX_WORK, trainer.cfg.gap_check_every, trainer.step = max_work, every, step
                t0 = time.perf_counter()
                trainer.update(trajs)
                if i:
                    times[name].append(time.perf_counter() - t0)
        trainer.worker.close(trajs)
    finally:
        chunk._LOCKSTEP_MAX_WORK = default
        trainer.close()
        shutil.rmtree(out, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"run": run, "episodes": len(trajs), "tokens": sum(len(t.tokens) for t in trajs), "before_s": med["before"],
            "after_s": med["after"], "speedup": med["before"] / med["after"]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--update-from", default=None, help="a k3 rl run whose warm start the RL update A/B samples from")
    p.add_argument(
        "--out",
        default="runs/experiments/kda-packed",
        help="JSON path or the path without .json, the .md beside it (default under runs/, not committed; "
        "--out benchmarks/results/kda-packed replaces the committed result)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    default = chunk._LOCKSTEP_MAX_WORK
    info, rows = report.machine_info(), []
    try:
        for name, lens in batches().items():
            T = sum(lens)
            gen = torch.Generator().manual_seed(1)
            x = (F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1),
                 F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1), torch.randn(1, T, H, V, generator=gen),
                 -5 * torch.rand(1, T, H, K, generator=gen), torch.rand(1, T, H, generator=gen))  # fmt: skip
            times = {"stream": [], "lockstep": []}
            timed(lens, 0.0, x), timed(lens, float("inf"), x)  # warm-up
            for _ in range(args.repeats):
                times["stream"].append(timed(lens, 0.0, x))
                times["lockstep"].append(timed(lens, float("inf"), x))
            chunk._LOCKSTEP_MAX_WORK = default  # what the op picks on its own
            bounds = [0] + torch.tensor(lens).cumsum(0).tolist()
            lockstep, stream = lockstep_work(bounds, 16)
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append({"batch": name, "tokens": T, "sequences": len(lens), "work_ratio": lockstep / stream,
                         "chosen": "lockstep" if lockstep_pays(bounds, 16) else "stream",
                         "stream_s": med["stream"], "lockstep_s": med["lockstep"],
                         "speedup": med["stream"] / med["lockstep"]})  # fmt: skip
            print(rows[-1], flush=True)
    finally:
        chunk._LOCKSTEP_MAX_WORK = default
    update = rl_update_ab(args.update_from, max(1, args.repeats // 2)) if args.update_from else None
    if update:
        print(update, flush=True)
    md = ["# Packed KDA: tile stream vs lockstep rows (`python experiments/kda_packed.py`)", "",
          f"Machine: {info['cpu']}, {info['threads']} threads, torch {info['torch']}; load before: {info['load_before']}.",
          (f"Forward + backward of `kda_chunked` with `cu_seqlens`, H={H}, K={K}, V={V} (the tiny policy's KDA), "
           f"fp32; median of {args.repeats} interleaved runs per layout. `chosen`: the layout `lockstep_pays` picks "
           f"(lockstep while padded work <= {default:g}x packed)."), "",
          "| batch | tokens | padded / packed work | stream s | lockstep s | lockstep speed-up | chosen |",
          "|---|---|---|---|---|---|---|"]  # fmt: skip
    md += [f"| {r['batch']} | {r['tokens']} | {r['work_ratio']:.2f} | {r['stream_s']:.3f} | {r['lockstep_s']:.3f} | "
           f"{r['speedup']:.2f}x | {r['chosen']} |" for r in rows]  # fmt: skip
    if update:
        md += ["", (f"One RL update (`RLTrainer.update`) on {update['episodes']} sampled episodes ({update['tokens']} "
                    f"tokens) of `{update['run']}`'s warm start: {update['before_s']:.1f} s before (stream layout, the "
                    f"other log-prob gap every step), {update['after_s']:.1f} s after (lockstep, the other gap every "
                    f"{RLConfig.gap_check_every} steps): **{update['speedup']:.2f}x**, median of interleaved runs.")]  # fmt: skip
    report.write_report({"machine": info, "heads": H, "key_dim": K, "value_dim": V, "max_work": default, "rows": rows,
                  "rl_update": update}, args.out, "\n".join(md) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

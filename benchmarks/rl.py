"""The agentic-RL benchmark (the RL targets), one run on this machine (committed results:
benchmarks/results/rl-cpu.*):

1. a fresh tiny policy, the warm start (copy pre-training, then SFT on demonstrations with a share of tool-free
   guesses), then `k3 rl` for a wall-clock budget (30 min); `--init` starts RL from an earlier run's warm start;
   held-out success per family (greedy, the same test tasks) at the SFT start and after RL -> `success_gain`;
2. routing replay: the rollout-vs-train log-prob gap per token with replay (the training forward) and without (the
   extra forward every step makes), averaged over the RL steps;
3. prefix caching across turns: the trained policy's episodes on the files family, greedy, with the engine's prefix
   cache on and off (the same tokens, asserted): prefill tokens per episode, the ratio;
4. rollout throughput (generated tokens/s) and the share of step time spent in inference, sandboxes and training;
5. the held-out episodes by outcome at the start and after RL (`failure_breakdown`): guesses, tool errors, and
   what a clean call got wrong.

    python benchmarks/rl.py (or k3 bench rl) [--copy-steps 1600] [--sft-steps 500] [--guess-share 0.9] [--lr 1e-4]
        [--rl-minutes 30] [--kl-coef 0.1] [--task calculator,files] [--init WARM_RUN] [--out benchmarks/results/rl-cpu]

Writes runs/bench/rl-cpu.{json,md} unless --out says where (benchmarks/results/rl-cpu: the committed results).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict

import torch
from report import machine_info, out_help, scratch_out, targets_table, write_report

from openk3.rl.config import RLConfig
from openk3.rl.envs import get_family
from openk3.rl.evaluate import SUCCESS
from openk3.rl.loop import RLTrainer, engine_config
from openk3.rl.plot import plot_rl_run
from openk3.rl.rollout import RolloutWorker
from openk3.rl.sft import fresh_policy
from openk3.serve.engine import LLMEngine


def prefix_cache_ratio(trainer: RLTrainer, episodes: int = 16) -> dict:
    """Prefill tokens per files episode with the prefix cache on and off (greedy, same weights and tasks)."""
    out = {}
    tokens = {}
    for caching in (True, False):
        cfg = copy.copy(trainer.cfg)
        cfg.prefix_caching = caching
        engine = LLMEngine(copy.deepcopy(trainer.engine.model), trainer.tokenizer, engine_config(cfg, 64))
        worker = RolloutWorker(engine, trainer.tokenizer, trainer.fleet, trainer.worker.budgets,
                               snapshots=trainer.snapshots, max_tokens_per_turn=cfg.max_tokens_per_turn)  # fmt: skip
        family = get_family("files")
        # Four samples per task, as a GRPO group: turns resume from their own earlier turns, samples from the prompt.
        trajs = [
            worker.start(family.generate("test", i), group=i, sample=s) for i in range(episodes // 4) for s in range(4)
        ]
        worker.run(trajs, version=0, temperature=0.0)
        tokens[caching] = [t.tokens for t in trajs]
        out["cached" if caching else "uncached"] = {
            "prefill_tokens_per_episode": sum(t.prefill_tokens for t in trajs) / len(trajs),
            "turns_per_episode": sum(t.turns for t in trajs) / len(trajs),
            "tokens_per_episode": sum(len(t.tokens) for t in trajs) / len(trajs),
        }
    assert tokens[True] == tokens[False], "prefix caching changed the greedy episodes"
    out["ratio"] = out["cached"]["prefill_tokens_per_episode"] / out["uncached"]["prefill_tokens_per_episode"]
    return out


def failure_breakdown(episodes: dict, tokenizer) -> dict:
    """Why held-out episodes fail (the evaluation's greedy episodes), per family and task kind: success, no tool call
    (a guess), a tool error, or, for a clean call, what the transcript shows: calculator - the task's expression is
    (not) in the call (the numbers copied right or not); files - the answer is (not) in an observation (the right
    tool call, then the value miscopied or the wrong line picked, or a wrong call). `episodes`: {key: trajectories},
    as `RLTrainer.held_out_episodes` gives them."""
    out: dict[str, Counter] = defaultdict(Counter)
    for t in (t for trajs in episodes.values() for t in trajs):
        task, text = t.task, tokenizer.decode(t.tokens[t.prompt_len :])
        if t.reward >= SUCCESS:
            kind = "success"
        elif t.tool_calls == 0:
            kind = "no tool call"
        elif t.tool_errors:
            kind = "tool error"
        elif task.family == "calculator":
            kind = "right expression, answer miscopied" if task.meta["expression"] in text else "wrong expression"
        elif task.family == "files":
            kind = "answer in an observation, not copied" if task.answer in text else "wrong call"
        else:
            kind = "failed"
        out[task.family + (f"/{task.meta['kind']}" if task.family == "files" else "")][kind] += 1
    return {k: dict(sorted(v.items())) for k, v in sorted(out.items())}


def breakdown_table(before: dict, after: dict) -> list[str]:
    rows = ["| family / kind | outcome | at the start | after RL |", "|---|---|---|---|"]
    for key in sorted(set(before) | set(after)):
        for kind in sorted(set(before.get(key, {})) | set(after.get(key, {}))):
            rows.append(f"| {key} | {kind} | {before.get(key, {}).get(kind, 0)} | {after.get(key, {}).get(kind, 0)} |")
    return rows


def warm_start_of(run: str) -> tuple[float, dict]:
    """An earlier run's warm start: the copy and SFT phases' wall time (each phase's last line in sft.jsonl) and its
    settings (copy_steps, sft_steps, sft_guess_share from rl_config.json)."""
    last: dict[str, float] = {}
    with open(os.path.join(run, "sft.jsonl"), encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            last["copy" if "copy_step" in row else "sft"] = row["elapsed_s"]
    settings = RLConfig.from_file(os.path.join(run, "rl_config.json"))
    return sum(last.values()), {k: getattr(settings, k) for k in ("copy_steps", "sft_steps", "sft_guess_share")}


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["layouts"]:
        return layouts_main(argv[1:])
    p = argparse.ArgumentParser(
        prog="python benchmarks/rl.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="`python benchmarks/rl.py layouts` compares `k3 rl` at several process layouts "
        "instead (`layouts --help`).",
    )
    p.add_argument("--task", default="calculator,files")
    p.add_argument("--copy-steps", type=int, default=1600, help="k3 rl --copy-steps")
    p.add_argument("--sft-steps", type=int, default=500)
    p.add_argument("--rl-minutes", type=float, default=30.0)
    p.add_argument("--max-steps", type=int, default=400)
    p.add_argument("--eval-tasks", type=int, default=32)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--guess-share", type=float, default=0.9, help="k3 rl --sft-guess-share")
    p.add_argument("--lr", type=float, default=RLConfig.lr, help="k3 rl --lr")
    p.add_argument("--groups-per-step", type=int, default=RLConfig.groups_per_step)
    p.add_argument("--group-size", type=int, default=RLConfig.group_size)
    p.add_argument("--kl-coef", type=float, default=0.1, help="k3 rl --kl-coef")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--init",
        default=None,
        help="start RL from this earlier run's warm start (skips copy and SFT; its steps and guess share are reported)",
    )
    p.add_argument("--run", default="runs/bench-rl", help="the run folder (replaced)")
    p.add_argument("--out", default=None, help=out_help("rl-cpu"))
    args = p.parse_args(argv)
    args.out = args.out or scratch_out("rl-cpu")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    shutil.rmtree(args.run, ignore_errors=True)
    info = machine_info()
    cfg = RLConfig(task=args.task, out=args.run, steps=args.max_steps, init=args.init,
                   copy_steps=0 if args.init else args.copy_steps, sft_steps=0 if args.init else args.sft_steps,
                   sft_guess_share=0.0 if args.init else args.guess_share, lr=args.lr, kl_coef=args.kl_coef,
                   groups_per_step=args.groups_per_step, group_size=args.group_size, seed=args.seed, eval_tasks=args.eval_tasks,
                   eval_every=args.eval_every, save_every=10**6, progress=False)  # fmt: skip
    trainer = RLTrainer(cfg)
    if args.init:  # the warm start ran in the init's run: its time and settings from that run's files
        sft_s, warm = warm_start_of(args.init)
        args.copy_steps, args.sft_steps, args.guess_share = (
            warm[k] for k in ("copy_steps", "sft_steps", "sft_guess_share")
        )
    else:
        t0 = time.perf_counter()
        trainer.warm_start()
        sft_s = time.perf_counter() - t0
        trainer.save()  # the warm start (step 0): `--init RUN` starts another RL run from it
    episodes = trainer.held_out_episodes()  # the evaluation's episodes, also classified by outcome
    start = trainer._write({"step": 0, **trainer.evaluate(episodes)})["eval_success"]
    breakdown_start = failure_breakdown(episodes, trainer.tokenizer)
    rows, t0 = [], time.perf_counter()
    while trainer.step < cfg.steps and time.perf_counter() - t0 < args.rl_minutes * 60:
        row = trainer.train_step()
        if trainer.step % cfg.eval_every == 0:
            episodes = trainer.held_out_episodes()
            row.update(trainer.evaluate(episodes))
        rows.append(trainer._write(row))
        print(f"step {trainer.step}: reward {row['reward']:.3f} gap {row['logprob_gap']:.2e} "
              f"{time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
    rl_s = time.perf_counter() - t0
    final = rows[-1]["eval_success"] if rows and "eval_success" in rows[-1] else None
    if final is None:
        episodes = trainer.held_out_episodes()
        final = trainer._write({"step": trainer.step, **trainer.evaluate(episodes)})["eval_success"]
    gain = {f: final[f] - start[f] for f in start}
    trainer.save()
    breakdown_end = failure_breakdown(episodes, trainer.tokenizer)  # the last evaluation's, at the final weights
    caching = prefix_cache_ratio(trainer)
    trainer.close()
    plots = plot_rl_run(args.run, os.path.dirname(args.out) or ".")
    for path in plots:  # keep the plots next to the report under their own names
        os.replace(path, os.path.join(os.path.dirname(path), "rl-cpu-" + os.path.basename(path)))

    def mean(key):
        vals = [r[key] for r in rows if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    gap_replay, gap_natural = mean("logprob_gap_replay"), mean("logprob_gap_natural")
    gap_max = max((r["logprob_gap_max"] for r in rows), default=None)
    families_met = sum(g >= 0.30 for g in gain.values())
    targets = [
        {"target": "held-out success +30 points on >= 2 families within 30 min of RL (2 CPU cores)",
         "measured": ", ".join(f"{f}: {100 * start[f]:.0f}% -> {100 * final[f]:.0f}%" for f in start)
                     + f" in {rl_s / 60:.1f} min, {trainer.step} steps",
         "met": families_met >= 2},
        {"target": "logprob gap <= 1e-5 with routing replay", "measured": f"mean {gap_replay:.2e} (max token "
         f"{gap_max:.2e}); without replay {gap_natural:.2e}", "met": gap_replay is not None and gap_replay <= 1e-5},
        {"target": "prefill tokens per files episode with caching <= 0.3x without",
         "measured": f"{caching['cached']['prefill_tokens_per_episode']:.0f} / "
                     f"{caching['uncached']['prefill_tokens_per_episode']:.0f} = {caching['ratio']:.2f}x",
         "met": caching["ratio"] <= 0.3},
        {"target": "rollout throughput and time shares reported",
         "measured": f"{mean('rollout_tokens_per_s'):.0f} tokens/s; inference {100 * mean('inference_share'):.0f}%, "
                     f"sandboxes {100 * mean('sandbox_share'):.1f}%, training {100 * mean('train_share'):.0f}%",
         "met": True},
    ]  # fmt: skip
    result = {
        "machine": info, "config": json.loads(cfg.to_json()), "copy_steps": args.copy_steps,
        "sft_steps": args.sft_steps, "sft_s": sft_s,
        "rl_s": rl_s, "rl_steps": trainer.step, "success_start": start, "success_end": final, "success_gain": gain,
        "logprob_gap_replay": gap_replay, "logprob_gap_natural": gap_natural, "logprob_gap_max": gap_max,
        "failures_start": breakdown_start, "failures_end": breakdown_end, "prefix_caching": caching,
        "rollout_tokens_per_s": mean("rollout_tokens_per_s"),
        "inference_share": mean("inference_share"), "sandbox_share": mean("sandbox_share"),
        "train_share": mean("train_share"), "step_s": mean("step_s"), "targets": targets,
    }  # fmt: skip
    md = ["# Agentic RL on CPU (`python benchmarks/rl.py`)", "",
          (f"Machine: {info['cpu']}, {info['threads']} threads, torch {info['torch']}; load before: "
           f"{info['load_before']}."), "",
          *targets_table(targets, "agentic RL"), "",
          "## Run", "",
          (f"- policy: fresh `tiny` ({args.task}); warm start: {args.copy_steps} copy pre-training steps, then "
           f"{args.sft_steps} SFT steps with a guess share of {args.guess_share}, {sft_s:.0f} s in all"
           + (f" (run earlier; RL started from its checkpoint `{args.init}`)" if args.init else "") + ";"),
          (f"- RL: {trainer.step} steps in {rl_s:.0f} s ({mean('step_s'):.1f} s/step), {cfg.groups_per_step} groups x "
           f"{cfg.group_size} samples, lr {cfg.lr:g}, {cfg.loss} ({cfg.eps_low}/{cfg.eps_high}), {cfg.correction}, "
           "routing replay" + (f", KL to the warm start x {cfg.kl_coef:g}" if cfg.kl_coef else "") + ";"),
          (f"- held-out success (greedy, {args.eval_tasks} test tasks per family): start {start}, end {final}, "
           f"gain {gain};"),
          f"- prefix caching on files episodes: {json.dumps(caching)};",
          "", f"## Held-out episodes by outcome (greedy, {args.eval_tasks} test tasks per family)", "",
          *breakdown_table(breakdown_start, breakdown_end),
          "", "Curves: `rl-cpu-reward.png`, `rl-cpu-logprob_gap.png`.", ""]  # fmt: skip
    write_report(result, args.out, "\n".join(md))
    return 0


# ---- process layouts -------------------------------------------------------------------------------------------------
# `k3 rl` at several process layouts, side by side in one run: the same short run (a fixed init, the same seed and
# task stream) at `--nproc 1` and at `--nproc 2 --ep 2` (more with `--layouts`), each through the real command line
# (torchrun for N > 1), written to runs/bench/rl-layouts-cpu.{json,md} (`--out benchmarks/results/rl-layouts-cpu`:
# the committed results).
#
# Reported per layout, over the RL steps after the first (warm-up): seconds per step, generated tokens per second of
# the rollout, the step's shares of inference, sandboxes and training, and the loss of each step (the layouts train on
# different rollouts: each rank samples its own groups, so losses agree in scale, not in value).
#
# The init is a fresh `tiny` policy with the RL recipe's task tokenizer and no warm start: its episodes run to the
# token budgets, which is what the timings need (the quality of the policy does not enter them).
#
#     python benchmarks/rl.py layouts [--steps 6] [--layouts "1;2 --ep 2"] [--out benchmarks/results/rl-layouts-cpu]


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


def layout_summary(rows: list[dict]) -> dict:
    timed = rows[1:] or rows  # the first step warms the engine and the fleet up

    def mean(key):
        return sum(r[key] for r in timed) / len(timed)

    return {"step_s": mean("step_s"), "rollout_tokens_per_s": mean("rollout_tokens_per_s"),
            "inference_share": mean("inference_share"), "sandbox_share": mean("sandbox_share"),
            "train_share": mean("train_share"), "losses": [r["loss"] for r in rows]}  # fmt: skip


def layouts_main(argv: list[str]) -> int:
    """`python benchmarks/rl.py layouts`: the comparison above."""
    p = argparse.ArgumentParser(prog="python benchmarks/rl.py layouts",
                                description="the same short `k3 rl` run at several process layouts, side by side "
                                "(seconds per step, rollout tokens/s, the step's shares, losses)")  # fmt: skip
    p.add_argument("--layouts", default="1;2 --ep 2", help="';'-separated: the process count, then k3 rl flags")
    p.add_argument("--task", default="calculator,files")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--groups-per-step", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help=out_help("rl-layouts-cpu"))
    args = p.parse_args(argv)
    args.out = args.out or scratch_out("rl-layouts-cpu")
    info = machine_info()
    layouts = [x.strip() for x in args.layouts.split(";") if x.strip()]
    with tempfile.TemporaryDirectory(prefix="k3-rl-layouts-") as tmp:
        init = make_init(os.path.join(tmp, "init"), args.task, args.seed)
        results = {}
        for i, layout in enumerate(layouts):
            got = run_layout(layout, init, os.path.join(tmp, f"run-{i}"), args)
            results[layout] = {**layout_summary(got["rows"]), "wall_s": got["wall_s"]}
    md = ["# `k3 rl` at several layouts (`python benchmarks/rl.py layouts`)", "",
          (f"Machine: {info['cpu']}, {info['threads']} threads, torch {info['torch']}; load before: "
           f"{info['load_before']}. Measured side by side in one run: {args.steps} RL steps each, "
           f"{args.groups_per_step} groups x {args.group_size} samples, task {args.task}, a fresh tiny policy; means "
           f"over steps 2-{args.steps}."), "",
          "| --nproc and flags | s/step | rollout tokens/s | inference | sandboxes | training | wall (s) |",
          "|---|---|---|---|---|---|---|"]  # fmt: skip
    for layout, r in results.items():
        md.append(f"| {layout} | {r['step_s']:.2f} | {r['rollout_tokens_per_s']:.0f} | {r['inference_share']:.0%} | "
                  f"{r['sandbox_share']:.1%} | {r['train_share']:.0%} | {r['wall_s']:.0f} |")  # fmt: skip
    md += [
        "",
        (
            "Losses per step (each layout samples its own rollouts; a fresh policy solves nothing, so its group "
            "advantages and losses are 0: this benchmark measures time, the tests measure equality):"
        ),
        "",
    ]
    md += [f"- {layout}: {', '.join(f'{v:.4g}' for v in r['losses'])}" for layout, r in results.items()]
    write_report({"machine": info, "settings": vars(args), "layouts": results}, args.out, "\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

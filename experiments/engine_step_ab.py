"""`python experiments/engine_step_ab.py --base /tmp/base`: decode tok/s of the serving engine in two source trees,
side by side in one run (made for the batched engine step against the per-request one).

Each measurement is a subprocess with `PYTHONPATH=<tree>` that uses the public API only (`LLMEngine`,
`SamplingParams`, a random-weight model of `K3Config.preset(--preset)`, prompts of fixed ids, `ignore_eos`):
C requests of `--prompt` tokens each decode `--tokens` tokens with seeded sampling (temperature 0.8, top-p 0.9),
once without stop strings and once with stop strings that never match (what a chat template sets; the old engine
re-decoded the whole output per token to search them). Decode tok/s counts only the steps after every request
has its first token (every prompt prefilled); end-to-end counts everything from the first step. The trees
alternate over `--repeats` rounds (A B, B A, ...) so drift of a shared machine falls on both; the report gives the
median, the min-max spread and the after/before ratio of the medians.

Legend: C concurrent requests, tok/s output tokens per second.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

NEVER = ["<|never-printed-1|>", "\n\n\n\nUser:"]  # stop strings a random model does not produce
METRICS = {
    "decode_cpu_tok_s": "Decode tok/s per CPU second (steps after every prompt is prefilled; the least noisy figure)",
    "decode_tok_s": "Decode tok/s, wall clock",
    "e2e_cpu_tok_s": "End-to-end tok/s per CPU second",
    "e2e_tok_s": "End-to-end tok/s, wall clock",
    "engine_ms_per_step": "Engine time per decode step outside the model's forward, ms (what this item changes)",
}


def worker(args) -> dict:
    """One tree's numbers for every (concurrency, stop) setting, measured in this process."""
    import torch

    from openk3.config import K3Config
    from openk3.model.model import K3ForCausalLM
    from openk3.serve.config import ServeConfig
    from openk3.serve.engine import LLMEngine
    from openk3.serve.request import SamplingParams

    torch.set_num_threads(1)
    logging_off()
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset(args.preset))
    model.init_random_weights(0)
    model.eval()
    vocab = model.text_config.vocab_size
    in_model = _time_inside(model.model, model.lm_head)
    out = {}
    for c in args.concurrency:
        for stop in (False, True):
            engine = LLMEngine(model, None, ServeConfig.from_options(max_num_seqs=max(c, 1)))
            for i in range(c):
                ids = torch.randint(0, vocab - 256, (args.prompt,), generator=torch.Generator().manual_seed(i))
                params = SamplingParams(max_tokens=args.tokens, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True,
                                        stop=NEVER if stop else None)  # fmt: skip
                engine.add_request({"prompt_token_ids": ids.tolist()}, params, request_id=str(i))
            counts: dict[str, int] = {}
            start, start_cpu = time.perf_counter(), time.process_time()
            decode_start, steps = None, 0
            while engine.has_unfinished():
                for o in engine.step():
                    counts[o.request_id] = len(o.outputs[0].token_ids)
                steps += decode_start is not None
                if decode_start is None and len(counts) == c and all(n >= 1 for n in counts.values()):
                    decode_start, decode_cpu, decode_tokens0 = time.perf_counter(), time.process_time(), sum(
                        counts.values())  # fmt: skip
                    in_model[0] = 0.0
            end, end_cpu = time.perf_counter(), time.process_time()
            total = sum(counts.values())
            assert total == c * args.tokens, (total, c, args.tokens)
            out[f"{c}/{'stop' if stop else 'plain'}"] = {
                "decode_tok_s": (total - decode_tokens0) / (end - decode_start),
                # Per CPU second of this (one-thread) process: what other processes on a shared machine take
                # from the wall clock does not count here.
                "decode_cpu_tok_s": (total - decode_tokens0) / (end_cpu - decode_cpu),
                "e2e_tok_s": total / (end - start),
                "e2e_cpu_tok_s": total / (end_cpu - start_cpu),
                "engine_ms_per_step": 1000 * (end - decode_start - in_model[0]) / steps,
            }
    return out


def _time_inside(*modules) -> list[float]:
    """Seconds spent inside the forwards of `modules` (accumulated in the returned one-element list) via forward
    hooks: public torch API, the same in both trees, so a step's time outside the model (the engine's own work:
    scheduling, sampling, detokenizing, outputs) can be told from the model's."""
    acc, started = [0.0], {}

    def pre(module, args):
        started[id(module)] = time.perf_counter()

    def post(module, args, output):
        acc[0] += time.perf_counter() - started.pop(id(module))

    for m in modules:
        m.register_forward_pre_hook(pre)
        m.register_forward_hook(post)
    return acc


def logging_off() -> None:
    import logging

    logging.getLogger("openk3.serve").setLevel(logging.WARNING)


def run_tree(tree: str, args) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--preset", args.preset, "--prompt", str(args.prompt),
           "--tokens", str(args.tokens), "--concurrency", ",".join(map(str, args.concurrency))]  # fmt: skip
    # Run from a neutral folder so the current directory's openk3 cannot shadow the tree's.
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=os.path.dirname(tree) or "/")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="/tmp/base", help="the 'before' source tree")
    p.add_argument("--new", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), help="'after' tree")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--tokens", type=int, default=256, help="output tokens per request")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    p.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="another tree measured beside them (e.g. one change alone on top of the base)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--out",
        default="runs/experiments/engine-step",
        help="JSON path or the path without .json, the .md beside it (default under runs/, not committed; "
        "--out benchmarks/results/engine-step replaces the committed result)",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    from bench import report  # benchmarks/report.py, loaded by path (experiments/bench.py)

    load_info, machine_info, write_report = report.load_info, report.machine_info, report.write_report

    trees = {"before": args.base, "after": args.new, **dict(e.split("=", 1) for e in args.extra)}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    machine = machine_info()
    start = time.perf_counter()
    names = list(trees)
    for r in range(args.repeats):
        order = names if r % 2 == 0 else names[::-1]  # alternate, so a drifting load falls on every tree
        for name in order:
            runs[name].append(run_tree(trees[name], args))
            print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v['decode_cpu_tok_s']:.1f}"
                                                        for k, v in runs[name][-1].items()), flush=True)  # fmt: skip
    rows = {}
    for key in runs["before"][0]:
        row = {}
        for metric in METRICS:
            for name in trees:
                vals = [run[key][metric] for run in runs[name]]
                row[f"{metric}_{name}"] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals),
                                           "all": vals}  # fmt: skip
                row[f"{metric}_ratio_{name}"] = row[f"{metric}_{name}"]["median"] / row[f"{metric}_before"]["median"]
        rows[key] = row
    result = {"machine": machine, "args": {k: v for k, v in vars(args).items() if k != "worker"}, "trees": trees,
              "wall_s": time.perf_counter() - start, "results": rows}  # fmt: skip
    result["machine"]["load_after"] = load_info()
    write_report(result, args.out, markdown(result))
    return 0


def markdown(r: dict) -> str:
    a, m, names = r["args"], r["machine"], list(r["trees"])
    others = names[1:]
    lines = [
        "# Engine step: before / after",
        "",
        (
            f"`python experiments/engine_step_ab.py` — `{a['preset']}` random-weight model, {a['prompt']}-token prompts, "
            f"{a['tokens']} output tokens per request (seeded sampling, temperature 0.8, top-p 0.9, `ignore_eos`), "
            f"one CPU thread per process, {a['repeats']} alternating rounds; {r['wall_s']:.0f} s in all."
        ),
        "Trees: " + ", ".join(f"{n} `{p}`" for n, p in r["trees"].items()) + ".",
        (
            f"Machine: {m.get('cpu', '?')}; load before `{m.get('load_before', '?')}`, after `{m.get('load_after', '?')}` "
            "(a shared machine: the spread is real)."
        ),
    ]
    for metric, title in METRICS.items():
        lines += ["", f"## {title}", "",
                  "| C | stop strings | " + " | ".join(names) + " | " + " | ".join(f"{n} / before" for n in others)
                  + " |", "|---:|---|" + "---:|" * (len(names) + len(others))]  # fmt: skip
        for key, row in r["results"].items():
            c, kind = key.split("/")
            d = 2 if metric.endswith("_ms_per_step") else 1
            cells = [f"{row[f'{metric}_{n}']['median']:.{d}f} ({row[f'{metric}_{n}']['min']:.{d}f}–"
                     f"{row[f'{metric}_{n}']['max']:.{d}f})" for n in names]  # fmt: skip
            ratios = [f"{row[f'{metric}_ratio_{n}']:.2f}" for n in others]
            lines.append(f"| {c} | {'yes' if kind == 'stop' else 'no'} | " + " | ".join(cells + ratios) + " |")
    lines += ["", "Medians over the rounds, (min–max) beside them; ratios of the medians."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())

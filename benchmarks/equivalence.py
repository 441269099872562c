"""Fixed-seed equivalence capture of `k3 train`, `k3 rl` and `k3 distill`: run at two commits and diff.

Runs a set of tiny, deterministic runs (preset tiny, one torch thread) through the public command line
(`python -m openk3.cli ...`) and writes one JSON file with, per run: every metrics.jsonl row's values that do not
depend on the clock (the per-step `loss` at full repr precision, rewards, KL, grad norms, evaluations, ...), the
warm start's copy/SFT rows from sft.jsonl (k3 rl), and the final weights (the run's newest checkpoint, read with
`openk3.train.checkpoint.load_model`): per tensor dtype, shape, sha256 of the raw bytes and the float64 sum. The
RL/distillation init checkpoint and the two teachers are built inside the script from fixed seeds (as the fixtures
of tests/rl/test_loop.py and tests/rl/test_distill.py do), so nothing outside the checkout is needed.

Usage (`openk3` must import from the checkout under test: set PYTHONPATH; the file records where it came from):

    git worktree add ../before HEAD~1      # the commit before the change
    cd ../before && PYTHONPATH=$PWD python ../openk3/benchmarks/equivalence.py --out /tmp/before.json
    cd ../openk3 && PYTHONPATH=$PWD python benchmarks/equivalence.py --out /tmp/after.json
    python benchmarks/equivalence.py --compare /tmp/before.json /tmp/after.json

    --only rl-ppo,distill-opd   a subset of the runs (names: --list); --keep DIR keeps the run folders there.

`--compare A B` prints per run whether every step's loss is bitwise equal, the max abs/rel loss difference, the
other metrics that differ, and how many weight tensors differ (bytes) with the max relative difference of their
sums; it exits 1 when anything differs. Sandboxes (user namespaces) are needed for the rl and distill runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

SEED = "0"
# Clock-dependent metrics (*_s, *_share: time shares, tokens_per_s, mfu, elapsed_s): kept out of the capture.
_CLOCK = ("per_s", "mfu", "elapsed", "time", "throughput")
WORDS = "What is 12 times 34, plus 5? print python cat grep ls value of port in conf main.ini How many lines ERROR"

COMMON = ["--seed", SEED, "--threads", "1", "--no-progress"]
TRAIN = ["train", "--preset", "tiny", "--steps", "4", "--batch-size", "2", "--seq-len", "32", "--eval-every", "2",
         "--eval-batches", "1", "--save-every", "100", "--sample-tokens", "0", *COMMON]  # fmt: skip
SMALL = ["--groups-per-step", "2", "--group-size", "2", "--max-turns", "2", "--max-tokens-per-turn", "16",
         "--eval-tasks", "1", "--eval-every", "2", "--save-every", "100", "--lr", "1e-3", *COMMON]  # fmt: skip
RL = ["rl", "--task", "calculator", "--init", "{init}", "--steps", "3", "--max-tokens", "40", "--copy-steps", "2",
      "--sft-steps", "2", "--sft-batch-size", "4", "--sft-guess-share", "0.5", *SMALL]  # fmt: skip
DISTILL = ["distill", "--teachers", "calculator={a},files:max={b}", "--init", "{init}", "--steps", "3", *SMALL,
           "--max-tokens", "24", "--max-tokens-per-turn", "12"]  # fmt: skip
# (SMALL's --max-tokens-per-turn 16 is overridden by the later 12: argparse keeps the last.)
PARTIAL = ["--partial-rollout-fraction", "0.5", "--max-off-policy-steps", "1"]

RUNS: dict[str, list[str]] = {
    "train": TRAIN,
    **{f"rl-{loss}": [*RL, "--loss", loss] for loss in ("ppo", "cispo", "k15", "reinforce")},
    "rl-ppo-tis": [*RL, "--loss", "ppo", "--correction", "tis"],
    "rl-ppo-kl": [*RL, "--loss", "ppo", "--kl-coef", "0.1"],
    "rl-ppo-no-replay": [*RL, "--loss", "ppo", "--no-routing-replay"],
    **{f"distill-{m}": [*DISTILL, "--method", m] for m in ("opd", "rl", "topk", "offpolicy")},
    # The tiny policy solves no task in a few steps, so every `k3 rl` group's rewards are equal: the RL updates above
    # are zero (loss 0, grad_norm 0; those runs check the warm start, rollouts, the trainer's forward and the
    # checkpoint). OPD's per-token teacher reward is never 0: these runs exercise the same update (RLTrainer.update,
    # policy_loss, corrections, KL, routing replay, partial rollouts) with non-zero advantages.
    **{f"distill-opd-{loss}": [*DISTILL, "--method", "opd", "--loss", loss] for loss in ("cispo", "k15", "reinforce")},
    "distill-opd-tis": [*DISTILL, "--method", "opd", "--correction", "tis"],
    "distill-opd-kl": [*DISTILL, "--method", "opd", "--kl-coef", "0.1"],
    "distill-opd-no-replay": [*DISTILL, "--method", "opd", "--no-routing-replay"],
    "distill-opd-partial": [*DISTILL, "--method", "opd", *PARTIAL],
}


# ---- capture ---------------------------------------------------------------------------------------------------
def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
            "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip


def _save(model, tokenizer, path: str) -> str:
    model.save_pretrained(path)
    tokenizer.save(path)
    return path


def build_policies(root: str) -> dict[str, str]:
    """The init (tiny, seed 0, a BPE trained on a few task words) and two teachers (the init plus seeded noise):
    tests/rl/test_distill.py's `policies` fixture."""
    import torch

    from openk3.config import K3Config
    from openk3.data.tokenizer import train_bpe
    from openk3.model.model import K3ForCausalLM

    config = K3Config.preset("tiny")
    text = config.text_config
    special = {"bos": text.bos_token_id, "eos": text.eos_token_id, "pad": text.pad_token_id}
    tokenizer = train_bpe([WORDS] * 10, text.vocab_size, special)
    model = K3ForCausalLM(config)
    model.init_weights(torch.Generator().manual_seed(0))
    paths = {"init": _save(model, tokenizer, os.path.join(root, "init"))}
    for name, seed in (("a", 1), ("b", 2)):
        other = K3ForCausalLM(config)
        other.load_state_dict(model.state_dict())
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in other.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g) * p.abs().mean().clamp(min=1e-3))
        paths[name] = _save(other, tokenizer, os.path.join(root, name))
    return paths


def tensor_digest(t) -> dict:
    import torch

    t = t.detach().to("cpu").contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
            "sha256": hashlib.sha256(raw).hexdigest(), "sum": float(t.double().sum().item())}  # fmt: skip


def weights_digest(path: str) -> dict:
    """Per tensor of the newest checkpoint of run `path` (dtypes as stored: fp32)."""
    from openk3.train.checkpoint import load_model

    model, folder = load_model(path)
    digest = {k: tensor_digest(v) for k, v in sorted(model.state_dict().items())}
    return {"checkpoint": os.path.relpath(folder, path), "tensors": digest}


def _deterministic(key: str) -> bool:
    return not key.endswith(("_s", "_share")) and not any(part in key for part in _CLOCK)


def _clean(value):
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if _deterministic(k)}
    return value


def read_rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [_clean(json.loads(line)) for line in f if line.strip()]


def capture(name: str, argv: list[str], work: str, paths: dict[str, str]) -> dict:
    out = os.path.join(work, name)
    argv = [a.format(**paths) for a in argv] + ["--out", out]
    cmd = [sys.executable, "-m", "openk3.cli", *argv]
    print(f"[{name}] {' '.join(argv)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"[{name}] exited {proc.returncode}")
    rows = read_rows(os.path.join(out, "metrics.jsonl"))
    result = {"argv": [a.replace(work, "WORK") for a in argv], "wall_s": round(wall, 2), "rows": rows,
              "loss": [[r["step"], r["loss"]] for r in rows if "loss" in r],
              "sft_rows": read_rows(os.path.join(out, "sft.jsonl")), "weights": weights_digest(out)}  # fmt: skip
    print(f"[{name}] {wall:.1f}s, {len(result['loss'])} loss steps, last {result['loss'][-1:]}", flush=True)
    return result


def _origin() -> dict:
    probe = "import openk3, torch; print(openk3.__file__); print(torch.__version__)"
    where, torch_version = subprocess.run([sys.executable, "-c", probe], env=_env(), capture_output=True, text=True,
                                          check=True).stdout.split()  # fmt: skip
    root = os.path.dirname(os.path.dirname(where))
    git = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    git = git.stdout.strip()
    dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=False).stdout.strip()  # fmt: skip
    return {"openk3": where, "commit": git, "dirty": bool(dirty), "torch": torch_version,
            "python": platform.python_version(), "machine": platform.machine()}  # fmt: skip


def run_all(args) -> int:
    names = list(RUNS) if not args.only else args.only.split(",")
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise SystemExit(f"unknown runs {unknown}; known: {', '.join(RUNS)}")
    origin = _origin()
    print(f"openk3 from {origin['openk3']} (commit {origin['commit'][:12]}{', dirty' if origin['dirty'] else ''})")
    work = args.keep or tempfile.mkdtemp(prefix="k3-equivalence-")
    if args.keep and os.path.exists(work) and os.listdir(work):
        raise SystemExit(f"--keep {work} is not empty")
    os.makedirs(work, exist_ok=True)
    import torch

    torch.set_num_threads(1)
    result = {"origin": origin, "runs": {}}
    try:
        paths = {"init": "", "a": "", "b": ""}
        if any(RUNS[n][0] in ("rl", "distill") for n in names):
            paths = build_policies(os.path.join(work, "policies"))
            result["policies"] = {k: {n: d["sha256"] for n, d in weights_digest(p)["tensors"].items()}
                                  for k, p in paths.items()}  # fmt: skip
        for name in names:
            result["runs"][name] = capture(name, RUNS[name], work, paths)
            with open(args.out, "w") as f:  # after every run: a partial capture survives an interruption
                json.dump(result, f, indent=1)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    total = sum(r["wall_s"] for r in result["runs"].values())
    print(f"wrote {args.out}: {len(result['runs'])} runs, {total:.0f}s")
    return 0


# ---- compare ---------------------------------------------------------------------------------------------------
def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(a), abs(b), 1e-300)


def _flat(row, prefix=""):
    """(key, number) leaves of a metrics row."""
    if isinstance(row, dict):
        for k, v in row.items():
            yield from _flat(v, f"{prefix}{k}.")
    elif isinstance(row, list):
        for i, v in enumerate(row):
            yield from _flat(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], row


def _rows_diff(ra: list[dict], rb: list[dict]) -> tuple[list[str], list[str]]:
    """(keys whose values differ, keys present on one side only) over rows matched in order."""
    differ, only = set(), set()
    if len(ra) != len(rb):
        differ.add(f"<row count {len(ra)} vs {len(rb)}>")
    for a, b in zip(ra, rb):
        fa, fb = dict(_flat(a)), dict(_flat(b))
        only |= set(fa) ^ set(fb)
        differ |= {k for k in set(fa) & set(fb) if not _same(fa[k], fb[k])}
    return sorted(differ), sorted(only)


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b and type(a) is type(b)


def compare(path_a: str, path_b: str) -> int:
    with open(path_a) as f:
        A = json.load(f)
    with open(path_b) as f:
        B = json.load(f)
    for label, d in (("A", A), ("B", B)):
        o = d["origin"]
        print(f"{label}: {o['openk3']} @ {o['commit'][:12]}{' (dirty)' if o['dirty'] else ''}, torch {o['torch']}")
    if A.get("policies") != B.get("policies") and "policies" in A and "policies" in B:
        print("!! the init/teacher checkpoints differ: the runs did not start from the same weights")
    same_all = True
    for name in list(dict.fromkeys([*A["runs"], *B["runs"]])):
        if name not in A["runs"] or name not in B["runs"]:
            print(f"{name}: only in {'A' if name in A['runs'] else 'B'}")
            same_all = False
            continue
        a, b = A["runs"][name], B["runs"][name]
        la, lb = a["loss"], b["loss"]
        steps_equal = [s for s, _ in la] == [s for s, _ in lb]
        bitwise = steps_equal and all(_same(x, y) for (_, x), (_, y) in zip(la, lb))
        pairs = [(x, y) for (_, x), (_, y) in zip(la, lb)]
        max_abs = max((abs(x - y) for x, y in pairs), default=0.0)
        max_rel = max((_rel(x, y) for x, y in pairs), default=0.0)
        first = next((s for (s, x), (_, y) in zip(la, lb) if not _same(x, y)), None)
        differ, only = _rows_diff(a["rows"], b["rows"])
        sdiffer, sonly = _rows_diff(a["sft_rows"], b["sft_rows"])
        ta, tb = a["weights"]["tensors"], b["weights"]["tensors"]
        common = sorted(set(ta) & set(tb))
        wdiff = [k for k in common if ta[k]["sha256"] != tb[k]["sha256"]]
        wrel = max((_rel(ta[k]["sum"], tb[k]["sum"]) for k in wdiff), default=0.0)
        worst = max(wdiff, key=lambda k: _rel(ta[k]["sum"], tb[k]["sum"]), default=None)
        missing = sorted(set(ta) ^ set(tb))
        ok = bitwise and not differ and not sdiffer and not wdiff and not missing
        same_all &= ok
        print(f"{name}: {'SAME' if ok else 'DIFFERENT'}  ({a['wall_s']:.0f}s / {b['wall_s']:.0f}s)")
        print(f"  loss: {len(la)} vs {len(lb)} steps, bitwise {'equal' if bitwise else 'NOT equal'}"
              + (f" (first differing step {first})" if first is not None else "")
              + f", max abs diff {max_abs:.3g}, max rel diff {max_rel:.3g}")  # fmt: skip
        if differ or sdiffer:
            print(f"  other metrics differing: {', '.join(differ + ['sft:' + k for k in sdiffer])}")
        if only or sonly:
            print(f"  metrics on one side only: {', '.join(only + ['sft:' + k for k in sonly])}")
        print(f"  weights ({a['weights']['checkpoint']} / {b['weights']['checkpoint']}): {len(wdiff)} of "
              f"{len(common)} tensors differ" + (f", max rel diff of sums {wrel:.3g} ({worst})" if wdiff else "")
              + (f"; {len(missing)} tensors on one side only: {missing[:5]}" if missing else ""))  # fmt: skip
    print("ALL SAME" if same_all else "DIFFERENCES FOUND")
    return 0 if same_all else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="capture: the JSON file written")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="diff two captures")
    p.add_argument("--only", default="", help="comma-separated run names (default: all; see --list)")
    p.add_argument("--keep", default="", help="keep the run folders in this (new or empty) folder")
    p.add_argument("--list", action="store_true", help="print the runs and their command lines")
    args = p.parse_args(argv)
    if args.list:
        for name, cmd in RUNS.items():
            print(f"{name}: k3 {' '.join(cmd)}")
        return 0
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        p.error("--out FILE (capture) or --compare A.json B.json")
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())

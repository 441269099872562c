"""`k3 bench cpu` (or `python benchmarks/cpu.py`): openk3's CPU inference against llama.cpp on the same checkpoint
(the CPU inference targets), both measured in one run, interleaved, and written to runs/bench/cpu.{json,md} (`--out-dir
benchmarks/results`: the committed results).

- the checkpoint: `--ckpt DIR`, or a random `k3 init --preset medium` (418M total, 243M active: 1024 wide, 16 layers,
  16 experts top-4) cached in runs/bench-cpu/medium; its `k3 export --format gguf` files (f32 and bf16) are cached
  in runs/bench-cpu/ and re-exported when the checkpoint is newer;
- per dtype (fp32, bf16), in rounds that alternate the sides (and which side goes first), each side in its own
  process (`run_isolated`: two OpenMP runtimes in one process take each other's cores): prefill tok/s of one
  512-token sequence (one engine step / one llama eval) and batch-1 decode tok/s over 128 single-token steps after a
  32-token prompt; median and spread (min, max) per side. openk3 runs through its serving engine (`LLMEngine`,
  greedy, prefix caching off), llama.cpp through llama-cpp-python with the same thread count;
- this machine: the read and copy bandwidth of a 1 GiB random fp32 buffer (in a process of its own before and after
  the rounds; the larger is used), the matmul rate, and the bandwidth bound
  of a decode token: the weight bytes one token reads (every non-expert matrix and the LM head, the top-k routed
  experts of every MoE layer, one embedding row) over the read bandwidth;
- fidelity: llama.cpp's fp32 logits against openk3's (`logits_rel_rms`; alone: `python benchmarks/cpu.py fidelity
  --ckpt DIR`);
- this CPU: its ISA features, which build of the decode kernels ran (AVX-512, AVX2, portable) and whether
  bf16 products run natively or widened to fp32 (`ops.widen`); dtype `auto` serves the checkpoint as `LLM(dtype=
  "auto")` does (fp32 for a bf16 checkpoint on a CPU without bf16 arithmetic, where it fits), and the report
  compares bf16 and auto with fp32 (prefill and decode medians of the same run, target >= 0.95x there);
- a torch.profiler breakdown of openk3's decode step per dtype (`profile_decode`): ops grouped into categories, the
  top ops, and the Python/dispatch time (wall minus the ops' summed self time).

OMP_WAIT_POLICY: llama.cpp's OpenMP threads (and torch's) spin at barriers and between parallel regions, which on a
busy machine takes cores from everyone. With `--omp-wait-policy auto` (the default) the run uses `passive` when the
1-minute load average exceeds 0.5 before it starts, else the runtimes' defaults; the variable is read when the
OpenMP runtimes load, so the process re-executes itself with it set. A run called in-process (tests) cannot change
it and records that.

Without llama_cpp (or with `--no-llamacpp`) openk3's side runs alone and llama.cpp's columns read "not measured".

Legend: T threads; tok/s tokens per second; a round is one prefill and one decode measurement per side and dtype.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager

import numpy as np
import torch
from report import load_info, machine_info, measure_matmul, targets_table, write_report
from torch.profiler import ProfilerActivity, profile, record_function

from openk3.data.tokenizer import NUM_SPECIAL_TOKENS, load_tokenizer
from openk3.ops import cpu_kernels
from openk3.ops.cpu_features import features
from openk3.serve.config import ServeConfig, serving_dtype
from openk3.serve.engine import LLMEngine
from openk3.serve.request import SamplingParams
from openk3.train.checkpoint import load_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "auto": "auto"}  # auto: serving_dtype("auto", ckpt)
OUTTYPES = {"fp32": "f32", "bf16": "bf16"}
PROMPT_TOKENS = 32  # the decode measurement's prompt
ID_LIMIT = 30000  # random ids stay below it (and below the base vocabulary: no special ids)
CACHE_DIR = os.path.join("runs", "bench-cpu")
REEXEC_MARK = "K3_BENCH_CPU_LOAD_BEFORE"  # set when the run re-executes itself: the load the first process saw
LLAMA_INSTALL = ('pip install -e ".[bench]" (llama-cpp-python>=0.3.36, a build with the kimi-k3 architecture; it '
                 "compiles llama.cpp from source: a C++ compiler and cmake, several minutes)")  # fmt: skip
PROFILE_STEPS = 10  # --quick: 2 (reading the profiler's events back is slow: see `profile_decode`)
WORKER_TIMEOUT_S = 1800  # one side's measurement (model load, warm-up, prefill, decode)
TARGETS = {"decode": 0.8, "prefill": 1.0, "bound": 1.5, "rel_rms": 1e-5, "bf16_over_fp32": 0.95}


# ---- OMP_WAIT_POLICY -----------------------------------------------------------------------------------------
def omp_policy(requested: str, load1: float) -> str | None:
    """The OMP_WAIT_POLICY the run needs: `requested` unless "auto"; auto: "passive" when the 1-minute load average
    exceeds 0.5 (someone else uses the cores: spinning threads would take their time, and theirs ours), else None
    (the runtimes' defaults)."""
    if requested != "auto":
        return requested
    return "passive" if load1 > 0.5 else None


def launched_here(argv: list[str] | None) -> bool:
    """Whether this main() is the process's program (`python benchmarks/cpu.py ...` or `k3 bench cpu ...`), so it
    may re-execute it; a test calling main(argv) in-process may not."""
    return argv is None or (sys.argv[1:3] == ["bench", "cpu"] and sys.argv[3:] == list(argv))


def ensure_omp_policy(requested: str, argv: list[str] | None) -> dict:
    """Re-execute the process with OMP_WAIT_POLICY set when the policy the run needs differs from the environment's
    (the OpenMP runtimes of torch and llama.cpp read it when they load, before this code runs); returns the record."""
    mark = os.environ.pop(REEXEC_MARK, None)
    load1 = float(mark) if mark is not None else os.getloadavg()[0]
    wanted = omp_policy(requested, load1)
    current = os.environ.get("OMP_WAIT_POLICY")
    info = {"requested": requested, "load1_at_decision": load1, "wanted": wanted, "reexecuted": mark is not None,
            "policy": current or "unset (the runtimes' defaults)", "applied": True}  # fmt: skip
    if wanted is None or (current or "").lower() == wanted:
        return info
    if mark is not None or not launched_here(argv):
        info["applied"] = False
        info["note"] = (f"wanted OMP_WAIT_POLICY={wanted} but this process's OpenMP runtimes are already loaded "
                        "(called in-process); the run keeps the environment's setting")  # fmt: skip
        print(f"warning: {info['note']}", flush=True)
        return info
    print(f"re-executing with OMP_WAIT_POLICY={wanted} (load {load1:.2f}, --omp-wait-policy {requested})", flush=True)
    os.environ["OMP_WAIT_POLICY"] = wanted
    os.environ[REEXEC_MARK] = repr(load1)
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    raise AssertionError("os.execv returned")


# ---- checkpoint and GGUF cache ---------------------------------------------------------------------------------
def cached_checkpoint(preset: str) -> str:
    """runs/bench-cpu/PRESET: a random `k3 init --preset PRESET` checkpoint, written once (to a temporary folder
    renamed into place, so an interrupted init is never reused)."""
    from openk3.cli import main as k3

    path = os.path.join(CACHE_DIR, preset)
    if os.path.exists(os.path.join(path, "config.json")):
        print(f"checkpoint: {path} (cached)", flush=True)
        return path
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # an interrupted init's leftovers
    if k3(["init", "--preset", preset, "--out", tmp]) != 0:
        raise RuntimeError(f"k3 init --preset {preset} failed")
    os.replace(tmp, path)
    return path


def cached_gguf(ckpt: str, outtype: str, fp32_model) -> str:
    """The checkpoint's `k3 export --format gguf --outtype OUTTYPE` file in runs/bench-cpu/, exported again when
    missing or older than a file of the checkpoint. `fp32_model()` gives the model to export (the checkpoint in
    fp32: what `k3 export` writes from a stored-fp32 checkpoint, and the same values from a bf16 one)."""
    from openk3.export import export_gguf

    folder = os.path.abspath(ckpt)
    tag = hashlib.sha1(folder.encode()).hexdigest()[:8]
    path = os.path.join(CACHE_DIR, f"{os.path.basename(folder)}-{tag}-{outtype}.gguf")
    newest = max(os.path.getmtime(os.path.join(root, f)) for root, _, files in os.walk(folder) for f in files)
    if os.path.exists(path) and os.path.getmtime(path) >= newest:
        print(f"gguf {outtype}: {path} (cached)", flush=True)
        return path
    os.makedirs(CACHE_DIR, exist_ok=True)
    model = fp32_model()
    t0 = time.perf_counter()
    export_gguf(model, load_tokenizer(ckpt, model.text_config), path, outtype=outtype, name=os.path.basename(folder))
    print(f"gguf {outtype}: exported {ckpt} to {path} in {time.perf_counter() - t0:.1f} s", flush=True)
    return path


def load_as(ckpt: str, dtype: str):
    """The checkpoint's model in `dtype` (a DTYPES name; "auto" as `LLM(dtype="auto")` resolves it here)."""
    torch_dtype = serving_dtype("auto", ckpt)[0] if dtype == "auto" else DTYPES[dtype]
    return load_model(ckpt, dtype=torch_dtype)[0].eval()


def cpu_info(ckpt: str) -> dict:
    """This CPU's features, the decode kernels' build and how bf16 products and dtype auto run here."""
    cpu = features()
    auto, why = serving_dtype("auto", ckpt)
    return {"features": cpu.summary(), "flags": sorted(cpu.flags & {"avx512f", "avx512_bf16", "amx_bf16", "avx2",
            "fma", "f16c", "asimd", "sve", "bf16"}), "kernels": cpu_kernels.info(), "bf16_native": cpu.bf16_native,
            "auto_dtype": str(auto).removeprefix("torch."), "auto_why": why}  # fmt: skip


def random_ids(n: int, seed: int, limit: int) -> list[int]:
    return torch.randint(0, limit, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- the two sides ---------------------------------------------------------------------------------------------
class Openk3Side:
    """openk3's serving engine, one request at a time (prefix caching off: every round recomputes)."""

    name = "openk3"

    def __init__(self, model, prefill_tokens: int, decode_tokens: int):
        # The profile's request runs 2 * PROFILE_STEPS + 4 tokens past its prompt.
        longest = max(prefill_tokens, PROMPT_TOKENS + max(decode_tokens, 2 * PROFILE_STEPS + 4))
        self.engine = LLMEngine(model, None, ServeConfig.from_options(
            max_model_len=longest + 8, max_num_seqs=1, max_num_batched_tokens=max(2048, prefill_tokens),
            enable_prefix_caching=False))  # fmt: skip

    def add(self, ids: list[int], max_tokens: int) -> None:
        self.engine.add_request({"prompt_token_ids": ids},
                                SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))  # fmt: skip

    def _finish(self, outs, n: int) -> None:
        """The request ended after exactly n tokens (a failed step would end it early and time nothing)."""
        out = outs[-1].outputs[0] if outs else None
        if out is None or not outs[-1].finished or len(out.token_ids) != n or out.finish_reason != "length":
            raise RuntimeError(f"openk3's request did not produce its {n} tokens: {out}")

    def prefill(self, ids: list[int]) -> float:
        """Seconds of the one step that prefills `ids` and samples the first token."""
        self.add(ids, 1)
        t0 = time.perf_counter()
        outs = self.engine.step()
        seconds = time.perf_counter() - t0
        self._finish(outs, 1)
        return seconds

    def decode(self, prompt: list[int], feed: list[int]) -> list[float]:
        """Seconds of each of len(feed) single-token steps after the prompt's prefill (the engine feeds back its
        own greedy tokens; `feed` only sets the count)."""
        self.add(prompt, len(feed) + 1)
        outs = self.engine.step()  # the prefill and the first token
        times = []
        for _ in feed:
            t0 = time.perf_counter()
            outs = self.engine.step()
            times.append(time.perf_counter() - t0)
        self._finish(outs, len(feed) + 1)
        return times

    def close(self) -> None:
        pass


class LlamaSide:
    """llama.cpp through llama-cpp-python: `eval` of the ids (the KV cache and KDA state reset first)."""

    name = "llama.cpp"

    def __init__(self, llama_cpp, path: str, threads: int, prefill_tokens: int, decode_tokens: int,
                 use_mmap: bool = True):  # fmt: skip
        batch = max(512, prefill_tokens)
        n_ctx = max(1024, prefill_tokens + 8, PROMPT_TOKENS + decode_tokens + 8)
        self.settings = {"n_ctx": n_ctx, "n_batch": batch, "n_ubatch": batch, "n_threads": threads,
                         "n_threads_batch": threads, "logits_all": False, "use_mmap": use_mmap}  # fmt: skip
        self.llm = llama_cpp.Llama(model_path=path, verbose=False, **self.settings)

    def prefill(self, ids: list[int]) -> float:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(ids)
        return time.perf_counter() - t0

    def decode(self, prompt: list[int], feed: list[int]) -> list[float]:
        self.llm.reset()
        self.llm.eval(prompt)
        times = []
        for token in feed:
            t0 = time.perf_counter()
            self.llm.eval([token])
            times.append(time.perf_counter() - t0)
        return times

    def close(self) -> None:
        self.llm.close()


def import_llama_cpp(disabled: bool):
    """(llama_cpp module or None, why not)."""
    if disabled:
        return None, "not measured (--no-llamacpp)"
    try:
        import llama_cpp
    except ImportError:
        print(f"llama_cpp is not installed: llama.cpp's side is not measured. Install it with {LLAMA_INSTALL}",
              flush=True)  # fmt: skip
        return None, f"not measured (llama_cpp not installed: {LLAMA_INSTALL})"
    version = tuple(int(x) for x in re.findall(r"\d+", llama_cpp.__version__)[:3])
    if version < (0, 3, 36):
        why = (f"not measured (llama-cpp-python {llama_cpp.__version__} predates the kimi-k3 architecture: "
               f"{LLAMA_INSTALL})")  # fmt: skip
        print(why, flush=True)
        return None, why
    return llama_cpp, None


# ---- this machine ----------------------------------------------------------------------------------------------
def measure_bandwidth(gib: float, repeats: int = 5) -> dict:
    """Read (`.sum()`) and copy rates of a `gib` GiB fp32 buffer of random values (written, so its pages are real),
    best and median of `repeats`, in GB/s; copy counts the bytes read plus the bytes written."""
    x = torch.rand(int(gib * 2**30) // 4)
    y = torch.empty_like(x)
    y.copy_(x)  # fault the destination's pages in before timing
    nbytes = x.numel() * 4

    def rates(fn, moved: int) -> list[float]:
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            out.append(moved / (time.perf_counter() - t0) / 1e9)
        return out

    read = rates(x.sum, nbytes)
    copy = rates(functools.partial(y.copy_, x), 2 * nbytes)
    return {"buffer_gib": gib, "repeats": repeats, "read_gbs": max(read), "read_gbs_median": statistics.median(read),
            "copy_gbs": max(copy), "copy_gbs_median": statistics.median(copy)}  # fmt: skip


def active_weight_bytes(model) -> dict[str, int]:
    """The bytes of every weight one decode token reads, by part: each non-expert matrix, norm and bias (at its
    stored dtype), the LM head, the top-k of E routed experts' w1/w2/w3 in every MoE layer (k/E of each stacked
    tensor), and one row of the embedding table (the whole table when tied to the LM head)."""
    text = model.text_config
    mla = set(text.linear_attn_config.full_attn_layers)  # 1-based
    k, E = text.num_experts_per_token, text.num_experts
    embed = model.model.embed_tokens.weight
    tied = model.lm_head.weight is embed
    parts: dict[str, int] = defaultdict(int)
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        if p is embed:
            part, nbytes = ("lm_head (tied embedding)", nbytes) if tied else ("embedding (one row)", nbytes // len(p))
        elif name.startswith("lm_head."):
            part = "lm_head"
        elif layer is None:
            part = "final norm and output AttnRes"
        elif ".shared_experts." in name:
            part = "MoE shared experts"
        elif ".experts." in name:
            part, nbytes = f"MoE routed experts (top-{k} of {E})", nbytes * k // E
        elif ".block_sparse_moe." in name:
            part = "MoE router, latent down/up and norm"
        elif ".mlp." in name:
            part = "dense MLP"
        elif ".self_attn." in name:
            part = "MLA attention" if int(layer.group(1)) + 1 in mla else "KDA attention"
        else:
            part = "layer norms and AttnRes"
        parts[part] += nbytes
    return dict(sorted(parts.items(), key=lambda kv: -kv[1]))


def state_bytes(text) -> int:
    """Not in the bound: the fp32 KDA state every token reads and writes (heads x K x V per KDA layer, twice)."""
    la = text.linear_attn_config
    return 2 * len(la.kda_layers) * la.num_heads * la.head_dim**2 * 4


# ---- the run ---------------------------------------------------------------------------------------------------
def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def measure_side(spec: dict) -> dict:
    """One side's measurement of one round and dtype, in this (fresh) process: build the side, warm it up (one
    prefill, 4 decode steps: first calls allocate, pick kernels and page weights in), then the timed prefill of
    spec["ids"] and the timed decode of spec["feed"] after spec["prompt"]."""
    torch.set_num_threads(spec["threads"])
    if spec["side"] == "machine":  # the memory bandwidth, in a process of its own like the sides
        return measure_bandwidth(spec["gib"])
    if spec["side"] == "openk3":
        model = load_as(spec["ckpt"], spec["dtype"])
        side = Openk3Side(model, len(spec["ids"]), len(spec["feed"]))
    else:
        llama_cpp, why = import_llama_cpp(False)
        if llama_cpp is None:
            raise RuntimeError(why)
        side = LlamaSide(llama_cpp, spec["gguf"], spec["threads"], len(spec["ids"]), len(spec["feed"]),
                         spec["use_mmap"])  # fmt: skip
    side.prefill(spec["warm_ids"])
    side.decode(spec["prompt"], spec["prompt"][:4])
    prefill_s = side.prefill(spec["ids"])
    times = side.decode(spec["prompt"], spec["feed"])
    out = {"prefill_s": prefill_s, "decode_times": times}
    if spec["side"] == "llama.cpp":
        out["settings"] = side.settings
    side.close()
    return out


def run_isolated(spec: dict) -> dict:
    """`measure_side(spec)` in a child process (`cpu.py --worker SPEC`), which inherits OMP_WAIT_POLICY. Each side
    runs alone: with OMP_WAIT_POLICY=active, an OpenMP runtime's idle threads keep spinning for seconds after its
    work (GNU libgomp: GOMP_SPINCOUNT 3e10), so two runtimes in one process (torch's and llama.cpp's) took each
    other's cores: on 2 cores, openk3's fp32 decode read 80.7 ms/token beside llama.cpp in one process and 61.5 ms
    in a run without llama.cpp minutes later."""
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
                          capture_output=True, text=True, timeout=WORKER_TIMEOUT_S, check=False)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"the {spec['side']} {spec['dtype']} measurement failed (exit {proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}{proc.stderr[-3000:]}")  # fmt: skip
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_rounds(specs: dict[str, dict[str, dict]], args, id_limit: int) -> list[dict]:
    """args.rounds rounds; in each, per dtype, both sides (each in its own process: `run_isolated`), the first side
    alternating between rounds. specs[dtype][side] holds what a side needs (checkpoint or GGUF, threads)."""
    rows = []
    warm_ids = random_ids(args.prefill_tokens, 1, id_limit)
    for r in range(args.rounds):
        ids = random_ids(args.prefill_tokens, 100 + r, id_limit)
        prompt, feed = random_ids(PROMPT_TOKENS, 200 + r, id_limit), random_ids(args.decode_tokens, 300 + r, id_limit)
        for dtype, pair in specs.items():
            names = list(pair)
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                m = run_isolated({**pair[name], "side": name, "dtype": dtype, "ids": ids, "prompt": prompt,
                                  "feed": feed, "warm_ids": warm_ids})  # fmt: skip
                times = m["decode_times"]
                c = {"round": r, "dtype": dtype, "side": name, "first": order[0], "prefill_s": m["prefill_s"],
                     "prefill_tok_s": len(ids) / m["prefill_s"], "decode_s": sum(times),
                     "decode_tok_s": len(times) / sum(times), "decode_ms_median": 1e3 * statistics.median(times),
                     "decode_step_ms": [round(1e3 * t, 3) for t in times]}  # fmt: skip
                if "settings" in m:
                    c["settings"] = m["settings"]
                print(f"round {r + 1}/{args.rounds} {dtype} {name:9s}: prefill {c['prefill_tok_s']:8.1f} tok/s "
                      f"({c['prefill_s']:.3f} s), decode {c['decode_tok_s']:7.2f} tok/s "
                      f"({c['decode_ms_median']:.1f} ms/step median)", flush=True)  # fmt: skip
                rows.append(c)
    return rows


def summarize(rows: list[dict], dtypes: list[str], llama_ran: bool, bound: dict) -> dict:
    out = {}
    for dtype in dtypes:
        cell = {}
        for side in ("openk3", "llama.cpp") if llama_ran and dtype in OUTTYPES else ("openk3",):
            mine = [r for r in rows if r["dtype"] == dtype and r["side"] == side]
            cell[side] = {"prefill_tok_s": spread([r["prefill_tok_s"] for r in mine]),
                          "decode_tok_s": spread([r["decode_tok_s"] for r in mine])}  # fmt: skip
            cell[side]["decode_ms_per_token"] = 1e3 / cell[side]["decode_tok_s"]["median"]
            cell[side]["decode_over_bound"] = cell[side]["decode_ms_per_token"] / bound[dtype]["ms_per_token"]
        if "llama.cpp" in cell:
            ours, theirs = cell["openk3"], cell["llama.cpp"]
            cell["decode_ratio"] = ours["decode_tok_s"]["median"] / theirs["decode_tok_s"]["median"]
            cell["prefill_ratio"] = ours["prefill_tok_s"]["median"] / theirs["prefill_tok_s"]["median"]
        out[dtype] = cell
    fp32 = out["fp32"]["openk3"]
    for dtype in dtypes:
        if dtype != "fp32":  # the same run's medians: bf16 (or auto) over fp32
            ours = out[dtype]["openk3"]
            out[dtype]["over_fp32"] = {key: ours[f"{key}_tok_s"]["median"] / fp32[f"{key}_tok_s"]["median"]
                                       for key in ("prefill", "decode")}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["fidelity"]:
        return fidelity_main(args_in[1:])
    if args_in[:1] == ["--worker"]:  # one side's measurement, in its own process (run_isolated)
        print(json.dumps(measure_side(json.loads(args_in[1]))), flush=True)
        return 0
    p = argparse.ArgumentParser(
        prog="k3 bench cpu",
        description=__doc__.split("\n\n")[0],
        epilog="`python benchmarks/cpu.py fidelity --ckpt DIR` runs the llama.cpp fidelity "
        "check alone (`fidelity --help`).",
    )
    p.add_argument("--ckpt", help="checkpoint folder (default: a random --preset checkpoint cached in runs/bench-cpu)")
    p.add_argument("--preset", default="medium", help="preset of the default checkpoint (tiny: a smoke run)")
    p.add_argument("--threads", type=int, default=None, help="threads of both sides (default: every core)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=128, help=f"decode steps after a {PROMPT_TOKENS}-token prompt")
    p.add_argument("--dtypes", default="fp32,bf16,auto", help="comma-separated: fp32, bf16, auto (the checkpoint "
                   "as LLM(dtype='auto') serves it here; openk3's side only)")  # fmt: skip
    p.add_argument("--name", default="cpu", help="the report's file name in --out-dir (NAME.json, NAME.md)")
    p.add_argument("--omp-wait-policy", choices=["auto", "passive", "active"], default="auto",
                   help="OMP_WAIT_POLICY of both sides; auto: passive when the load average before the run is above "
                        "0.5, else the runtimes' defaults (the process re-executes itself to set it)")  # fmt: skip
    p.add_argument("--no-llamacpp", action="store_true", help="openk3's side only (llama.cpp's: not measured)")
    p.add_argument("--llama-no-mmap", action="store_true",
                   help="load llama.cpp's weights into memory instead of mapping the GGUF (its default maps it; on "
                        "this 2-core VM, reading mapped 4 KiB pages made its decode ~20%% slower)")  # fmt: skip
    p.add_argument(
        "--out-dir",
        default=None,
        help="where NAME.json and NAME.md go (default: runs/bench, not committed; --out-dir benchmarks/results "
        "replaces the committed results)",
    )
    p.add_argument("--quick", action="store_true", help="for the smoke test: short machine measurements (a 256 "
                   "MiB buffer, a 0.05 s matmul) and a 2-step profile")  # fmt: skip
    args = p.parse_args(argv)
    dtypes = args.dtypes.split(",")
    if "fp32" not in dtypes:
        raise ValueError("--dtypes: fp32 is needed (the others are compared with it)")
    if unknown := [d for d in dtypes if d not in DTYPES]:
        raise ValueError(f"--dtypes: unknown {unknown}; choose from {list(DTYPES)}")
    for name in ("rounds", "prefill_tokens", "decode_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    omp = ensure_omp_policy(args.omp_wait_policy, argv)
    out_dir = args.out_dir or "runs/bench"
    threads = args.threads or len(os.sched_getaffinity(0))
    # One thread here until the rounds are over: this process's OpenMP threads would spin beside the measurements.
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    result: dict = {"machine": machine_info(), "args": vars(args), "threads": threads, "omp_wait_policy": omp,
                    "loadavg_before": load_before}  # fmt: skip
    print(f"threads {threads}, OMP_WAIT_POLICY {omp['policy']}, load before {load_before}", flush=True)
    llama_cpp, not_measured = import_llama_cpp(args.no_llamacpp)
    result["llamacpp"] = {"measured": llama_cpp is not None, "why_not": not_measured}

    ckpt = args.ckpt or cached_checkpoint(args.preset)
    result["checkpoint"] = ckpt
    result["cpu"] = cpu_info(ckpt)
    kernels = result["cpu"]["kernels"]
    print(f"cpu: {result['cpu']['features']}; decode kernels: "
          f"{kernels['isa'] + ' build' if kernels['isa'] else 'not built: ' + str(kernels['error'])}; bf16 products "
          f"{'native' if result['cpu']['bf16_native'] else 'widened to fp32'}; dtype auto: {result['cpu']['auto_why']}",
          flush=True)  # fmt: skip
    models = {d: load_as(ckpt, d) for d in dtypes}
    text = next(iter(models.values())).text_config
    base = text.vocab_size - NUM_SPECIAL_TOKENS if text.vocab_size > 2 * NUM_SPECIAL_TOKENS else text.vocab_size
    id_limit = min(ID_LIMIT, base)
    total, active = next(iter(models.values())).num_parameters()
    result["model"] = {"total_parameters": total, "active_parameters": active, "hidden_size": text.hidden_size,
                       "layers": text.num_hidden_layers, "experts": text.num_experts,
                       "experts_per_token": text.num_experts_per_token, "vocab_size": text.vocab_size,
                       "id_limit": id_limit}  # fmt: skip

    specs = {d: {"openk3": {"ckpt": ckpt, "threads": threads}} for d in dtypes}
    if llama_cpp is not None:
        fp32_model = lambda: models["fp32"] if "fp32" in models else load_model(ckpt, dtype=torch.float32)[0]
        ggufs = {d: cached_gguf(ckpt, OUTTYPES[d], fp32_model) for d in dtypes if d in OUTTYPES}
        result["gguf"] = ggufs
        for d, gguf in ggufs.items():
            specs[d]["llama.cpp"] = {"gguf": gguf, "threads": threads, "use_mmap": not args.llama_no_mmap}
        result["llamacpp"].update(version=llama_cpp.__version__,
                                  system_info=llama_cpp.llama_print_system_info().decode().strip())  # fmt: skip
    # The bandwidth ceiling: measured in a process of its own just before and just after the rounds; the bound uses
    # the larger (this VM's bandwidth moved between 12.6 and 24 GB/s over a day, and one measurement after the
    # rounds once read lower than the rounds themselves had achieved).
    machine = {"side": "machine", "dtype": "-", "threads": threads, "gib": 0.25 if args.quick else 1.0}
    bandwidths = [run_isolated(machine)]
    result["rounds"] = run_rounds(specs, args, id_limit)
    bandwidths.append(run_isolated(machine))
    if llama_cpp is not None:
        result["llamacpp"]["settings"] = next(r["settings"] for r in result["rounds"] if "settings" in r)

    torch.set_num_threads(threads)  # the measurements of this machine and the profile run here, after the rounds
    result["bandwidth"] = {**max(bandwidths, key=lambda b: b["read_gbs"]),
                           "read_gbs_before_after": [b["read_gbs"] for b in bandwidths],
                           "copy_gbs_before_after": [b["copy_gbs"] for b in bandwidths]}  # fmt: skip
    result["matmul_gflops"] = measure_matmul(args.quick, [DTYPES[d] for d in dtypes if d in OUTTYPES])
    print(
        f"bandwidth: read {result['bandwidth']['read_gbs']:.1f} GB/s, copy {result['bandwidth']['copy_gbs']:.1f} "
        f"GB/s; matmul {', '.join(f'{k} {v:.0f}' for k, v in result['matmul_gflops'].items())} GFLOP/s",
        flush=True,
    )
    bound = {}
    for d, model in models.items():
        parts = active_weight_bytes(model)
        nbytes = sum(parts.values())
        ms = 1e3 * nbytes / (result["bandwidth"]["read_gbs"] * 1e9)
        bound[d] = {
            "bytes": nbytes,
            "parts": parts,
            "ms_per_token": ms,
            "kda_state_bytes_not_counted": state_bytes(text),
        }
        print(f"decode bound {d}: {nbytes / 1e6:.1f} MB of weights per token / {result['bandwidth']['read_gbs']:.1f} "
              f"GB/s = {bound[d]['ms_per_token']:.2f} ms/token", flush=True)  # fmt: skip
        for part, b in parts.items():
            print(f"  {part}: {b / 1e6:.2f} MB", flush=True)
    result["bound"] = bound
    result["summary"] = summarize(result["rounds"], dtypes, llama_cpp is not None, bound)
    warm = random_ids(PROMPT_TOKENS, 0, id_limit)
    sides = {d: Openk3Side(models[d], args.prefill_tokens, args.decode_tokens) for d in dtypes}
    for side in sides.values():
        side.decode(warm, warm[:4])
    result["profile"] = {}
    for d in dtypes:
        result["profile"][d] = prof = profile_decode(sides[d].engine, warm, 2 if args.quick else PROFILE_STEPS)
        print(f"profile {d}: {prof['ms_per_step_unprofiled']:.1f} ms/step; ops "
              + ", ".join(f"{k} {v:.1f}" for k, v in prof["categories_ms_per_step"].items())
              + f" ms; overhead {prof['overhead_ms_per_step']:.1f} ms", flush=True)  # fmt: skip
    if llama_cpp is not None:
        fp32_gguf = result["gguf"].get("fp32") or cached_gguf(ckpt, "f32", lambda: load_model(ckpt, torch.float32)[0])
        del models, sides
        result["fidelity"] = logits_rel_rms(ckpt, fp32_gguf, n_tokens=64, seed=0, n_threads=threads)
        print(f"fidelity: logits relative RMS {result['fidelity']['rel_rms']:.2e}, top-1 agreement "
              f"{result['fidelity']['top1_agree']:.0%}", flush=True)  # fmt: skip
    result["loadavg_after"] = os.getloadavg()
    result["machine"]["load_after"] = load_info()
    result["max_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    result["targets"] = evaluate_targets(result, dtypes, args)
    write_report(result, os.path.join(out_dir, args.name), markdown(result, dtypes, args))
    return 0


# ---- targets and report ----------------------------------------------------------------------------------------
def evaluate_targets(r: dict, dtypes: list[str], args) -> list[dict]:
    why = r["llamacpp"]["why_not"]
    targets = []
    for key, what in (
        ("decode", f"batch 1, {args.decode_tokens} tokens"),
        ("prefill", f"{args.prefill_tokens} tokens"),
    ):
        floor = TARGETS[key]
        for d in [d for d in dtypes if d in OUTTYPES]:
            s = r["summary"][d]
            ours = s["openk3"][f"{key}_tok_s"]["median"]
            if why:
                measured, met = f"openk3 {ours:.1f} tok/s; llama.cpp {why}", None
            else:
                ratio = s[f"{key}_ratio"]
                measured = (f"openk3 {ours:.1f} vs llama.cpp {s['llama.cpp'][f'{key}_tok_s']['median']:.1f} tok/s: "
                            f"{ratio:.2f}x")  # fmt: skip
                met = ratio >= floor
            targets.append({"target": f"{key} tok/s openk3 >= {floor}x llama.cpp ({d}, {what})", "measured": measured,
                            "met": met})  # fmt: skip
    for d in dtypes:
        s, b = r["summary"][d]["openk3"], r["bound"][d]
        targets.append({"target": f"openk3 decode time per token <= {TARGETS['bound']}x the bandwidth bound ({d})",
                        "measured": f"{s['decode_ms_per_token']:.1f} ms vs {b['ms_per_token']:.1f} ms "
                                    f"({b['bytes'] / 1e6:.0f} MB at {r['bandwidth']['read_gbs']:.1f} GB/s): "
                                    f"{s['decode_over_bound']:.2f}x",
                        "met": s["decode_over_bound"] <= TARGETS["bound"]})  # fmt: skip
    native = r["cpu"]["bf16_native"]
    for d in [d for d in dtypes if d != "fp32"]:
        for key in ("prefill", "decode"):
            ratio = r["summary"][d]["over_fp32"][key]
            floor = TARGETS["bf16_over_fp32"]
            measured = (f"{r['summary'][d]['openk3'][f'{key}_tok_s']['median']:.1f} vs fp32 "
                        f"{r['summary']['fp32']['openk3'][f'{key}_tok_s']['median']:.1f} tok/s: {ratio:.2f}x")  # fmt: skip
            targets.append({"target": f"openk3 {d} {key} >= {floor}x fp32 on a CPU without bf16 arithmetic",
                            "measured": measured + (" (this CPU has bf16 arithmetic: not judged)" if native else ""),
                            "met": None if native else ratio >= floor})  # fmt: skip
    f = r.get("fidelity")
    targets.append({"target": f"logits relative RMS llama.cpp vs openk3 <= {TARGETS['rel_rms']:g} (fp32, f32 KV cache, "
                              "flash attention off)",
                    "measured": f"{f['rel_rms']:.2e} (top-1 agreement {f['top1_agree']:.0%}, {f['n_tokens']} tokens)"
                                if f else why,
                    "met": f["rel_rms"] <= TARGETS["rel_rms"] if f else None})  # fmt: skip
    return targets


def cpu_line(c: dict) -> str:
    k = c["kernels"]
    build = (f"the **{k['isa']}** build ({'OpenMP' if k['build']['openmp'] else 'no OpenMP'}; this CPU runs "
             f"{', '.join(k['runnable'])})" if k["isa"] else f"not built ({k['error']}): the torch path")  # fmt: skip
    products = "natively" if c["bf16_native"] else "in fp32 from the bf16 operands, rounded once (ops.widen)"
    return (f"CPU: {c['features']}. Decode kernels: {build}. bf16 products: {products}. dtype auto: "
            f"{c['auto_dtype']} ({c['auto_why']}).  ")  # fmt: skip


def markdown(r: dict, dtypes: list[str], args) -> str:
    m, omp, bw, model = r["machine"], r["omp_wait_policy"], r["bandwidth"], r["model"]
    llama = r["llamacpp"]
    if llama["measured"]:
        call = ", ".join(f"{k}={v}" for k, v in llama["settings"].items())
        llama_line = f"llama-cpp-python {llama['version']}, `Llama({call})`"
    else:
        llama_line = llama["why_not"]
    reexec = ", set by re-executing the process" if omp["reexecuted"] else ""
    lines = [
        "# CPU inference: openk3 vs llama.cpp (`k3 bench cpu`)", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, {r['threads']} thread(s) on both sides.  ",
        (f"Load average before / after: {' '.join(f'{x:.2f}' for x in r['loadavg_before'])} / "
        f"{' '.join(f'{x:.2f}' for x in r['loadavg_after'])} (`{m['load_before']}` / `{m['load_after']}`).  "),
        (f"OMP_WAIT_POLICY: **{omp['policy']}** (`--omp-wait-policy {omp['requested']}`, 1-minute load "
        f"{omp['load1_at_decision']:.2f} at the decision{reexec}"
        f"{'; ' + omp['note'] if not omp['applied'] else ''}). With auto, the run uses passive when the load average "
        "before it exceeds 0.5: llama.cpp's (and torch's) OpenMP threads spin at barriers, which on a shared machine "
        "steals time from the other side and from other users.  "),
        (f"Checkpoint: `{r['checkpoint']}`: {model['total_parameters'] / 1e6:.1f}M parameters "
        f"({model['active_parameters'] / 1e6:.1f}M active), {model['hidden_size']} wide, {model['layers']} layers, "
        f"{model['experts']} experts top-{model['experts_per_token']}; random ids below {model['id_limit']}.  "),
        f"llama.cpp: {llama_line}.  ",
        cpu_line(r["cpu"]),
        (f"Memory: read {bw['read_gbs']:.1f} GB/s (median {bw['read_gbs_median']:.1f}; before / after the rounds "
         f"{' / '.join(f'{v:.1f}' for v in bw['read_gbs_before_after'])}, the larger used), "
         f"copy {bw['copy_gbs']:.1f} GB/s "
        f"read+write (median {bw['copy_gbs_median']:.1f}), {bw['buffer_gib']:g} GiB random fp32 buffer, best of "
        f"{bw['repeats']}; matmul {', '.join(f'{k} {v:.0f}' for k, v in r['matmul_gflops'].items())} GFLOP/s."), "",
    ]  # fmt: skip
    lines += targets_table(r["targets"], "CPU inference against llama.cpp, and each CPU kind", na="not measured")
    lines += ["", f"## Throughput ({args.rounds} interleaved rounds; median [min, max])", "",
              (f"Prefill: one sequence of {args.prefill_tokens} tokens (one engine step / one llama eval). Decode: "
               f"batch 1, {args.decode_tokens} single-token steps after a {PROMPT_TOKENS}-token prompt; tok/s = "
               "steps / their summed time. openk3 runs through its serving engine (greedy sampling included)."), "",
              "| dtype | side | prefill tok/s | decode tok/s | decode ms/token | / bandwidth bound |",
              "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for d in dtypes:
        s = r["summary"][d]
        for side in ("openk3", "llama.cpp") if d in OUTTYPES else ("openk3",):
            if side not in s:
                lines.append(f"| {d} | {side} | not measured | not measured | | |")
                continue
            c, pf, dc = s[side], s[side]["prefill_tok_s"], s[side]["decode_tok_s"]
            lines.append(f"| {d} | {side} | {pf['median']:.1f} [{pf['min']:.1f}, {pf['max']:.1f}] | {dc['median']:.2f} "
                         f"[{dc['min']:.2f}, {dc['max']:.2f}] | {c['decode_ms_per_token']:.1f} | "
                         f"{c['decode_over_bound']:.2f}x |")  # fmt: skip
        if "decode_ratio" in s:
            lines.append(f"| {d} | openk3 / llama.cpp | {s['prefill_ratio']:.2f}x | {s['decode_ratio']:.2f}x | | |")
        if "over_fp32" in s:
            o = s["over_fp32"]
            lines.append(f"| {d} | openk3 {d} / fp32 | {o['prefill']:.2f}x | {o['decode']:.2f}x | | |")
    lines += ["", "## Bandwidth bound of a decode token", "",
              ("Bytes of every weight one token reads (non-expert matrices, norms and the LM head at their stored "
               f"dtype; the top-{model['experts_per_token']} of {model['experts']} routed experts of every MoE layer; "
               f"one embedding row) / the read bandwidth ({bw['read_gbs']:.1f} GB/s). Not counted: the fp32 KDA state "
               f"each token reads and writes ({r['bound'][dtypes[0]]['kda_state_bytes_not_counted'] / 1e6:.1f} MB) "
               "and the MLA latents. llama.cpp's bf16 GGUF keeps the same small tensors in f32."), "",
              "| part | " + " | ".join(f"{d} MB" for d in dtypes) + " |", "|---|" + "---:|" * len(dtypes)]  # fmt: skip
    for part in r["bound"][dtypes[0]]["parts"]:
        lines.append(
            f"| {part} | " + " | ".join(f"{r['bound'][d]['parts'].get(part, 0) / 1e6:.2f}" for d in dtypes) + " |"
        )
    lines.append("| **total** | " + " | ".join(f"**{r['bound'][d]['bytes'] / 1e6:.1f}**" for d in dtypes) + " |")
    lines.append("| bound, ms/token | " + " | ".join(f"{r['bound'][d]['ms_per_token']:.2f}" for d in dtypes) + " |")
    f = r.get("fidelity")
    if f:
        lines += ["", "## Fidelity (fp32)", "",
                  (f"llama.cpp (f32 KV cache, flash attention off) vs openk3 on {f['n_tokens']} random ids (seed "
                  f"{f['seed']}), one sequence: relative RMS {f['rel_rms']:.2e}, max abs {f['max_abs']:.2e}, top-1 "
                  f"agreement {f['top1_agree']:.0%}.")]  # fmt: skip
    kernels = r["profile"][dtypes[0]]["annotated_kernels"]
    lines += ["", f"## openk3 decode profile (torch.profiler, {r['profile'][dtypes[0]]['steps']} steps per dtype)", "",
              ("Self CPU time of the ops on the calling thread, per step, by category; matmul includes any custom op "
               "named *gemv* or *expert*; fused layers are the kernels that run a whole KDA layer, a "
               "MoE layer (router included), a gated MLA layer (two calls around the cache append), an AttnRes "
               "mix with its norm, or a decode step's whole decoder stack, all of those in one call "
               "(`decode_stack`; their matmuls included). The ctypes kernels, "
               "which the profiler does not see, are each called inside a "
               f"`record_function` while profiling: {', '.join(f'`{k}`' for k in kernels) or 'none called'}. Overhead "
               "= the profiled wall time minus the ops' summed self time (Python, engine bookkeeping, dispatch, and "
               "the profiler's own cost)."), "",
              "| dtype | ms/step unprofiled | ms/step profiled | " + " | ".join(CATEGORIES) + " | overhead |",
              "|---|---:|---:|" + "---:|" * (len(CATEGORIES) + 1)]  # fmt: skip
    for d in dtypes:
        p = r["profile"][d]
        lines.append(f"| {d} | {p['ms_per_step_unprofiled']:.2f} | {p['ms_per_step_profiled']:.2f} | "
                     + " | ".join(f"{p['categories_ms_per_step'][c]:.2f}" for c in CATEGORIES)
                     + f" | {p['overhead_ms_per_step']:.2f} |")  # fmt: skip
    for d in dtypes:
        p = r["profile"][d]
        lines += ["", f"Top ops by self time ({d}):", "", "| op | category | calls/step | self ms/step |",
                  "|---|---|---:|---:|",
                  *[f"| `{o['op']}` | {o['category']} | {o['calls_per_step']:.1f} | {o['self_ms_per_step']:.3f} |"
                    for o in p["top_ops"]]]  # fmt: skip
    lines += ["", "## Rounds", "",
              ("Each measurement ran in its own process (the side, dtype and round alone on the machine), after an "
               "untimed warm-up there (one prefill of the same length, 4 decode steps). "
               "`first`: the side measured first in that round (it alternates)."), "",
              ("| round | dtype | side | first | prefill s | prefill tok/s | decode s | decode tok/s | "
               "decode ms/step (median) |"), "|---:|---|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for c in r["rounds"]:
        lines.append(f"| {c['round'] + 1} | {c['dtype']} | {c['side']} | {c['first']} | {c['prefill_s']:.3f} | "
                     f"{c['prefill_tok_s']:.1f} | {c['decode_s']:.2f} | {c['decode_tok_s']:.2f} | "
                     f"{c['decode_ms_median']:.1f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


# ---- the decode profile ----------------------------------------------------------------------------------------------
# Where a decode step of openk3's serving engine spends its time: torch.profiler over a few batch-1 decode steps,
# the ops' self CPU time grouped into categories (matmul, elementwise, indexing/copies, reductions/norms, other), the
# top ops, and the time outside any op (Python, the engine's bookkeeping, dispatch). `main` calls
# `profile_decode` per dtype.
#
# Self times are those of the ops on the calling thread: an op's intra-op worker threads count toward the op that
# started them. Kernels called through ctypes (`openk3.ops.cpu_kernels`) are no torch ops, so the profiler would count
# them as overhead: while profiling, each C function is called inside a `record_function` named `cpu_kernels::NAME`
# (the names contain "gemv" or "expert": matmul), and the result lists the ones called. Reading
# the profiler's events back costs ~70 us per event (~1500 events per tiny-model step), so keep `steps` small.

CATEGORIES = ("matmul", "fused layers", "elementwise", "indexing/copies", "reductions/norms", "other")
# The kernels that run a whole layer part in one call (its matmuls included): a KDA layer, a MoE layer, a gated MLA
# layer (two calls), an AttnRes mix with its norm, and the decoder stack of a step (all of them, one call).
FUSED_LAYER_KERNELS = ("kda_decode", "moe_decode", "mla_decode", "mix_norm", "decode_stack")
MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "linear", "mv", "addmv", "matmul", "_addmm_activation"}
ELEMENTWISE_OPS = {"add", "sub", "rsub", "mul", "div", "neg", "exp", "log", "log1p", "expm1", "sigmoid", "silu",
                   "gelu", "relu", "tanh", "rsqrt", "sqrt", "pow", "clamp", "clamp_min", "clamp_max", "where",
                   "softplus", "abs", "sign", "maximum", "minimum", "eq", "ne", "lt", "gt", "ge", "le", "logical_and",
                   "logical_or", "logical_not", "reciprocal", "sin", "cos", "addcmul", "addcdiv", "lerp", "square",
                   "isfinite", "isnan", "bitwise_and", "bitwise_or", "floor", "ceil", "round", "fmod", "remainder",
                   "nan_to_num", "masked_fill", "erf"}  # fmt: skip
# Data movement, views and allocation: copies and dtype casts, gathers and scatters, concatenation, views, creation.
COPY_OPS = {"copy", "_to_copy", "to", "clone", "contiguous", "index", "index_select", "gather", "scatter",
            "scatter_add",
            "index_put", "_index_put_impl", "index_add", "index_copy", "index_fill", "cat", "stack", "slice", "select",
            "narrow", "view", "view_as", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "expand",
            "expand_as", "permute", "transpose", "t", "unsqueeze", "squeeze", "flatten", "unflatten", "movedim",
            "split", "split_with_sizes", "chunk", "unbind", "repeat", "repeat_interleave", "empty", "empty_like",
            "empty_strided", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like", "fill", "zero",
            "new_empty", "new_zeros", "new_full", "masked_select", "masked_scatter", "nonzero", "item",
            "_local_scalar_dense", "resize", "detach", "lift_fresh", "lift_fresh_copy", "alias", "unfold", "roll",
            "flip", "pad", "constant_pad_nd", "arange", "scalar_tensor", "diagonal", "tril", "triu", "one_hot",
            "bincount", "searchsorted", "embedding"}  # fmt: skip
REDUCTION_OPS = {"sum", "mean", "norm", "linalg_vector_norm", "rms_norm", "_fused_rms_norm", "layer_norm",
                 "native_layer_norm", "softmax", "_softmax", "log_softmax", "_log_softmax", "max", "min", "amax",
                 "amin", "argmax", "argmin", "topk", "sort", "argsort", "cumsum", "var", "std", "var_mean",
                 "logsumexp", "prod", "all", "any", "count_nonzero", "multinomial"}  # fmt: skip


def op_category(name: str) -> str:
    """The category of a profiler op name (`aten::index_copy_` -> indexing/copies); a custom op whose name contains
    "gemv" or "expert" is a matmul, one of `FUSED_LAYER_KERNELS` a fused layer."""
    base = name.split("::", 1)[-1].rstrip("_")
    if any(k in name for k in FUSED_LAYER_KERNELS):
        return "fused layers"
    if "gemv" in name or "expert" in name or base in MATMUL_OPS:
        return "matmul"
    for category, ops in (("elementwise", ELEMENTWISE_OPS), ("indexing/copies", COPY_OPS),
                          ("reductions/norms", REDUCTION_OPS)):  # fmt: skip
        if base in ops:
            return category
    return "other"


class _AnnotatedLibrary:
    """The kernel library with each C function called inside a `record_function` of its name."""

    def __init__(self, lib, names: list[str]):
        self._lib, self._names = lib, names

    def __getattr__(self, attr: str):
        fn = getattr(self._lib, attr)
        name = f"cpu_kernels::{attr.removeprefix('openk3_')}"
        if name not in self._names:
            self._names.append(name)

        def call(*args, _fn=fn, _name=name):
            with record_function(_name):
                return _fn(*args)

        return call


@contextmanager
def annotated_kernels():
    """Route the ctypes kernels (`ops.cpu_kernels`' library) through `record_function`s of their names for the
    duration; yields the list of names called (filled as they are; empty without the library)."""
    names: list[str] = []
    lib = cpu_kernels.library()
    if lib is None:
        yield names
        return
    previous = cpu_kernels._lib
    cpu_kernels._lib = _AnnotatedLibrary(lib, names)
    try:
        yield names
    finally:
        cpu_kernels._lib = previous


def profile_decode(engine, prompt: list[int], steps: int, top: int = 15) -> dict:
    """One request of `prompt` in `engine` (an idle LLMEngine whose max_model_len holds len(prompt) + 2 * steps + 4
    tokens): its prefill and two warm steps, `steps` decode steps timed plain, `steps` more under torch.profiler
    (the ctypes kernels annotated), then the rest untimed. Per step: the wall time both ways, each category's ops'
    self time, the overhead (the profiled wall time minus the ops' summed self time: Python, the engine's
    bookkeeping, dispatch, and the profiler's own cost), the `top` ops by self time and the names that fell into
    "other"."""
    engine.add_request({"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=2 * steps + 4, temperature=0.0, ignore_eos=True))  # fmt: skip
    for _ in range(3):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    plain = time.perf_counter() - t0
    with annotated_kernels() as kernels, profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - t0
    if not engine.has_unfinished():
        raise RuntimeError("the profiled request ended early: the profile timed idle steps")
    while engine.has_unfinished():
        engine.step()
    ops = [e for e in prof.key_averages() if not e.is_user_annotation or e.key in kernels]
    by_category = dict.fromkeys(CATEGORIES, 0.0)
    for e in ops:
        by_category[op_category(e.key)] += e.self_cpu_time_total / 1e3 / steps
    ops_ms = sum(by_category.values())
    wall_ms = 1e3 * wall / steps
    return {
        "steps": steps, "annotated_kernels": kernels, "ms_per_step_unprofiled": 1e3 * plain / steps,
        "ms_per_step_profiled": wall_ms, "ops_ms_per_step": ops_ms, "overhead_ms_per_step": wall_ms - ops_ms,
        "categories_ms_per_step": by_category,
        "other_ops": sorted({e.key for e in ops if op_category(e.key) == "other"}),
        "top_ops": [{"op": e.key, "category": op_category(e.key), "calls_per_step": e.count / steps,
                     "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps}
                    for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:top]],
    }  # fmt: skip


# ---- llama.cpp fidelity of the GGUF export ---------------------------------------------------------------------------
# llama.cpp fidelity of the GGUF export: a checkpoint's logits from llama.cpp (through llama-cpp-python) running its
# `k3 export --format gguf` file, against openk3's own fp32 forward, as the relative RMS error
# rms(llama - ours) / rms(ours).
#
#     python benchmarks/cpu.py fidelity --ckpt DIR [--gguf FILE] [--tokens 64] [--seed 0]
#
# `logits_rel_rms` is the piece `main` calls after the rounds. The token ids are random below the base
# vocabulary (no special ids), one sequence, all in one llama.cpp batch; llama.cpp runs on the CPU with fp32 K/V caches
# and without flash attention, so the comparison sees the export and the graph, not cache rounding. llama_cpp is
# imported lazily: everything else in openk3 works without it.

GGML_TYPE_F32 = 0


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as err:
        raise RuntimeError(
            "the llama.cpp comparison needs llama-cpp-python (a build with the kimi-k3 architecture, 0.3.36 or "
            "newer): pip install llama-cpp-python"
        ) from err
    return llama_cpp


def llama_cpp_logits(gguf_path: str, ids: list[int], n_threads: int = 2, verbose: bool = False) -> torch.Tensor:
    """llama.cpp's logits [T, V] (fp32) for the token ids `ids`, evaluated as one sequence in one batch."""
    llama_cpp = _llama_cpp()
    n_ctx = max(256, len(ids))
    llm = llama_cpp.Llama(model_path=os.fspath(gguf_path), logits_all=True, n_ctx=n_ctx, n_batch=n_ctx,
                          n_ubatch=n_ctx, n_threads=n_threads, n_threads_batch=n_threads, flash_attn=False,
                          type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, verbose=verbose)  # fmt: skip
    try:
        llm.eval(ids)
        return torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))
    finally:
        llm.close()


def logits_rel_rms(ckpt_dir: str, gguf_path: str | None = None, n_tokens: int = 64, seed: int = 0,
                   n_threads: int = 2, verbose: bool = False) -> dict:  # fmt: skip
    """Compare llama.cpp on `gguf_path` (None: export `ckpt_dir` to a temporary f32 GGUF first) with openk3's fp32
    forward of `ckpt_dir` on `n_tokens` random ids. Returns {"rel_rms": rms(llama - ours) / rms(ours), "max_abs",
    "top1_agree" (fraction of positions with the same argmax), "n_tokens", "seed", "gguf"}."""
    from openk3.data.tokenizer import NUM_SPECIAL_TOKENS, load_tokenizer
    from openk3.export import export_gguf
    from openk3.train.checkpoint import load_model
    from openk3.utils import rel_rms

    _llama_cpp()  # fail before the export if llama.cpp is missing
    model, ckpt = load_model(ckpt_dir, dtype=torch.float32)
    model.eval()
    vocab = model.text_config.vocab_size
    base = vocab - NUM_SPECIAL_TOKENS if vocab > 2 * NUM_SPECIAL_TOKENS else vocab
    ids = torch.randint(0, base, (n_tokens,), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ours = model(ids[None]).logits[0].float()
    with tempfile.TemporaryDirectory() as tmp:
        path = gguf_path or export_gguf(model, load_tokenizer(ckpt, model.text_config), os.path.join(tmp, "k3.gguf"))
        theirs = llama_cpp_logits(path, ids.tolist(), n_threads, verbose)
    return {
        "rel_rms": rel_rms(theirs, ours),
        "max_abs": float((theirs - ours).abs().max()),
        "top1_agree": float((theirs.argmax(-1) == ours.argmax(-1)).float().mean()),
        "n_tokens": n_tokens,
        "seed": seed,
        "gguf": gguf_path,
    }


def fidelity_main(argv: list[str]) -> int:
    """`python benchmarks/cpu.py fidelity`: the fidelity check alone, printed as JSON (nothing written)."""
    p = argparse.ArgumentParser(
        prog="python benchmarks/cpu.py fidelity",
        description="llama.cpp's logits of a checkpoint's GGUF export against openk3's fp32 forward",
    )
    p.add_argument("--ckpt", required=True, help="a checkpoint folder (k3 init / k3 train / a release)")
    p.add_argument("--gguf", default=None, help="its GGUF export (default: export to a temporary f32 file)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--verbose", action="store_true", help="llama.cpp's own log")
    args = p.parse_args(argv)
    result = logits_rel_rms(args.ckpt, args.gguf, args.tokens, args.seed, args.threads, args.verbose)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

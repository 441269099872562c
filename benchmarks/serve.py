"""`k3 bench serve` (or `python benchmarks/serve.py`): the inference engine's targets on this machine,
measured side by side in one run.

Sections, each against its own baseline in the same run:
- cache arithmetic: bytes per token and per request read from the engine's allocated pools against `k3 plan`'s
  formulas, for the benchmarked model and for the full K3 layer schedule (93 layers, 24 MLA), and the hybrid's
  latent bytes per token as a fraction of an all-MLA model of the same depth;
- decode time per token at a short and a long context, for the hybrid model and for the same model with every
  layer MLA (both random-weight, same widths), for each of `--decode-presets`. The target is judged on the last
  one (`small` by default): tiny's 17 MB of fp32 weights make its 16K-token latent cache the larger memory stream
  per token, a proportion far from K3's (104B active parameters against 27 KiB of latents per token), while small
  (104M active) is closer; tiny is reported beside it;
- time to first token of a 4K-token prompt cold, and after an earlier request sent exactly its first 3.5K tokens
  (so a prompt-end state checkpoint sits there);
- speculative decoding (prompt-lookup n-grams) against plain decoding on repetitive and non-repetitive text, with
  the acceptance rate; a trained checkpoint (`--ckpt`) makes "repetitive" meaningful, since a random model never
  repeats; without one the section reports the random model and says so;
- throughput at 1, 4 and 16 concurrent requests;
plus this machine's matmul rate (the ceiling every number lives under) and its load before and after.

Legend: ctx context tokens, TTFT time to first token, tok/s output tokens per second.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch
from report import load_info, machine_info, measure_matmul, out_help, scratch_out, targets_table, write_report

from openk3.config import K3Config
from openk3.data.tokenizer import load_tokenizer
from openk3.model.model import K3ForCausalLM
from openk3.serve.config import ServeConfig
from openk3.serve.engine import LLMEngine
from openk3.serve.kv.block_pool import HybridPools
from openk3.serve.plan import cache_plan
from openk3.serve.request import SamplingParams

try:
    import httpx2  # the hardening audit's HTTP client (the dev extra); the speed sections do not need it
except ImportError:
    httpx2 = None


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["hardening"]:
        return hardening_main(argv[1:])
    p = argparse.ArgumentParser(
        prog="k3 bench serve",
        description=__doc__.split("\n\n")[0],
        epilog="`python benchmarks/serve.py hardening` runs the hardening audit of `k3 serve` "
        "instead (`hardening --help`).",
    )
    p.add_argument("--quick", action="store_true", help="short contexts, few tokens (seconds; for tests)")
    p.add_argument("--ckpt", help="a trained checkpoint for the speculative-decoding section (default: random tiny)")
    p.add_argument("--preset", default="tiny", help="preset of the random-weight model (decode, TTFT, throughput)")
    p.add_argument("--contexts", default=None, help="decode contexts, comma-separated (default 512,16384)")
    p.add_argument("--decode-presets", default=None, help="presets of the decode section (default tiny,small)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out", default=None, help=out_help("serve-cpu") + " (--quick: runs/bench/serve-quick.json)")
    args = p.parse_args(argv)
    args.out = args.out or scratch_out("serve-quick" if args.quick else "serve-cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("openk3.serve").setLevel(logging.WARNING)  # one cache line per engine would drown the table
    contexts = [int(c) for c in (args.contexts or ("128,1024" if args.quick else "512,16384")).split(",")]

    result: dict = {
        "machine": machine_info(),
        "args": vars(args),
        "matmul_gflops": measure_matmul(args.quick, [torch.float32]),
    }
    print(f"matmul rate: {result['matmul_gflops']['fp32']:.0f} GFLOP/s (fp32)")
    model = random_model(K3Config.preset(args.preset))
    result["cache"] = cache_section(model)
    presets = (args.decode_presets or ("tiny" if args.quick else "tiny,small")).split(",")
    result["decode"] = {
        name: decode_section(model if name == args.preset else random_model(K3Config.preset(name)), contexts,
                             steps=8 if args.quick else 64, label=name)
        for name in presets
    }  # fmt: skip
    result["ttft"] = ttft_section(model, quick=args.quick)
    result["speculative"] = speculative_section(args.ckpt, model, quick=args.quick)
    result["throughput"] = throughput_section(model, [1, 4] if args.quick else [1, 4, 16], quick=args.quick)
    result["targets"] = evaluate_targets(result)
    result["machine"]["load_after"] = load_info()
    write_report(result, args.out, markdown(result))
    return 0


def random_model(config: K3Config) -> K3ForCausalLM:
    model = K3ForCausalLM(config)
    model.init_random_weights(0)
    return model.eval()


def all_mla(config: K3Config) -> K3Config:
    """The same model with every layer MLA: the all-attention comparison of the targets."""
    config = copy.deepcopy(config)
    la = config.text_config.linear_attn_config
    la.full_attn_layers, la.kda_layers = list(range(1, config.text_config.num_hidden_layers + 1)), []
    return config


def engine_for(model, **options) -> LLMEngine:
    return LLMEngine(model, None, ServeConfig.from_options(**options))


def prompt_ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, min(vocab, 700), (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- sections ------------------------------------------------------------------------------------------------
def cache_section(model) -> dict:
    """Bytes from the allocated pool tensors next to `k3 plan`'s formulas."""
    out = {}
    for name, text in (("model", model.text_config), ("k3-layout", K3Config.preset("k3").text_config)):
        act = model.lm_head.weight.element_size() if name == "model" else 2
        dtype = {2: torch.bfloat16, 4: torch.float32}[act]
        measured = {}
        for variant, cfg in (("hybrid", text), ("all_mla", all_mla(K3Config(text_config=text)).text_config)):
            pools = HybridPools(cfg, num_blocks=1, block_size=1, num_slots=1, dtype=dtype, device="cpu")
            measured[variant] = {"mla_bytes_per_token": pools.mla_bytes_per_token(), "slot_bytes": pools.slot_bytes()}
            del pools
        plan = cache_plan(text, act_bytes=act)
        out[name] = {
            "measured_bytes_per_token": measured["hybrid"]["mla_bytes_per_token"],
            "plan_bytes_per_token": plan.mla_bytes_per_token,
            "measured_request_bytes": measured["hybrid"]["slot_bytes"],
            "plan_request_bytes": plan.fixed_bytes_per_request,
            "all_mla_bytes_per_token": measured["all_mla"]["mla_bytes_per_token"],
            "ratio_to_all_mla": measured["hybrid"]["mla_bytes_per_token"] / measured["all_mla"]["mla_bytes_per_token"],
            "mla_layers": plan.num_mla_layers,
            "layers": text.num_hidden_layers,
        }
        print(f"cache {name}: {out[name]['measured_bytes_per_token']} B/token (plan {plan.mla_bytes_per_token}), "
              f"{out[name]['measured_request_bytes']} B/request (plan {plan.fixed_bytes_per_request}), "
              f"{out[name]['ratio_to_all_mla']:.4f} of all-MLA")  # fmt: skip
    return out


@torch.inference_mode()
def prefilled_engine(model, context: int, steps: int) -> tuple[LLMEngine, float]:
    """An engine holding one request with `context` prefilled tokens and `steps` decode steps to go."""
    vocab = model.text_config.vocab_size
    engine = engine_for(model, max_model_len=context + steps + 8, max_num_batched_tokens=2048, max_num_seqs=1,
                        enable_prefix_caching=False)  # fmt: skip
    engine.add_request({"prompt_token_ids": prompt_ids(context, 1, vocab)},
                       SamplingParams(max_tokens=steps + 1, ignore_eos=True))  # fmt: skip
    t0 = time.perf_counter()
    while not engine.scheduler.running or len(engine.scheduler.running[0].output_token_ids) == 0:
        engine.step()
    return engine, time.perf_counter() - t0


@torch.inference_mode()
def decode_section(model, contexts: list[int], steps: int, label: str = "") -> dict:
    """Decode steps at each context, interleaved in rounds so that slow phases of a shared machine hit every
    context alike; median and min over all steps."""
    out = {}
    for name, m in (("hybrid", model), ("all_mla", random_model(all_mla(model.config)))):
        engines = [prefilled_engine(m, ctx, steps) for ctx in contexts]
        times: list[list[float]] = [[] for _ in contexts]
        rounds = 4
        for _ in range(rounds):
            for j, (engine, _) in enumerate(engines):
                for _ in range(steps // rounds):
                    t = time.perf_counter()
                    engine.step()
                    times[j].append(time.perf_counter() - t)
        out[name] = []
        for ctx, (_, prefill_s), ts in zip(contexts, engines, times):
            cell = {"context": ctx, "prefill_s": prefill_s, "ms_per_token": 1e3 * statistics.median(ts),
                    "ms_per_token_min": 1e3 * min(ts)}  # fmt: skip
            out[name].append(cell)
            print(f"decode {label} {name} ctx={ctx}: {cell['ms_per_token']:.2f} ms/token (prefill {prefill_s:.1f} s)")
        out[name + "_growth"] = out[name][-1]["ms_per_token"] / out[name][0]["ms_per_token"]
    return out


@torch.inference_mode()
def time_to_first_token(engine, prompt: list[int]) -> float:
    engine.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, ignore_eos=True))
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t


def ttft_section(model, quick: bool) -> dict:
    n, shared = (1024, 896) if quick else (4096, 3584)
    unit = 128 if quick else 512
    vocab = model.text_config.vocab_size
    prompt = prompt_ids(n, 2, vocab)
    options = {"hash_unit": unit, "block_size": 2 * unit, "max_num_batched_tokens": 2048, "max_model_len": n + 64}
    cold_s = min(time_to_first_token(engine_for(model, **options), prompt) for _ in range(2))
    warm_times, hits = [], []
    for _ in range(2):
        engine = engine_for(model, **options)
        time_to_first_token(engine, prompt[:shared])  # a unit-aligned prompt: a checkpoint sits at its end
        warm_times.append(time_to_first_token(engine, prompt))
        hits.append(engine.manager.stats.state_hit_tokens)
    out = {"prompt": n, "shared": shared, "cold_s": cold_s, "warm_s": min(warm_times), "hit_tokens": hits[-1],
           "ratio": min(warm_times) / cold_s}  # fmt: skip
    print(f"TTFT {n} tokens: cold {cold_s * 1e3:.0f} ms, after a {shared}-token request {out['warm_s'] * 1e3:.0f} ms "
          f"(hit {out['hit_tokens']} tokens): {out['ratio']:.2f}x")  # fmt: skip
    return out


def _spec_run(model, prompts, params, spec) -> dict:
    engine = engine_for(model, max_num_seqs=1, max_num_batched_tokens=2048, speculative_config=spec)
    tokens, t = 0, time.perf_counter()
    for p in prompts:
        engine.add_request({"prompt_token_ids": p}, params)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    tokens += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - t
    stats = engine.spec_stats
    return {"tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed,
            "acceptance_rate": stats.acceptance_rate if spec else None, "drafted": stats.drafted}  # fmt: skip


@torch.inference_mode()
def speculative_section(ckpt: str | None, fallback, quick: bool) -> dict:
    if ckpt:
        from openk3.train.checkpoint import load_model

        model, ckpt = load_model(ckpt)  # a training run (its latest checkpoint), a checkpoint or a release folder
        model.eval()
        tok = load_tokenizer(ckpt, model.text_config)
        # Repeated phrases: a 200-step tiny model continues these, while it does not yet copy whole passages.
        repetitive = [tok.encode(t) for t in ("x, " * 30, "'rc', " * 20, "the " * 30)]
        prose = (
            "The engine schedules requests with a token budget, mixing chunked prefill and decode steps, "
            "and keeps the recurrent state of each running request in a slot."
        )
        varied = [tok.encode(prose), tok.encode("A short note on caches and states:")]
        source = f"trained checkpoint {ckpt}"
    else:
        model = fallback
        vocab = model.text_config.vocab_size
        repetitive = [prompt_ids(16, 5, vocab) * 6]
        varied = [prompt_ids(96, 6, vocab)]
        source = "random-weight model (it never repeats, so acceptance is ~0: pass --ckpt for a meaningful number)"
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    n = 24 if quick else 128
    out = {"source": source, "num_speculative_tokens": spec["num_speculative_tokens"],
           "prompts": {"repetitive": len(repetitive), "non_repetitive": len(varied)}}  # fmt: skip
    # Repetitive text decoded greedily (trained models keep repeating); varied text sampled at temperature 1.
    for name, prompts, params in (
        ("repetitive", repetitive, SamplingParams(max_tokens=n, ignore_eos=True)),
        ("non_repetitive", varied, SamplingParams(max_tokens=n, temperature=1.0, seed=0, ignore_eos=True)),
    ):
        # Alternate the two engines and keep each one's best run: the machine is shared and noisy.
        runs = {"plain": [], "ngram": []}
        for _ in range(1 if quick else 5):
            runs["plain"].append(_spec_run(model, prompts, params, None))
            runs["ngram"].append(_spec_run(model, prompts, params, spec))
        plain, specd = (min(runs[k], key=lambda r: r["seconds"]) for k in ("plain", "ngram"))
        out[name] = {"plain": plain, "ngram": specd, "speedup": specd["tok_s"] / plain["tok_s"]}
        print(f"speculative {name}: plain {plain['tok_s']:.1f} tok/s, ngram {specd['tok_s']:.1f} tok/s "
              f"({out[name]['speedup']:.2f}x, acceptance {specd['acceptance_rate']:.0%})")  # fmt: skip
    return out


@torch.inference_mode()
def throughput_section(model, concurrency: list[int], quick: bool) -> dict:
    vocab = model.text_config.vocab_size
    prompt_len, n = (64, 16) if quick else (256, 64)
    out = {}
    for c in concurrency:
        engine = engine_for(model, max_num_seqs=c, max_num_batched_tokens=2048, hash_unit=128, block_size=256)
        for i in range(c):
            engine.add_request({"prompt_token_ids": prompt_ids(prompt_len, 100 + i, vocab)},
                               SamplingParams(max_tokens=n, ignore_eos=True))  # fmt: skip
        t, tokens, produced = time.perf_counter(), 0, {}
        decode_start = decode_tokens_before = None  # when every request has its first token: decode only from there
        while engine.has_unfinished():
            for o in engine.step():
                produced[o.request_id] = len(o.outputs[0].token_ids)
                if o.finished:
                    tokens += len(o.outputs[0].token_ids)
            if decode_start is None and len(produced) == c:
                decode_start, decode_tokens_before = time.perf_counter(), sum(produced.values())
        now = time.perf_counter()
        elapsed = now - t
        decode_s = now - decode_start
        decode_tok_s = (tokens - decode_tokens_before) / decode_s if decode_s > 0 else float("nan")
        out[str(c)] = {"requests": c, "output_tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed,
                       "decode_tok_s": decode_tok_s, "decode_seconds": decode_s}  # fmt: skip
        print(
            f"throughput at {c} concurrent: {tokens / elapsed:.1f} output tok/s end to end, "
            f"{decode_tok_s:.1f} decode-only ({elapsed:.1f} s)"
        )
    return out


# ---- targets and report --------------------------------------------------------------------------------------
def evaluate_targets(r: dict) -> list[dict]:
    judged = list(r["decode"])[-1]
    d, c, s = r["decode"][judged], r["cache"], r["speculative"]
    others = ", ".join(f"{k}: hybrid {v['hybrid_growth']:.2f}x, all-MLA {v['all_mla_growth']:.2f}x"
                       for k, v in r["decode"].items() if k != judged)  # fmt: skip
    ctx = [cell["context"] for cell in d["hybrid"]]
    k3 = c["k3-layout"]
    trained = not s["source"].startswith("random")
    return [
        {"target": f"decode ms/token at {ctx[-1]} <= 1.5x at {ctx[0]} (all-MLA for comparison)",
         "measured": f"{judged}: hybrid {d['hybrid_growth']:.2f}x, all-MLA {d['all_mla_growth']:.2f}x"
                     + (f" ({others})" if others else ""),
         "met": d["hybrid_growth"] <= 1.5},
        {"target": "measured cache bytes per token = k3 plan arithmetic (24/93 of all-MLA for the K3 layout)",
         "measured": f"K3 layout {k3['measured_bytes_per_token']} B/token vs plan {k3['plan_bytes_per_token']}, "
                     f"ratio {k3['ratio_to_all_mla']:.4f} (24/93 = {24 / 93:.4f}); model "
                     f"{c['model']['measured_bytes_per_token']} vs {c['model']['plan_bytes_per_token']}",
         "met": all(v["measured_bytes_per_token"] == v["plan_bytes_per_token"]
                    and v["measured_request_bytes"] == v["plan_request_bytes"] for v in c.values())
                and abs(k3["ratio_to_all_mla"] - 24 / 93) < 1e-12},
        {"target": f"TTFT of a {r['ttft']['prompt']}-token prompt after its first {r['ttft']['shared']} were sent "
                   "<= 0.25x cold",
         "measured": f"{r['ttft']['ratio']:.3f}x ({r['ttft']['warm_s'] * 1e3:.0f} ms vs {r['ttft']['cold_s'] * 1e3:.0f} ms)",
         "met": r["ttft"]["ratio"] <= 0.25},
        {"target": "speculative decoding >= 1.5x tok/s on repetitive text (acceptance reported)",
         "measured": f"{s['repetitive']['speedup']:.2f}x, acceptance "
                     f"{s['repetitive']['ngram']['acceptance_rate']:.0%} ({s['source']})",
         "met": s["repetitive"]["speedup"] >= 1.5 if trained else None},
        {"target": "speculative decoding >= 1.0x tok/s on non-repetitive text",
         "measured": f"{s['non_repetitive']['speedup']:.2f}x, acceptance "
                     f"{s['non_repetitive']['ngram']['acceptance_rate']:.0%}",
         "met": s["non_repetitive"]["speedup"] >= 1.0 if trained else None},
        {"target": "throughput at 1, 4 and 16 concurrent requests reported",
         "measured": ", ".join(f"{k}: {v['tok_s']:.1f} tok/s" for k, v in r["throughput"].items()),
         "met": True},
    ]  # fmt: skip


def markdown(r: dict) -> str:
    m = r["machine"]
    lines = [
        "# Serving benchmark (`k3 bench serve`)", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['threads']} thread(s).  ",
        f"Load before / after: `{m['load_before']}` / `{m.get('load_after', '')}`.  ",
        f"Matmul rate (this run): {r['matmul_gflops']['fp32']:.0f} GFLOP/s fp32.", "",
    ]  # fmt: skip
    lines += targets_table(r["targets"], "the inference engine")
    lines += ["", "## Decode (random weights; contexts interleaved in rounds)", "",
              "| preset | layers | context | prefill s | ms/token (median) | ms/token (min) |",
              "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for preset, section in r["decode"].items():
        for name in ("hybrid", "all_mla"):
            for cell in section[name]:
                lines.append(f"| {preset} | {name} | {cell['context']} | {cell['prefill_s']:.2f} | "
                             f"{cell['ms_per_token']:.2f} | {cell['ms_per_token_min']:.2f} |")  # fmt: skip
    lines += ["", "## Speculative decoding (n-gram prompt lookup, 4 drafts)", "", f"Model: {r['speculative']['source']}.",
              "", "| text | plain tok/s | ngram tok/s | speedup | acceptance |", "|---|---:|---:|---:|---:|"]  # fmt: skip
    for name in ("repetitive", "non_repetitive"):
        cell = r["speculative"][name]
        lines.append(f"| {name} | {cell['plain']['tok_s']:.1f} | {cell['ngram']['tok_s']:.1f} | {cell['speedup']:.2f}x | "
                     f"{cell['ngram']['acceptance_rate']:.0%} |")  # fmt: skip
    lines += ["", "## Throughput", "", ("Decode-only counts the tokens after every request has its first one, over the time "
              "after that point."), "", "| concurrent requests | output tok/s (end to end) | decode-only tok/s | seconds |",
              "|---:|---:|---:|---:|"]  # fmt: skip
    for k, v in r["throughput"].items():
        lines.append(f"| {k} | {v['tok_s']:.1f} | {v.get('decode_tok_s', float('nan')):.1f} | {v['seconds']:.1f} |")
    return "\n".join(lines) + "\n"


# ---- the hardening audit ---------------------------------------------------------------------------------------------
# The hardening audit of `k3 serve`, re-measured: a real server process on 127.0.0.1 with a random tiny checkpoint,
# tried as a hostile but fair user would.
#
#     python benchmarks/serve.py hardening [--fuzz 2400] [--out benchmarks/results/serve-hardening]
#
# Rounds (every loop is bounded in count and time; traffic goes to 127.0.0.1 only; the server is our own child
# process, stopped by its PID):
#   fuzz         N random bodies (hypothesis-free: a seeded generator of OpenAI-ish fields with hostile values)
#                -> counts by status code, how many 5xx were not JSON, whether the engine is alive afterwards
#   sampling     the reproducers of item 1 (temperature / top_p 1e-300, 5e-324, 1e-39), both endpoints, streamed or not
#   concurrency  64 concurrent greedy streams -> how many equal their solo run
#   disconnects  320 streams dropped after 4 events, and 20 non-streamed requests dropped after 0.3 s -> aborts seen,
#                slots/pages held at the end, server RSS before and after
#   overload     100 simultaneous requests against --max-waiting 8 -> counts by status code
#   body         a 20 MB chat body -> status and seconds, and the worst /health latency meanwhile
#   template     the template attacks of item 4 against a second server whose checkpoint ships them (one at a time)
#   sigterm      seconds from SIGTERM (with a stream running) to exit, and how the stream ended
#
# Writes OUT.json and OUT.md (default runs/bench/serve-hardening; `--out benchmarks/results/serve-hardening` replaces
# the committed results). Needs httpx2 (the dev extra).

HOSTILE_NUMBERS = [0, 1, -1, 2, 7, 1e-300, 5e-324, 1e-39, 1e308, 2**63, 2**64, 0.5, True, False, None]
HOSTILE_TEXT = ["hi", "", "\ud800", "a\udfffb", "<|eos|>", "{{ 7*7 }}", "x" * 5000, "\x00", "🙂"]
FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop", "stream",
          "logprobs", "top_logprobs", "stream_options", "logit_bias", "tools", "tool_choice", "response_format",
          "echo", "user"]  # fmt: skip


def _value(rng: random.Random, depth: int = 0):
    kind = rng.random()
    if kind < 0.4 or depth > 1:
        return rng.choice(HOSTILE_NUMBERS)
    if kind < 0.7:
        return rng.choice(HOSTILE_TEXT)
    if kind < 0.85:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    keys = ["role", "content", "type", "text", "include_usage"]
    return {rng.choice(keys): _value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _fuzz_body(rng: random.Random, chat: bool) -> bytes:
    body = {f: _value(rng) for f in rng.sample(FIELDS, rng.randint(0, 6))}
    if chat:
        body.setdefault("messages", [{"role": "user", "content": rng.choice(HOSTILE_TEXT)}])
    else:
        body.setdefault("prompt", rng.choice(HOSTILE_TEXT))
    body["max_tokens"] = body["max_tokens"] if body.get("max_tokens") in (1, 2) else 2
    raw = json.dumps(body).encode("utf-8", "surrogatepass")
    if rng.random() < 0.05:
        raw = raw[: rng.randint(0, len(raw))]  # truncated JSON
    return raw


class Server:
    """`k3 serve` as a child process on a free loopback port."""

    def __init__(self, ckpt: str, *flags: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "openk3.cli", "serve", "--ckpt", ckpt, "--port",
                                      str(self.port), *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env=env)  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx2.get(f"{self.base}/health", timeout=1).status_code == 200:
                    return
            except httpx2.TransportError:
                time.sleep(0.2)
        raise RuntimeError("k3 serve did not start")

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _count(codes) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in codes:
        out[str(c)] = out.get(str(c), 0) + 1
    return dict(sorted(out.items()))


def fuzz(srv: Server, n: int) -> dict:
    rng, codes, not_json = random.Random(0), [], 0
    with httpx2.Client(base_url=srv.base, timeout=60) as http:
        for i in range(n):
            chat = rng.random() < 0.5
            r = http.post("/v1/chat/completions" if chat else "/v1/completions", content=_fuzz_body(rng, chat),
                          headers={"content-type": "application/json"})  # fmt: skip
            codes.append(r.status_code)
            if r.status_code >= 400:
                try:
                    assert "error" in r.json()
                except Exception:  # noqa: BLE001
                    not_json += 1
        alive = http.get("/health").status_code == 200
    return {"bodies": n, "status_codes": _count(codes), "errors_not_json": not_json, "alive_after": alive}


def sampling(srv: Server) -> dict:
    results = []
    with httpx2.Client(base_url=srv.base, timeout=60) as http:
        for settings in ({"temperature": 1e-300}, {"top_p": 1e-300}, {"top_p": 5e-324}, {"temperature": 1e-39}):
            for path, body in (("/v1/completions", {"prompt": "hi"}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):  # fmt: skip
                for stream in (False, True):
                    r = http.post(path, json={**body, **settings, "max_tokens": 4, "stream": stream})
                    results.append(r.status_code)
        alive = http.get("/health").json()
    return {"requests": len(results), "status_codes": _count(results), "health_after": alive}


def concurrency(srv: Server, n: int = 64) -> dict:
    prompts = [f"Question {i}: why are caches hard?" for i in range(n)]
    body = lambda p, stream: {"messages": [{"role": "user", "content": p}], "max_tokens": 16, "temperature": 0,
                              "stream": stream}  # fmt: skip
    with httpx2.Client(base_url=srv.base, timeout=120) as http:
        solo = [http.post("/v1/chat/completions", json=body(p, False)).json()["choices"][0]["message"]["content"]
                for p in prompts]  # fmt: skip

    async def run():
        async with httpx2.AsyncClient(base_url=srv.base, timeout=300,
                                      limits=httpx2.Limits(max_connections=n)) as client:  # fmt: skip

            async def one(p):
                text = ""
                async with client.stream("POST", "/v1/chat/completions", json=body(p, True)) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {"):
                            for c in json.loads(line[6:]).get("choices", []):
                                text += c["delta"].get("content") or ""
                return text

            return await asyncio.gather(*(one(p) for p in prompts))

    start = time.perf_counter()
    streamed = asyncio.run(run())
    return {"streams": n, "identical_to_solo": sum(a == b for a, b in zip(streamed, solo)),
            "seconds": round(time.perf_counter() - start, 2)}  # fmt: skip


def disconnects(srv: Server, rounds: int = 320) -> dict:
    def metric(name: str) -> float:
        text = httpx2.get(f"{srv.base}/metrics", timeout=10).text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))

    rss_before, aborts_before = srv.rss_mb(), metric('openk3_requests_total{outcome="abort"}')
    for r in range(rounds):
        body = {"messages": [{"role": "user", "content": f"tell me everything {r}"}], "max_tokens": 300,
                "temperature": 0, "stream": True}  # fmt: skip
        with httpx2.Client(timeout=30) as http, http.stream("POST", f"{srv.base}/v1/chat/completions", json=body) as s:
            lines = s.iter_lines()
            for _ in range(4):
                next(lines)
    dropped = 20
    for r in range(dropped):
        try:
            httpx2.post(f"{srv.base}/v1/completions", json={"prompt": f"long {r}", "max_tokens": 300}, timeout=0.3)
        except httpx2.TimeoutException:
            pass
    time.sleep(1.0)
    return {"streams_dropped": rounds, "non_streamed_dropped": dropped,
            "aborts_seen": metric('openk3_requests_total{outcome="abort"}') - aborts_before,
            "running_at_end": metric("openk3_num_requests_running"), "slots_used_at_end": metric("openk3_cache_slots_used"),
            "rss_mb_before": round(rss_before), "rss_mb_after": round(srv.rss_mb())}  # fmt: skip


def overload(srv: Server) -> dict:
    async def run():
        async with httpx2.AsyncClient(base_url=srv.base, timeout=300,
                                      limits=httpx2.Limits(max_connections=100)) as client:  # fmt: skip
            return await asyncio.gather(*(client.post("/v1/completions", json={"prompt": f"q{i}", "max_tokens": 8})
                                          for i in range(100)))  # fmt: skip

    return {"simultaneous": 100, "max_waiting": 8, "status_codes": _count(r.status_code for r in asyncio.run(run()))}


def big_body(srv: Server) -> dict:
    raw = json.dumps({"messages": [{"role": "user", "content": "x" * (20 * 2**20)}]}).encode()
    result, worst = {}, 0.0

    def post():
        start = time.perf_counter()
        r = httpx2.post(f"{srv.base}/v1/chat/completions", content=raw, timeout=300,
                        headers={"content-type": "application/json"})  # fmt: skip
        result.update(status=r.status_code, seconds=round(time.perf_counter() - start, 2))

    t = threading.Thread(target=post)
    t.start()
    while t.is_alive():
        start = time.perf_counter()
        httpx2.get(f"{srv.base}/health", timeout=120)
        worst = max(worst, time.perf_counter() - start)
        time.sleep(0.05)
    return {**result, "worst_health_s": round(worst, 3)}


TEMPLATES = {
    "nested loop": "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    "range(10**9)": "{% for i in range(10**9) %}x{% endfor %}",
    "raise_exception": "{{ raise_exception('roles must alternate') }}",
    "sandbox violation": "{{ messages.__class__.__mro__ }}",
    "10 GB string": "{{ 'x' * 10**10 }}",
}


def templates(ckpt_root: str, make_ckpt) -> list[dict]:
    rows = []
    for name, source in TEMPLATES.items():
        ckpt = make_ckpt(os.path.join(ckpt_root, name.replace(" ", "_").replace("*", "")))
        with open(os.path.join(ckpt, "chat_template.jinja"), "w") as f:
            f.write(source)
        srv = Server(ckpt, "--template-timeout", "2")
        try:
            start = time.perf_counter()
            r = httpx2.post(f"{srv.base}/v1/chat/completions", timeout=60,
                            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})  # fmt: skip
            seconds = time.perf_counter() - start
            other = httpx2.post(f"{srv.base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
            rows.append({"template": name, "status": r.status_code, "json": "error" in r.json(),
                         "seconds": round(seconds, 2), "next_request": other.status_code,
                         "message": r.json()["error"]["message"][:90]})  # fmt: skip
        finally:
            srv.stop()
    return rows


def sigterm(ckpt: str) -> dict:
    srv = Server(ckpt, "--shutdown-timeout", "2", "--max-model-len", "4096")
    try:
        body = {"prompt": [5] * 8, "max_tokens": 4000, "stream": True, "temperature": 0}
        with httpx2.Client(timeout=60) as http, http.stream("POST", f"{srv.base}/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            next(lines)
            start = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        code = srv.proc.wait(timeout=30)
        return {"seconds_to_exit": round(time.monotonic() - start, 2), "exit_status": code,
                "stream_ended_with": rest[-2:]}  # fmt: skip
    finally:
        srv.stop()


def hardening_main(argv: list[str]) -> int:
    """`python benchmarks/serve.py hardening`: the audit above."""
    ap = argparse.ArgumentParser(prog="python benchmarks/serve.py hardening",
                                 description="the hardening audit of `k3 serve`: a real server process on 127.0.0.1 "
                                 "tried as a hostile but fair user would (rounds: fuzz, sampling, concurrency, "
                                 "disconnects, overload, body, template, sigterm)")  # fmt: skip
    ap.add_argument("--fuzz", type=int, default=2400, help="random request bodies of the fuzz round")
    ap.add_argument("--out", default=None, help=out_help("serve-hardening"))
    args = ap.parse_args(argv)
    if httpx2 is None:
        raise SystemExit("the hardening audit needs httpx2: pip install -e '.[dev]'")
    with tempfile.TemporaryDirectory(prefix="k3-hardening-") as root:  # the checkpoints, removed at the end
        results = hardening_measure(root, args.fuzz)
    write_report(results, args.out or scratch_out("serve-hardening"), hardening_markdown(results))
    return 0


def hardening_measure(root: str, n_fuzz: int) -> dict:
    from openk3 import K3Config, K3ForCausalLM

    def make_ckpt(path: str) -> str:
        model = K3ForCausalLM(K3Config.preset("tiny"))
        model.init_random_weights(0)
        model.save_pretrained(path)
        return path

    ckpt = make_ckpt(os.path.join(root, "tiny"))
    results: dict = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                     "python": platform.python_version()}  # fmt: skip
    srv = Server(ckpt, "--max-model-len", "384")
    try:
        for name, fn in (("fuzz", lambda: fuzz(srv, n_fuzz)), ("sampling", lambda: sampling(srv)),
                         ("concurrency", lambda: concurrency(srv)), ("disconnects", lambda: disconnects(srv)),
                         ("body", lambda: big_body(srv))):  # fmt: skip
            start = time.perf_counter()
            results[name] = fn()
            print(f"{name}: {results[name]} ({time.perf_counter() - start:.0f} s)", flush=True)
    finally:
        srv.stop()
    srv = Server(ckpt, "--max-waiting", "8", "--max-num-seqs", "2")
    try:
        results["overload"] = overload(srv)
        print("overload:", results["overload"], flush=True)
    finally:
        srv.stop()
    results["template"] = templates(root, make_ckpt)
    print("template:", results["template"], flush=True)
    results["sigterm"] = sigterm(ckpt)
    print("sigterm:", results["sigterm"], flush=True)
    return results


def hardening_markdown(r: dict) -> str:
    lines = ["# `k3 serve` hardening audit, re-measured", "",
             (f"`python benchmarks/serve.py hardening` on {r['machine']}, Python {r['python']}; a random tiny "
             "checkpoint served by a `k3 serve` child process on 127.0.0.1."), "",
             "| round | what was sent | result |", "|---|---|---|"]  # fmt: skip
    fz = r["fuzz"]
    lines.append(
        f"| fuzz | {fz['bodies']} random bodies | status codes {fz['status_codes']}; 5xx/4xx not JSON: "
        f"{fz['errors_not_json']}; engine alive after: {fz['alive_after']} |"
    )
    sm = r["sampling"]
    lines.append(
        f"| sampling | temperature/top_p 1e-300, 5e-324, 1e-39 on both endpoints, streamed and not "
        f"({sm['requests']}) | status codes {sm['status_codes']}; /health after: {sm['health_after']} |"
    )
    cc = r["concurrency"]
    lines.append(
        f"| concurrency | {cc['streams']} concurrent greedy streams | {cc['identical_to_solo']}/"
        f"{cc['streams']} identical to their solo run, {cc['seconds']} s |"
    )
    dc = r["disconnects"]
    lines.append(
        f"| disconnects | {dc['streams_dropped']} streams dropped after 4 events, {dc['non_streamed_dropped']}"
        f" non-streamed dropped after 0.3 s | aborts seen {dc['aborts_seen']:.0f}; running at end "
        f"{dc['running_at_end']:.0f}; slots used at end {dc['slots_used_at_end']:.0f}; RSS "
        f"{dc['rss_mb_before']} -> {dc['rss_mb_after']} MB |"
    )
    ov = r["overload"]
    lines.append(
        f"| overload | {ov['simultaneous']} simultaneous, --max-waiting {ov['max_waiting']} | status codes "
        f"{ov['status_codes']} |"
    )
    bd = r["body"]
    lines.append(
        f"| body | a 20 MB chat body | {bd['status']} in {bd['seconds']} s; worst /health meanwhile "
        f"{bd['worst_health_s']} s |"
    )
    for t in r["template"]:
        lines.append(
            f"| template | {t['template']} (--template-timeout 2) | {t['status']} JSON={t['json']} in "
            f'{t["seconds"]} s; next request {t["next_request"]}; "{t["message"]}" |'
        )
    sg = r["sigterm"]
    lines.append(
        f"| sigterm | SIGTERM with a stream running (--shutdown-timeout 2) | exited in "
        f"{sg['seconds_to_exit']} s (status {sg['exit_status']}); the stream ended with "
        f"`{' / '.join(sg['stream_ended_with'])}` |"
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())

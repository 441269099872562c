"""The `k3` command line: maps plain flags onto the library.

k3 init --preset tiny --out DIR [--seed N]           random checkpoint with non-trivial values in every tensor
k3 generate --ckpt DIR --prompt TEXT [...]           continuation (the checkpoint's tokenizer, else bytes)
k3 info (--ckpt DIR | --preset NAME)                 layer schedule and parameter counts
k3 demo [--out DIR]                                  the README's main job: init tiny -> save -> reload -> generate
k3 train --preset tiny --out DIR [...]               train (README's main job), resumable with --resume
k3 plot RUN_DIR [RUN_DIR ...]                        PNG plots of a run (training or RL); several: compared
k3 rl --task calculator,files --out DIR [...]        agentic RL in sandboxes (SFT warm start, GRPO, routing replay)
k3 export --ckpt DIR --out DIR                       a training checkpoint or run in the release format (bf16 + fp32)
k3 export --ckpt DIR --format gguf --out FILE        ... or as a llama.cpp kimi-k3 GGUF (--outtype f32|bf16)
k3 tokenizer train --out DIR [--data PATH]           a byte-level BPE for a preset's vocabulary
k3 serve --ckpt DIR [--host H] [--port P]             OpenAI-compatible server (/v1/completions, /v1/chat/...)
k3 chat --ckpt DIR [--no-thinking]                   interactive terminal chat with streaming
k3 plan (--ckpt DIR | --preset NAME) [...]           hybrid-cache bytes per token and request vs all-MLA
k3 bench NAME [...]                                  the checkout's benchmarks/NAME.py, run as a script (`--help`)
k3 sandbox serve [--socket PATH] [...]               a sandbox fleet behind a Unix socket (owns the sandboxes)
k3 sandbox (create|exec|snapshot|restore|fork|ls|rm) [...]   talk to it; `k3 sandbox bench` measures the backend
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import time

import torch

from openk3.config import TEXT_PRESETS, K3Config
from openk3.data.jinja_sandbox import DEFAULT_TIMEOUT_S
from openk3.data.tokenizer import load_tokenizer
from openk3.model.model import K3ForCausalLM
from openk3.rl.config import RLConfig
from openk3.rl.distill_config import CONFIG_FILE as DISTILL_CONFIG_FILE
from openk3.rl.distill_config import DistillConfig
from openk3.serve.config import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES_PER_REQUEST,
    DEFAULT_PREPROCESS_TIMEOUT_S,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    DTYPE_CHOICES,
)
from openk3.train.flags import add_train_arguments, config_from_args
from openk3.utils import set_threads, to_dtype

DTYPE_HELP = ("as vLLM: auto (the config's dtype, float32 served as bfloat16), bfloat16, float32/float, "
              "float16/half; default: as stored")  # fmt: skip


def _fmt(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def cmd_init(args) -> int:
    config = K3Config.preset(args.preset)
    if args.preset == "k3":
        print("refusing to materialise the 2.78T-parameter k3 preset; use `k3 info --preset k3`", file=sys.stderr)
        return 2
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    model.to_empty(device="cpu")
    model.init_random_weights(args.seed)
    if args.dtype:
        model.to_dtype(to_dtype(args.dtype))
    model.save_pretrained(args.out, max_shard_size=args.max_shard_size)
    total, active = model.num_parameters()
    print(f"wrote {args.preset} checkpoint to {args.out}: {_fmt(total)} parameters ({_fmt(active)} active)")
    return 0


def _speculative_config(args) -> dict | None:
    """vLLM's `speculative_config` from the --speculative flags (None: off)."""
    if not args.speculative:
        return None
    spec = {"method": args.speculative, "num_speculative_tokens": args.num_speculative_tokens}
    if args.speculative == "draft_model":
        spec["model"] = args.draft_ckpt
    return spec


def _generate(model: K3ForCausalLM, prompt: str, args, ckpt: str | None = None) -> str:
    """Continue `prompt` with the serving engine, streaming the text to stdout as it is produced."""
    from openk3.serve.config import ServeConfig
    from openk3.serve.engine import LLMEngine
    from openk3.serve.request import SamplingParams

    tok = load_tokenizer(ckpt, model.text_config)  # the checkpoint's tokenizer, else the byte-level fallback
    spec = _speculative_config(args)
    engine = LLMEngine(model, tok, ServeConfig.from_options(speculative_config=spec))
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)  # fmt: skip
    engine.add_request(prompt, params, request_id="cli")
    start, shown, text, n = time.perf_counter(), 0, "", 0
    print(prompt, end="", flush=True)
    while engine.has_unfinished():
        for out in engine.step():
            text = out.outputs[0].text
            print(text[shown:], end="", flush=True)
            shown = len(text)
            n = len(out.outputs[0].token_ids)
    print()
    elapsed = time.perf_counter() - start
    extra = ""
    if spec:
        extra = f", speculative acceptance {engine.spec_stats.acceptance_rate:.0%}"
    print(f"[{n} tokens in {elapsed:.2f}s, {n / max(elapsed, 1e-9):.1f} tok/s{extra}]", file=sys.stderr)
    return text


def _serve_dtype(args) -> torch.dtype | None:
    """`--dtype` of generate/serve/chat as vLLM reads it ("auto": the checkpoint's config dtype, fp32 as bf16; on a
    CPU without bf16 arithmetic a bf16 one computes in fp32 where it fits, `serving_dtype`); says what "auto" chose."""
    from openk3.serve.config import serving_dtype
    from openk3.train.checkpoint import resolve_checkpoint

    dtype, why = serving_dtype(args.dtype, resolve_checkpoint(args.ckpt))
    if args.dtype is not None and args.dtype.lower() == "auto":
        print(f"dtype auto: {why}", file=sys.stderr)
    return dtype


def cmd_generate(args) -> int:
    from openk3.train.checkpoint import load_model

    _print_threads(args)
    model, ckpt = load_model(args.ckpt, dtype=_serve_dtype(args))
    _generate(model.eval(), args.prompt, args, ckpt)
    return 0


def _engine_from_args(args):
    """Load `--ckpt` (a checkpoint or a training run) into an engine with the serving flags; returns
    (engine, chat template, checkpoint path)."""
    from openk3.data.chat import load_chat_template
    from openk3.data.jinja_sandbox import SandboxedRenderer
    from openk3.data.vision import load_media_proc_cfg
    from openk3.model.multimodal import K3ForConditionalGeneration
    from openk3.serve.config import ServeConfig
    from openk3.serve.engine import LLMEngine
    from openk3.train.checkpoint import is_training_checkpoint, load_model, resolve_checkpoint

    folder, media_proc_cfg = resolve_checkpoint(args.ckpt), None
    if not is_training_checkpoint(folder) and K3Config.from_pretrained(folder).vision_config is not None:
        # A release checkpoint with a vision tower serves images (server.py); its processor config comes along.
        model, ckpt = K3ForConditionalGeneration.from_pretrained(folder, dtype=_serve_dtype(args)), folder
        media_proc_cfg = load_media_proc_cfg(folder)
    else:
        model, ckpt = load_model(args.ckpt, dtype=_serve_dtype(args))
    model.eval()
    tok = load_tokenizer(ckpt, model.text_config)
    options = {"speculative_config": _speculative_config(args), "enable_prefix_caching": not args.no_prefix_caching,
               "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}  # fmt: skip
    if args.max_model_len:
        options["max_model_len"] = args.max_model_len
    engine = LLMEngine(model, tok, ServeConfig.from_options(**options), media_proc_cfg)
    renderer = SandboxedRenderer(timeout_s=args.template_timeout)
    return engine, load_chat_template(ckpt, tok, renderer), ckpt


def cmd_serve(args) -> int:
    import asyncio

    import uvicorn

    from openk3.serve.async_engine import AsyncLLM
    from openk3.serve.server import build_app

    _print_threads(args)
    engine, template, _ = _engine_from_args(args)
    print(f"k3 serve: {engine.cache_summary()}", file=sys.stderr)
    name = args.model_name or os.path.basename(os.path.normpath(args.ckpt))
    llm = AsyncLLM(engine, max_waiting=args.max_waiting)
    app = build_app(llm, name, template, max_body_bytes=args.max_body_bytes,
                    preprocess_timeout_s=args.preprocess_timeout, max_images_per_request=args.max_images_per_request,
                    max_image_pixels=args.max_image_pixels)  # fmt: skip
    grace = args.shutdown_timeout

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            # SIGTERM/Ctrl-C: stop accepting, let running requests finish for `grace` seconds, then fail the rest
            # (streams get an error event and [DONE]) so the process always exits.
            asyncio.get_running_loop().call_later(grace, llm.stop)
            await super().shutdown(sockets)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=grace + 2)  # fmt: skip
    print(f"serving {name} on http://{args.host}:{args.port}/v1 (chat template: {template.name})", file=sys.stderr)
    try:
        Server(config).run()
    finally:
        llm.shutdown()
        template.close()
    return 0


def cmd_chat(args) -> int:
    """An interactive terminal chat: streamed answers; /reset clears the history, /exit (or Ctrl-D, Ctrl-C) quits."""
    if args.show_template:  # the template only: no model is loaded
        template = _template_of(args.ckpt, args.template_timeout)
        print(f"{template.name}:\n{template.source}")
        template.close()
        return 0
    from openk3.serve.chat_repl import chat_loop

    _print_threads(args)
    engine, template, _ = _engine_from_args(args)
    try:
        return chat_loop(engine, template, system=args.system, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                         thinking=not args.no_thinking)  # fmt: skip
    except KeyboardInterrupt:  # Ctrl-C: leave like /exit, without a traceback
        print("\nk3 chat: interrupted", file=sys.stderr)
        return 130
    finally:
        template.close()


def _template_of(ckpt: str, timeout_s: float):
    """The chat template of `ckpt` (a checkpoint or a run: its newest good checkpoint), read without the weights."""
    from openk3.data.chat import load_chat_template
    from openk3.data.jinja_sandbox import SandboxedRenderer
    from openk3.train.checkpoint import resolve_checkpoint

    folder = resolve_checkpoint(ckpt)
    tok = load_tokenizer(folder, K3Config.from_pretrained(folder).text_config)
    return load_chat_template(folder, tok, SandboxedRenderer(timeout_s=timeout_s))


def _config_of(args) -> tuple[K3Config, str | None]:
    """The config of --ckpt and its folder (a checkpoint, or a training run: its newest good checkpoint, as serve,
    chat, generate and export read it), or of --preset (no folder)."""
    from openk3.train.checkpoint import resolve_checkpoint

    if not args.ckpt:
        return K3Config.preset(args.preset), None
    folder = resolve_checkpoint(args.ckpt)
    return K3Config.from_pretrained(folder), folder


def cmd_info(args) -> int:
    config, folder = _config_of(args)
    text = config.text_config
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    total, active = model.num_parameters()
    kinds = "".join("K" if text.layer_kind(i) == "kda" else "M" for i in range(text.num_hidden_layers))
    print(f"layers      {text.num_hidden_layers} (K = KDA, M = MLA): {kinds}")
    print(f"hidden      {text.hidden_size}, vocab {text.vocab_size}, AttnRes block {text.attn_res_block_size}")
    print(f"experts     {text.num_experts} routed (top-{text.num_experts_per_token}) in a {text.routed_expert_hidden_size}"
          f"-wide latent + {text.num_shared_experts} shared")  # fmt: skip
    print(f"parameters  total {total:,} ({_fmt(total)}), active per token {active:,} ({_fmt(active)})")
    _print_cpu(folder)
    return 0


def _print_cpu(ckpt: str | None) -> None:
    """This CPU's ISA, the decode kernels' build and how a bf16 model computes here (`k3 info`)."""
    from openk3.ops import cpu_kernels
    from openk3.ops.cpu_features import features
    from openk3.serve.config import serving_dtype

    cpu = features()
    print(f"cpu         {cpu.summary()}")
    kernels = cpu_kernels.info()
    if kernels["isa"] is None:
        print(f"kernels     not built ({kernels['error']}): decode runs the torch path")
    else:
        build = kernels["build"]
        openmp = "OpenMP" if build["openmp"] else "no OpenMP: one thread"
        print(f"kernels     {kernels['isa']} build ({build['compiler']}, {openmp}); this CPU runs "
              f"{', '.join(kernels['runnable'])}")  # fmt: skip
    products = "natively" if cpu.bf16_native else "in fp32 (operands widened, the result rounded to bf16 once)"
    print(f"bf16        products computed {products}")
    if ckpt:
        print(f"dtype auto  {serving_dtype('auto', ckpt)[1]}")


def cmd_demo(args) -> int:
    """Build a random tiny K3, save it, reload it and generate: the whole foundation in one command."""
    args.preset, args.max_shard_size, args.dtype = "tiny", None, None
    _print_threads(args)
    cmd_init(args)
    model = K3ForCausalLM.from_pretrained(args.out).eval()
    print("reloaded; sample (random weights, so expect noise):")
    _generate(model, args.prompt, args)
    return 0


def cmd_train(args) -> int:
    from openk3.parallel.launch import launch_torchrun
    from openk3.train.trainer import NonFiniteError, Trainer

    if args.nproc > 1:
        return launch_torchrun(args.nproc, args.argv)
    cfg = config_from_args(args)
    print(f"k3 train: {set_threads(cfg.threads)}", file=sys.stderr)
    try:
        trainer = Trainer(cfg)
        summary = trainer.run()
    except NonFiniteError as err:
        print(f"k3 train: {err}", file=sys.stderr)
        return 3
    if summary:
        keys = ("step", "loss", "val_loss", "unigram_loss", "mqar_acc", "needle_acc", "max_vio", "tokens_per_s", "mfu")
        print("final: " + ", ".join(f"{k}={summary[k]:.4g}" if isinstance(summary[k], float) else f"{k}={summary[k]}"
                                    for k in keys if k in summary))  # fmt: skip
    if trainer.stopped_by is not None:  # saved and stopped cleanly; the shell convention: 128 + the signal
        return 128 + trainer.stopped_by
    if trainer.step >= cfg.steps and cfg.sample_tokens > 0:
        print("sample:", repr(trainer.data.sample(trainer.model, cfg.sample_tokens)))
    return 0


def cmd_rl(args) -> int:
    from openk3.parallel.launch import launch_torchrun
    from openk3.rl.__main__ import run

    if args.nproc > 1:
        return launch_torchrun(args.nproc, args.argv, command="rl", module="openk3.rl")
    try:
        cfg = config_from_args(args, RLConfig, "rl_config.json", "k3 rl")
        run(cfg)
        return 0
    except (ValueError, FileExistsError) as err:
        print(f"k3 rl: {err}", file=sys.stderr)
        return 2


def cmd_distill(args) -> int:
    from openk3.parallel.launch import launch_torchrun
    from openk3.rl.__main__ import run

    if args.nproc > 1:
        return launch_torchrun(args.nproc, args.argv, command="distill", module="openk3.rl", module_args=["distill"])
    try:
        cfg = config_from_args(args, DistillConfig, DISTILL_CONFIG_FILE, "k3 distill")
        run(cfg)
    except (ValueError, FileExistsError, FileNotFoundError) as err:
        print(f"k3 distill: {err}", file=sys.stderr)
        return 2
    return 0


def cmd_plot(args) -> int:
    from openk3.train.plot import plot_comparison, plot_run

    if len(args.run_dir) > 1:  # several runs: their gradient norms on one figure
        paths = plot_comparison(args.run_dir, args.out)
    else:
        run_dir = args.run_dir[0]
        if os.path.exists(os.path.join(run_dir, "rl_config.json")):  # a `k3 rl` run: reward and success curves
            from openk3.rl.plot import plot_rl_run as plot_run
        paths = plot_run(run_dir, args.out)
    for path in paths:
        print(f"wrote {path}")
    return 0


def cmd_export(args) -> int:
    from openk3.export import export_gguf, export_release
    from openk3.train.checkpoint import load_model

    if args.format == "safetensors" and args.outtype is not None:
        raise ValueError("--outtype is for --format gguf; the safetensors export takes --dtype")
    if args.format == "gguf" and (args.dtype is not None or args.max_shard_size is not None):
        raise ValueError("--dtype and --max-shard-size are for --format safetensors; a GGUF export takes --outtype")
    if args.format == "gguf" and os.path.isdir(args.out):
        raise ValueError(f"--out {args.out} is a folder; with --format gguf it is the .gguf file to write")
    # A training checkpoint (or a run: its newest good one) is read here, offline, in this one process.
    model, ckpt = load_model(args.ckpt)
    if args.format == "gguf":
        outtype = args.outtype or "f32"
        export_gguf(model, load_tokenizer(ckpt, model.text_config), args.out, outtype=outtype,
                    name=os.path.basename(os.path.normpath(ckpt)))  # fmt: skip
        print(f"exported {ckpt} to {args.out} (llama.cpp kimi-k3 GGUF, {outtype})")
        return 0
    dtype = args.dtype or "bfloat16"
    export_release(model, ckpt, args.out, dtype, args.max_shard_size)
    print(f"exported {ckpt} to {args.out} ({dtype} with the release's fp32 tensors)")
    return 0


def cmd_tokenizer_train(args) -> int:
    from openk3.train.data import train_tokenizer_for

    config = K3Config.preset(args.preset)
    tok = train_tokenizer_for(config.text_config, args.data, log=print)
    tok.save(args.out)
    print(f"wrote {args.out}/tokenizer.json ({tok.vocab_size} ids)")
    return 0


def cmd_plan(args) -> int:
    from openk3.serve.plan import cache_plan, format_plan

    config = _config_of(args)[0]
    plan = cache_plan(config.text_config, act_bytes={"bf16": 2, "fp32": 4}[args.dtype], tp=args.tp)
    print(format_plan(plan, args.context, args.batch))
    return 0


# The benchmarks live in the checkout beside the package (benchmarks/NAME.py), not in the installed package.
BENCHMARKS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def benchmark_names(folder: str | None = None) -> list[str]:
    """The scripts of the checkout's benchmarks/ (files that run as `python benchmarks/NAME.py`, not the helpers
    they import); none when the folder is absent (an installed package)."""
    folder = folder or BENCHMARKS_DIR
    if not os.path.isdir(folder):
        return []
    names = []
    for file in sorted(os.listdir(folder)):
        if file.endswith(".py") and not file.startswith("_"):
            with open(os.path.join(folder, file), encoding="utf-8") as f:
                if 'if __name__ == "__main__":' in f.read():
                    names.append(file[: -len(".py")])
    return names


def run_benchmark(name: str, argv: list[str]) -> int:
    """Run the checkout's benchmarks/NAME.py as a script in a child Python (`python benchmarks/NAME.py ARGV`, so its
    folder is its import path and ours is untouched); returns its exit code."""
    import subprocess

    path = os.path.join(BENCHMARKS_DIR, name + ".py")
    if not os.path.isfile(path):
        if not os.path.isdir(BENCHMARKS_DIR):
            raise FileNotFoundError(f"k3 bench {name}: {path} not found; the benchmarks are in the source "
                                    "checkout, not in the installed package (clone the repository and "
                                    "`pip install -e .`)")  # fmt: skip
        raise ValueError(f"k3 bench: no benchmark {name!r}; {BENCHMARKS_DIR} has {', '.join(benchmark_names())}")
    return subprocess.call([sys.executable, path, *argv])


def load_benchmark(name: str):
    """Deprecated: `k3 bench` runs a benchmark as a script (`run_benchmark`) now. The module benchmarks/NAME.py,
    imported with its folder put on sys.path."""
    import importlib
    import warnings

    warnings.warn("openk3.cli.load_benchmark is deprecated; use run_benchmark(name, argv)", DeprecationWarning,
                  stacklevel=2)  # fmt: skip
    path = os.path.join(BENCHMARKS_DIR, name + ".py")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"k3 bench {name}: {path} not found; the benchmarks are in the source checkout, not "
                                "in the installed package (clone the repository and `pip install -e .`)")  # fmt: skip
    if BENCHMARKS_DIR not in sys.path:
        sys.path.insert(0, BENCHMARKS_DIR)
    return importlib.import_module(name)


def cmd_bench(args) -> int:
    return run_benchmark(args.which, args.rest)


SANDBOX_HELP = """Isolated sandboxes for agents (openk3.sandbox). A sandbox is a process tree owned by the process that
created it, so a command that exits cannot leave one behind: `k3 sandbox serve` is that owner, a fleet you start (and
stop with Ctrl-C, which closes every sandbox) listening on a Unix socket; create, exec, snapshot, restore, fork, ls and
rm talk to it and exit. Nothing starts a server implicitly. `k3 sandbox bench` needs no server."""


def cmd_sandbox(args) -> int:
    """`k3 sandbox SUBCOMMAND`: serve runs the fleet; the others are one request each to it (sandbox/fleet_client.py);
    bench runs benchmarks/sandbox.py."""
    from openk3.sandbox.base import SandboxError
    from openk3.sandbox.fleet_server import default_socket

    if args.sandbox_command == "bench":
        return run_benchmark("sandbox", args.rest)
    args.socket = args.socket or default_socket()
    try:
        return _sandbox_command(args)
    except (SandboxError, ConnectionError) as err:
        print(f"k3 sandbox {args.sandbox_command}: {type(err).__name__}: {err}", file=sys.stderr)
        return 1


def _sandbox_command(args) -> int:
    from openk3.sandbox import fleet_client as client

    sock, command = args.socket, args.sandbox_command
    if command == "serve":
        limits = {k: getattr(args, k) for k in ("memory_mb", "cpus", "max_pids", "disk_mb")
                  if getattr(args, k) is not None}  # fmt: skip
        return client.serve_fleet(sock, args.max_sandboxes, args.warm, args.idle_timeout, args.image, **limits)
    if command == "exec":
        return client.exec_command(sock, args.id, args.cmd, args.timeout, sys.stdin.read() if args.stdin else None)
    return {
        "create": lambda: client.create(sock),
        "snapshot": lambda: client.snapshot(sock, args.id, args.stop_processes),
        "restore": lambda: client.restore(sock, args.id, args.snapshot),
        "fork": lambda: client.fork(sock, args.source, args.n),
        "ls": lambda: client.ls(sock, args.json, args.metrics),
        "rm": lambda: client.rm(sock, args.ids),
    }[command]()


def _add_sandbox_parser(sub) -> None:
    p = sub.add_parser("sandbox", help="isolated sandboxes: serve a fleet, then create/exec/snapshot/... against it",
                       description=SANDBOX_HELP)  # fmt: skip
    ssub = p.add_subparsers(dest="sandbox_command", required=True)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        # bench hands every argument, --help included, to the benchmark's own parser: it has no options of its own.
        extra = {"prefix_chars": "+", "add_help": False} if name == "bench" else {}
        q = ssub.add_parser(name, help=help_text, description=help_text, formatter_class=_DefaultsHelpFormatter,
                            **extra)  # fmt: skip
        if name != "bench":
            q.add_argument("--socket", default=None,
                           help="the server's Unix socket (default: openk3-sandbox-UID.sock in $XDG_RUNTIME_DIR, "
                           "else in the temp folder)")  # fmt: skip
        q.set_defaults(func=cmd_sandbox)
        return q

    q = add("serve", "run a sandbox fleet in the foreground; Ctrl-C or SIGTERM closes every sandbox")
    q.add_argument("--max-sandboxes", type=int, default=64)
    q.add_argument("--warm", type=int, default=4, help="sandboxes kept started, ready for create")
    q.add_argument("--idle-timeout", type=float, default=300.0, help="seconds with no call before a sandbox is closed")
    q.add_argument("--image", default=None, help="a root filesystem folder (default: the host's /usr, read-only)")
    q.add_argument("--memory-mb", type=int, default=None)
    q.add_argument("--cpus", type=float, default=None)
    q.add_argument("--max-pids", type=int, default=None)
    q.add_argument("--disk-mb", type=int, default=None)
    add("create", "start a sandbox; prints its id")
    q = add("exec", "run CMD in a sandbox: its stdout and stderr, and its exit code as ours")
    q.add_argument("id")
    q.add_argument("--timeout", type=float, default=30.0, help="seconds before the command is killed")
    q.add_argument("--stdin", action="store_true", help="send our stdin to the command")
    q.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARG ...] (an argv, no shell: use sh -c '...')")
    q = add("snapshot", "freeze a sandbox's files as a snapshot (files only, not process memory); prints its id")
    q.add_argument("id")
    q.add_argument("--stop-processes", action="store_true", help="stop processes still running instead of failing")
    q = add("restore", "make a sandbox's files exactly a snapshot's (its processes are stopped)")
    q.add_argument("id")
    q.add_argument("snapshot")
    q = add("fork", "new sandboxes from a snapshot id, or from a sandbox id (a snapshot taken now); prints their ids")
    q.add_argument("source")
    q.add_argument("-n", type=int, default=1)
    q = add("ls", "the live sandboxes, the snapshots held, and the fleet's totals")
    q.add_argument("--json", action="store_true", help="everything, as JSON")
    q.add_argument("--metrics", action="store_true", help="the Prometheus metrics instead")
    q = add("rm", "close sandboxes and release snapshots by id, then delete the layers nothing uses")
    q.add_argument("ids", nargs="+")
    q = add("bench", "benchmarks/sandbox.py: snapshot, restore, fork, create, exec and idle density (no server)")
    q.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of the benchmark (`k3 sandbox bench --help`)")


def _add_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: OMP_NUM_THREADS, else the physical cores available)")  # fmt: skip


def _print_threads(args) -> None:
    """Set the thread count of a model-running command and say it in the command's header (stderr)."""
    print(f"k3 {args.command}: {set_threads(args.threads)}", file=sys.stderr)


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default="The Kimi K3 model")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speculative", choices=["ngram", "draft_model"], help="speculative decoding proposer")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--draft-ckpt", help="the draft model's checkpoint (with --speculative draft_model)")
    _add_threads(p)


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default, except where there is none to show (None, a switch's False, a required
    flag) or the help already says it."""

    @staticmethod
    def _has_default(action) -> bool:
        default = action.default
        return not (default is None or default is False or default == argparse.SUPPRESS or action.required)

    def _get_help_string(self, action):
        help_text = action.help or ""
        shows_default = self._has_default(action) and "default" not in help_text
        return super()._get_help_string(action) if shows_default else help_text

    def _format_action(self, action):
        if not action.help and action.option_strings and self._has_default(action):  # a flag with no help text
            action = argparse.Action(action.option_strings, action.dest, nargs=action.nargs, default=action.default,
                                     choices=action.choices, metavar=action.metavar, help="(default: %(default)s)")  # fmt: skip
        return super()._format_action(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3", description="openk3: the Kimi K3 model, training and serving")
    sub = parser.add_subparsers(dest="command", required=True,
                                parser_class=functools.partial(argparse.ArgumentParser,
                                                               formatter_class=_DefaultsHelpFormatter))  # fmt: skip

    _add_model_commands(sub)
    _add_training_commands(sub)
    _add_serving_commands(sub)
    _add_sandbox_parser(sub)
    return parser


def _add_model_commands(sub) -> None:
    """init, generate, info, demo."""
    p = sub.add_parser("init", help="write a random checkpoint (config.json + safetensors) for testing")
    p.add_argument("--preset", choices=TEXT_PRESETS, default="tiny")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: float32")
    p.add_argument("--max-shard-size", type=int, default=None, help="bytes per safetensors shard")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("generate", help="continue a prompt (the checkpoint's tokenizer, else byte-level)")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--dtype", type=str.lower, choices=DTYPE_CHOICES, default=None, help=DTYPE_HELP)
    _add_sampling(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("info", help="layer schedule and parameter counts")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--ckpt")
    g.add_argument("--preset", choices=TEXT_PRESETS)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("demo", help="init a tiny K3, save, reload, generate")
    p.add_argument("--out", default="runs/demo-tiny")
    _add_sampling(p)
    p.set_defaults(func=cmd_demo)


def _add_training_commands(sub) -> None:
    """train, rl, distill (each --nproc: torchrun), plot, export, tokenizer train."""
    p = sub.add_parser("train", help="train a K3 model (resumable; --nproc N runs N processes with torchrun)")
    add_train_arguments(p)
    p.add_argument("--nproc", type=int, default=1, help="processes on this machine (launches torchrun)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("rl", help="agentic RL in sandboxes: SFT warm start, rollouts, policy updates (--nproc N: "
                       "N rollout workers and ranks of the sharded update, --dp x --ep)")  # fmt: skip
    add_train_arguments(p, RLConfig)
    p.add_argument("--nproc", type=int, default=1, help="processes on this machine (launches torchrun)")
    p.set_defaults(func=cmd_rl)

    p = sub.add_parser("distill", help="multi-teacher on-policy distillation: the student samples, each token scored "
                       "by the teacher of its domain and effort (K3 Eq. 15); baselines rl, topk, offpolicy")  # fmt: skip
    add_train_arguments(p, DistillConfig)
    p.add_argument("--nproc", type=int, default=1, help="processes on this machine (launches torchrun)")
    p.set_defaults(func=cmd_distill)

    p = sub.add_parser("plot", help="PNG plots of a run (loss, MaxVio, expert load; a k3 rl run: reward, success, "
                       "log-prob gap)")  # fmt: skip
    p.add_argument("run_dir", nargs="+", help="a run folder; several: their gradient norms compared on one figure")
    p.add_argument("--out", default=None, help="folder for the PNGs (default: the run folder; several runs: .)")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("export", help="write a checkpoint in the release format and dtypes, or as a llama.cpp GGUF")
    p.add_argument(
        "--ckpt", required=True, help="a training checkpoint, a training run (its latest), or a release folder"
    )
    p.add_argument("--out", required=True, help="a folder (safetensors) or the .gguf file (gguf)")
    p.add_argument("--format", choices=["safetensors", "gguf"], default="safetensors",
                   help="safetensors: the release format; gguf: one file in llama.cpp's kimi-k3 format")  # fmt: skip
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="safetensors only (default: bfloat16)")  # fmt: skip
    p.add_argument("--outtype", choices=["f32", "bf16"], default=None,
                   help="gguf only: f32 (default), or bf16 matrices (norms, biases, router, convs stay f32)")  # fmt: skip
    p.add_argument("--max-shard-size", type=int, default=None, help="safetensors only")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("tokenizer", help="tokenizer tools")
    tsub = p.add_subparsers(dest="tokenizer_command", required=True)
    t = tsub.add_parser("train", help="train a byte-level BPE on a corpus for a preset's vocabulary")
    t.add_argument("--preset", choices=TEXT_PRESETS, default="tiny")
    t.add_argument("--data", default="stdlib", help="stdlib (default) or a path")
    t.add_argument("--out", required=True)
    t.set_defaults(func=cmd_tokenizer_train)


def _add_serving_commands(sub) -> None:
    """plan, serve, chat, bench."""
    p = sub.add_parser("plan", help="hybrid-cache memory per token and per request, crossover vs all-MLA")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--ckpt")
    g.add_argument("--preset", choices=TEXT_PRESETS)
    p.add_argument("--context", type=int, nargs="+", default=[1024, 4096, 8192, 32768, 131072],
                   help="context lengths per request, in tokens")  # fmt: skip
    p.add_argument("--batch", type=int, default=1, help="concurrent requests")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (KDA state shards, MLA latent does not)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="activation dtype of latent and conv")
    p.set_defaults(func=cmd_plan)

    for name, help_text in (("serve", "the OpenAI-compatible HTTP server"), ("chat", "an interactive terminal chat")):
        p = sub.add_parser(name, help=help_text)
        _add_engine_flags(p)
        if name == "serve":
            _add_server_flags(p)
        else:
            _add_chat_flags(p)

    names = ", ".join(benchmark_names()) or "none: no benchmarks/ folder beside the package"
    p = sub.add_parser("bench", help="run the source checkout's benchmarks/NAME.py (`k3 bench -h` lists them)")
    p.add_argument("which", metavar="NAME", help=f"a script of the checkout's benchmarks/ ({names})")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of the benchmark")
    p.set_defaults(func=cmd_bench)


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The model and engine flags of serve and chat."""
    p.add_argument("--ckpt", required=True, help="a checkpoint folder or a training run folder")
    p.add_argument("--dtype", type=str.lower, choices=DTYPE_CHOICES, default=None, help=DTYPE_HELP)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--speculative", choices=["ngram", "draft_model"])
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--draft-ckpt")
    p.add_argument("--template-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help="seconds a checkpoint's chat template may render before it is stopped")  # fmt: skip
    _add_threads(p)


def _add_server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default=None, help="the id clients use (default: the folder name)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="queued sequences (a request counts n) before 429")  # fmt: skip
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="request bodies larger than this get 413")  # fmt: skip
    p.add_argument("--preprocess-timeout", type=float, default=DEFAULT_PREPROCESS_TIMEOUT_S,
                   help="seconds to tokenize and template a prompt before the request fails")  # fmt: skip
    p.add_argument("--max-images-per-request", type=int, default=DEFAULT_MAX_IMAGES_PER_REQUEST,
                   help="image content parts one chat request may carry (more get 400)")  # fmt: skip
    p.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                   help="width x height of one image, read from its header (larger images get 400)")  # fmt: skip
    p.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                   help="on SIGTERM, seconds running requests may finish before they are failed")  # fmt: skip
    p.set_defaults(func=cmd_serve)


def _add_chat_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default=None, help="a system message")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-thinking", action="store_true",
                   help="answer without thinking (K3's chat format: the think channel off, as the server's "
                   "chat_template_kwargs thinking false)")  # fmt: skip
    p.add_argument("--show-template", action="store_true", help="print the chat template and exit")
    p.set_defaults(func=cmd_chat)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"k3: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

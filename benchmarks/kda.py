"""`k3 bench kda` (or `python benchmarks/kda.py`): KDA speed on this machine against the matmul limit, the baselines
and softmax attention.

Owns the CPU benchmark of the KDA ops: for each shape, length T, input dtype and mode (forward, forward+backward)
it times the recurrent reference (`kda_recurrent`), the fast chunked path (`kda_chunked`; for bf16 inputs
`kda_chunked_bf16`, the op with bf16 tile operands that the bf16 targets are about), the pre-K3 log-space
baseline (`kda_chunked_logspace`, at the end of this file), fla-core's pure-torch `naive_recurrent_kda` (loaded
standalone, no triton) and causal softmax attention (`scaled_dot_product_attention`, same heads and width). It
measures the machine's fp32 and bf16 matmul rates in the same run and reports each cell's achieved GFLOP/s as a
fraction of them, peak memory (kernel VmHWM reset per cell), accuracy checks, and every KDA target as
measured / met. Cells that cannot run in the memory or time budget are kept, marked skipped with the reason.

FLOP conventions (per head; C = 16 tile rows, matmul FLOPs only, elementwise work not counted):
    chunked fwd  per tile: 4C²K (A, Aqk) + 2C²(K+V) (Tinv X) + 2C²V (Aqk U) + 6CKV (W h, Qd h, Krᵀ U)
    chunked bwd  per tile: the forward's block recompute + 2CKV·(1 + 3/4) (U, states) + 12CKV + 4C²V + 4C²(K+V)
                 + 8C²K (the hand-written backward's matmuls, counted from chunk.py)
    logspace fwd per 64-token chunk: off-diagonal blocks as matmuls, diagonal 16×16 pairs as 2·16·16·K each (kk, qk),
                 64³/3 inverse, 2·64²(K+V), 2·64²V, 6·64·K·V; fwd+bwd counted as 3× forward (autograd)
    recurrent / fla naive: 8KV per token (decay, Sᵀk, rank-1 write, read); fwd+bwd counted as 3× forward
    softmax attention: 2T²K causal (half of QKᵀ and PV); fwd+bwd counted as 3.5× forward

Shapes: B batch, T tokens, H heads, K key dim, V value dim, C tile rows.
"""

import argparse
import importlib.util
import math
import os
import re
import statistics
import time

import torch
import torch.nn.functional as F
from report import (
    dtype_name,
    load_info,
    machine_info,
    measure_matmul,
    out_help,
    scratch_out,
    targets_table,
    write_report,
)

from openk3.ops.kda import kda_chunked, kda_gate, kda_recurrent
from openk3.ops.kda.chunk_bf16 import kda_chunked_bf16
from openk3.ops.kda.ref import run_sequences
from openk3.ops.kda.unit_lower import unit_lower_inverse
from openk3.utils import rel_rms, release_freed_memory, to_dtype

PATHS = ["recurrent", "chunked", "logspace", "fla_naive", "sdpa"]
MODES = ["fwd", "fwd+bwd"]
# Linear paths grow ~T; attention ~T². Used to predict a cell's time from the previous length.
GROWTH = {"recurrent": 1, "chunked": 1, "logspace": 1, "fla_naive": 1, "sdpa": 2}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="k3 bench kda", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes, one repetition (a few seconds; for tests)")
    p.add_argument("--out", default=None, help=out_help("kda-cpu") + " (--quick: runs/bench/kda-quick.json)")
    p.add_argument("--lengths", default=None, help="comma-separated T (default 512,2048,8192,32768)")
    p.add_argument("--dtype", default="fp32,bf16", help="input dtypes, comma-separated (fp32, bf16)")
    p.add_argument("--paths", default=",".join(PATHS), help="paths to run, comma-separated")
    p.add_argument("--max-cell-seconds", type=float, default=120.0, help="skip cells predicted to run longer")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--max-cell-gib", type=float, default=12.0, help="skip cells predicted to need more memory")
    args = p.parse_args(argv)
    args.out = args.out or scratch_out("kda-quick" if args.quick else "kda-cpu")

    if args.quick:
        shapes = {"quick": dict(H=2, K=32, V=32, lengths=[64, 256])}
    else:
        lengths = [int(t) for t in (args.lengths or "512,2048,8192,32768").split(",")]
        shapes = {"k3": dict(H=16, K=128, V=128, lengths=lengths),
                  "small": dict(H=4, K=64, V=64, lengths=[t for t in lengths if t <= 2048])}  # fmt: skip
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = [to_dtype(d) for d in args.dtype.split(",")]
    paths = args.paths.split(",")
    fla_naive, fla_reason = load_fla_naive()

    result = {"machine": machine_info(), "args": vars(args), "matmul_gflops": measure_matmul(args.quick, dtypes)}
    print("matmul rate: " + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in result["matmul_gflops"].items()))
    plan = [(s, T, d, path, mode) for s, cfg in shapes.items() for d in dtypes for path in paths for mode in MODES
            for T in cfg["lengths"]]  # fmt: skip
    cells, last_time = [], {}
    for n, (shape, T, dtype, path, mode) in enumerate(plan):
        cfg = shapes[shape]
        key = (shape, dtype, path, mode)
        cell = {"shape": shape, "T": T, "H": cfg["H"], "K": cfg["K"], "V": cfg["V"], "dtype": dtype_name(dtype),
                "path": path, "mode": mode}  # fmt: skip
        reason = skip_reason(path, mode, T, cfg, dtype, fla_reason, args)
        if reason is None and key in last_time:
            t_prev, T_prev = last_time[key]
            predicted = t_prev * (T / T_prev) ** GROWTH[path]
            if predicted > args.max_cell_seconds:
                reason = f"predicted {predicted:.0f} s > --max-cell-seconds {args.max_cell_seconds:g}"
        print(f"[{n + 1}/{len(plan)}] {shape} T={T} {cell['dtype']} {path} {mode} ...", end=" ", flush=True)
        if reason is not None:
            cell.update(status="skipped", reason=reason)
            print(f"skipped: {reason}")
        else:
            fn = make_cell(path, mode, T, cfg, dtype, fla_naive)
            cell.update(time_cell(fn, budget_s=0.05 if args.quick else 3.0))
            flops = count_flops(path, mode, T, cfg)
            rate_key = "bf16" if dtype == torch.bfloat16 and "bf16" in result["matmul_gflops"] else "fp32"
            cell.update(status="ok", gflop=flops / 1e9, gflops=flops / 1e9 / cell["seconds"],
                        matmul_fraction=flops / 1e9 / cell["seconds"] / result["matmul_gflops"][rate_key])  # fmt: skip
            last_time[key] = (cell["seconds"], T)
            print(f"{cell['seconds'] * 1e3:.1f} ms, {cell['gflops']:.1f} GFLOP/s, {cell['peak_mib']:.0f} MiB")
        cells.append(cell)
    result["cells"] = cells
    result["checks"] = numerical_checks(shapes, dtypes, args.quick)
    result["targets"] = evaluate_targets(cells, result)
    result["machine"]["load_after"] = load_info()
    print_table(cells)
    write_report(result, args.out, markdown(result))
    return 0


def load_fla_naive():
    """fla-core's `naive_recurrent_kda` loaded from its single file (importing `fla.ops` needs triton)."""
    try:
        spec = importlib.util.find_spec("fla")
        if spec is None or spec.origin is None:
            return None, "fla-core not installed (pip install fla-core)"
        path = os.path.join(os.path.dirname(spec.origin), "ops", "kda", "naive.py")
        file_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
        module = importlib.util.module_from_spec(file_spec)
        file_spec.loader.exec_module(module)
        return module.naive_recurrent_kda, None
    except Exception as e:  # noqa: BLE001 - any import failure only disables this comparison
        return None, f"fla-core naive_recurrent_kda not loadable: {type(e).__name__}: {e}"


def skip_reason(path, mode, T, cfg, dtype, fla_reason, args) -> str | None:
    H, K, V = cfg["H"], cfg["K"], cfg["V"]
    gib = 2**30
    if path == "fla_naive":
        if fla_reason is not None:
            return fla_reason
        if mode == "fwd+bwd":
            return "forward-only comparison: the target is fla's naive forward"
    if path == "recurrent" and mode == "fwd" and T > 8192:
        return "token-loop reference beyond 8K: 6+ GiB resident (one run was OOM-killed on this shared 24 GiB machine)"
    if path == "recurrent" and mode == "fwd+bwd" and T > 2048:
        return f"autograd of the token loop keeps every step's state: {T * H * K * V * 4 * 3 / gib:.1f} GiB, minutes"
    if path == "sdpa" and mode == "fwd+bwd" and T > 8192:
        return "softmax attention backward beyond 8K: O(T^2) time, many minutes on 2 cores"
    if path == "logspace" and mode == "fwd+bwd":
        need = 10 * T * 16 * H * K * 4 / gib  # measured: ~10 pairwise [T, 16, H, K] fp32 tensors live at the peak
        if need > args.max_cell_gib:
            return f"autograd keeps pairwise log-space factors: ~{need:.0f} GiB > --max-cell-gib {args.max_cell_gib:g}"
    return None


def make_inputs(T, cfg, dtype, seed=0, g_value=None):
    H, K, V = cfg["H"], cfg["K"], cfg["V"]
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1).to(dtype)
    k = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1).to(dtype)
    v = torch.randn(1, T, H, V, generator=gen).to(dtype)
    if g_value is None:  # K3's gate on a spread of raw values: g ∈ (−5, 0)
        g = kda_gate(torch.randn(1, T, H, K, generator=gen), torch.zeros(H), torch.randn(H * K, generator=gen))
    else:
        g = torch.full((1, T, H, K), g_value)
    beta = torch.sigmoid(torch.randn(1, T, H, generator=gen))
    return q, k, v, g, beta


def make_cell(path, mode, T, cfg, dtype, fla_naive):
    """A zero-argument function running one cell (inputs built once, outside the timing)."""
    q, k, v, g, beta = make_inputs(T, cfg, dtype)
    if path == "sdpa":
        args = [x.transpose(1, 2).contiguous() for x in (q, k, v)]  # [B, H, T, D]

        def op(q, k, v):
            return (F.scaled_dot_product_attention(q, k, v, is_causal=True),)
    else:
        args = [q, k, v, g, beta]
        op = {"recurrent": kda_recurrent, "chunked": chunked_op(dtype), "logspace": kda_chunked_logspace,
              "fla_naive": fla_naive}[path]  # fmt: skip
        if op is kda_chunked_bf16:  # compiles its elementwise kernel on first use per shape: not part of the timing
            with torch.no_grad():
                op(*(x[:, :64] for x in args))
    if mode == "fwd":

        def run():
            with torch.no_grad():
                op(*args)
    else:
        leaves = [x.detach().requires_grad_() for x in args]

        def run():
            for x in leaves:
                x.grad = None
            op(*leaves)[0].float().sum().backward()

    return run


def chunked_op(dtype):
    """The chunked op timed for an input dtype: bf16 inputs run the bf16-operand op (opt-in, see chunk_bf16.py)."""
    return kda_chunked_bf16 if dtype == torch.bfloat16 else kda_chunked


def time_cell(fn, budget_s: float = 3.0) -> dict:
    """Runs fn until ~budget_s is spent (1–5 timed runs after a warm-up when cheap): min and median seconds, and
    the peak resident memory above the pre-cell level (heap trimmed, then VmHWM reset via /proc/self/clear_refs)."""
    rss0 = _reset_peak_rss()
    t = time.perf_counter()
    fn()
    first = time.perf_counter() - t
    times = [first]
    if first < budget_s:
        times = []
        for _ in range(max(1, min(5, int(budget_s / max(first, 1e-6))))):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    peak = _peak_rss() - rss0 if rss0 is not None else float("nan")
    return {"seconds": min(times), "median_seconds": statistics.median(times), "runs": len(times),
            "peak_mib": peak / 2**20}  # fmt: skip


def _reset_peak_rss() -> int | None:
    """Returns freed heap pages to the OS (so the baseline is live memory) and resets the kernel's peak RSS."""
    release_freed_memory()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kib("VmRSS") * 1024
    except OSError:
        return None


def _peak_rss() -> int:
    return _status_kib("VmHWM") * 1024


def _status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", open("/proc/self/status").read()).group(1))


def count_flops(path, mode, T, cfg) -> float:
    """FLOPs of one cell under the conventions of the module docstring (all heads)."""
    H, K, V = cfg["H"], cfg["K"], cfg["V"]
    if path == "chunked":
        C = 16
        tiles = math.ceil(T / C)
        block = 4 * C * C * K + 2 * C * C * (K + V)
        fwd = block + 2 * C * C * V + 6 * C * K * V
        # backward (chunk.py): block recompute; U and 3/4 of the states recomputed; dU, the rank-2C dh update,
        # [dU; dO] hᵀ, U dhᵀ (6 state-sized products); Aqkᵀ dO, dO Uᵀ, Tinvᵀ dY, dX Yᵀ, dP Ki, dPᵀ [Kd; Qd]
        bwd = block + 2 * C * K * V * (1 + 3 / 4) + 12 * C * K * V + 4 * C * C * V + 4 * C * C * (K + V) + 8 * C * C * K
        return H * tiles * (fwd + (bwd if mode == "fwd+bwd" else 0))
    if path == "logspace":
        C, c = 64, 16
        chunks = math.ceil(T / C)
        off_diag = sum(2 * c * (r * c) * K for r in range(C // c)) * 2  # kk and qk
        diag = (C // c) * 2 * (2 * c * c * K)
        fwd = off_diag + diag + C**3 / 3 + 2 * C * C * (K + V) + 2 * C * C * V + 6 * C * K * V
        return H * chunks * fwd * (3 if mode == "fwd+bwd" else 1)
    if path in ("recurrent", "fla_naive"):
        return H * T * 8 * K * V * (3 if mode == "fwd+bwd" else 1)
    return H * 2 * T * T * K * (3.5 if mode == "fwd+bwd" else 1)  # sdpa, causal


def numerical_checks(shapes, dtypes, quick) -> dict:
    """bf16 vs fp32 relative RMS and saturated-gate finiteness at every benchmarked length (k3 shape)."""
    name, cfg = next(iter(shapes.items()))
    checks = {"shape": name, "bf16_rel_rms_vs_fp32": {}, "bf16_rel_rms_vs_recurrent": {}, "saturated_finite": {}}
    for T in cfg["lengths"]:
        x32 = make_inputs(T, cfg, torch.float32, seed=1)
        with torch.no_grad():
            o32, S32 = kda_chunked(*x32, output_final_state=True)
            if torch.bfloat16 in dtypes:
                xbf = [t.bfloat16() if i < 3 else t for i, t in enumerate(x32)]
                obf, Sbf = kda_chunked_bf16(*xbf, output_final_state=True)
                checks["bf16_rel_rms_vs_fp32"][T] = {"o": rel_rms(obf, o32), "state": rel_rms(Sbf, S32)}
                if T <= 2048:
                    o_rec, _ = kda_recurrent(*x32)
                    checks["bf16_rel_rms_vs_recurrent"][T] = rel_rms(obf, o_rec)
        xs = [t.requires_grad_() for t in make_inputs(T, cfg, torch.float32, seed=2, g_value=-5.0)]
        o, S = kda_chunked(*xs, output_final_state=True)
        (o.sum() + S.sum()).backward()
        checks["saturated_finite"][T] = bool(o.isfinite().all() and S.isfinite().all()
                                             and all(t.grad.isfinite().all() for t in xs))  # fmt: skip
    return checks


def _find(cells, **kw):
    for c in cells:
        if all(c.get(k) == v for k, v in kw.items()) and c["status"] == "ok":
            return c
    return None


def evaluate_targets(cells, result) -> list[dict]:
    """Every KDA target as measured in this run: value, met (True/False) or None when not measurable."""
    out = []

    def add(target, measured, met):
        out.append({"target": target, "measured": measured, "met": met})

    shape = "k3" if any(c["shape"] == "k3" for c in cells) else cells[0]["shape"]
    lengths = sorted({c["T"] for c in cells if c["shape"] == shape})
    T8 = 8192 if 8192 in lengths else lengths[-1]
    for dt in ("fp32", "bf16"):
        c = _find(cells, shape=shape, T=T8, dtype=dt, path="chunked", mode="fwd")
        add(f"chunked fwd T={T8} {dt}: >= 25% of measured {dt} matmul rate",
            None if c is None else f"{c['matmul_fraction']:.1%} ({c['gflops']:.0f} GFLOP/s)",
            None if c is None else c["matmul_fraction"] >= 0.25)  # fmt: skip
    for dt, need in (("fp32", 3.0), ("bf16", 10.0)):
        c = _find(cells, shape=shape, T=T8, dtype=dt, path="chunked", mode="fwd")
        f = _find(cells, shape=shape, T=T8, dtype=dt, path="fla_naive", mode="fwd")
        ratio = None if c is None or f is None else f["seconds"] / c["seconds"]
        add(f"chunked fwd T={T8} {dt} >= {need:g}x faster than fla naive_recurrent_kda",
            None if ratio is None else f"{ratio:.1f}x ({c['seconds']:.3f} s vs {f['seconds']:.3f} s)",
            None if ratio is None else ratio >= need)  # fmt: skip
    for mode in MODES:
        ratios = {}
        for T in lengths:
            c = _find(cells, shape=shape, T=T, dtype="fp32", path="chunked", mode=mode)
            b = _find(cells, shape=shape, T=T, dtype="fp32", path="logspace", mode=mode)
            if c and b:
                ratios[T] = b["seconds"] / c["seconds"]
        add(f"chunked >= 1.3x faster than log-space baseline at every T (fp32 {mode})",
            ", ".join(f"T={T}: {r:.2f}x" for r, T in zip(ratios.values(), ratios)) or None,
            (min(ratios.values()) >= 1.3) if ratios else None)  # fmt: skip
    wins = {}
    for T in [t for t in lengths if t >= 8192]:
        c = _find(cells, shape=shape, T=T, dtype="fp32", path="chunked", mode="fwd")
        s = _find(cells, shape=shape, T=T, dtype="fp32", path="sdpa", mode="fwd")
        if c and s:
            wins[T] = s["seconds"] / c["seconds"]
    add(
        "chunked fwd faster than softmax attention from T=8K on (fp32)",
        ", ".join(f"T={T}: {r:.1f}x" for T, r in wins.items()) or None,
        (min(wins.values()) > 1) if wins else None,
    )
    per_token = {T: c["seconds"] / T * 1e6 for T in lengths
                 if (c := _find(cells, shape=shape, T=T, dtype="fp32", path="chunked", mode="fwd"))}  # fmt: skip
    linear = None
    if len(per_token) >= 2:
        first, last = per_token[min(per_token)], per_token[max(per_token)]
        linear = last <= 1.5 * first
    add(
        "chunked time grows linearly in T (us/token, fp32 fwd; within 1.5x of the shortest length)",
        ", ".join(f"T={T}: {v:.1f}" for T, v in per_token.items()) or None,
        linear,
    )
    f = _find(cells, shape=shape, T=T8, dtype="fp32", path="chunked", mode="fwd")
    b = _find(cells, shape=shape, T=T8, dtype="fp32", path="chunked", mode="fwd+bwd")
    ratio = None if f is None or b is None else b["seconds"] / f["seconds"]
    add(
        f"chunked fwd+bwd <= 3.5x fwd at T={T8} (fp32)",
        None if ratio is None else f"{ratio:.2f}x",
        None if ratio is None else ratio <= 3.5,
    )
    return out + _check_targets(result)


def _check_targets(result) -> list[dict]:
    checks = result.get("checks") or {}
    out = []
    bf = checks.get("bf16_rel_rms_vs_fp32", {})
    if bf:
        worst = max(v["o"] for v in bf.values())
        out.append({"target": "bf16 inputs within 1e-2 relative of the fp32 reference (o, every T)",
                    "measured": f"max rel RMS {worst:.1e}", "met": worst <= 1e-2})  # fmt: skip
    sat = checks.get("saturated_finite", {})
    if sat:
        out.append({"target": "no NaN/Inf with saturated gates (g = -5) at any length, fwd and bwd",
                    "measured": ", ".join(f"T={T}: {'finite' if ok else 'NON-FINITE'}" for T, ok in sat.items()),
                    "met": all(sat.values())})  # fmt: skip
    return out


def markdown(result) -> str:
    """The results as a short markdown report: machine, matmul rates, targets, then every cell."""
    m = result["machine"]
    lines = [
        "# KDA CPU benchmark (`k3 bench kda`)", "",
        (f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['threads']} thread(s), "
        f"Python {m['python']}.  "),
        f"Load before / after: `{m['load_before']}` / `{m.get('load_after', '')}`.  ",
        "Matmul rate (best 2048² GEMM, this run): "
        + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in result["matmul_gflops"].items()) + ".", "",
    ]  # fmt: skip
    lines += targets_table(result["targets"], "KDA on CPU")
    lines += ["", "## Cells", "", ("| shape | dtype | path | mode | T | ms (min) | ms (median) | GFLOP/s | % matmul | "
              "peak MiB |"), "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for c in result["cells"]:
        head = f"| {c['shape']} | {c['dtype']} | {c['path']} | {c['mode']} | {c['T']} |"
        if c["status"] == "ok":
            lines.append(f"{head} {c['seconds'] * 1e3:.1f} | {c['median_seconds'] * 1e3:.1f} | {c['gflops']:.1f} | "
                         f"{c['matmul_fraction']:.1%} | {c['peak_mib']:.0f} |")  # fmt: skip
        else:
            lines.append(f"{head} skipped: {c['reason']} | | | | |")
    return "\n".join(lines) + "\n"


def print_table(cells) -> None:
    print(f"\n{'shape':6} {'dtype':5} {'path':10} {'mode':8} {'T':>6} {'ms':>10} {'GFLOP/s':>8} {'%mm':>6} {'MiB':>7}")
    for c in cells:
        head = f"{c['shape']:6} {c['dtype']:5} {c['path']:10} {c['mode']:8} {c['T']:>6}"
        if c["status"] == "ok":
            print(f"{head} {c['seconds'] * 1e3:>10.1f} {c['gflops']:>8.1f} {c['matmul_fraction']:>6.1%} "
                  f"{c['peak_mib']:>7.0f}")  # fmt: skip
        else:
            print(f"{head}   skipped: {c['reason']}")


# ---- the pre-K3 baseline ---------------------------------------------------------------------------------------------
# Pre-K3 chunked KDA baseline: 64-token chunks, diagonal 16-token sub-tiles evaluated pair by pair in log space.
#
# `kda_chunked_logspace` is kept out of the package (no user calls it) so that `k3 bench kda` can show what the
# gate's lower bound buys: the K3 chunked path anchors every tile at a shared row because g ≥ −5, so its
# diagonal tiles are matmuls too. It is the algorithm FLA used before `safe_gate` (PR #703), written
# in PyTorch with autograd for its backward; same contract and outputs as `kda_recurrent`
# (tests/ops/test_kda_baseline.py).
#
# Math, per 64-token chunk with entering state S₀ (Γ = cumsum of g inside the chunk):
#     A[i, j] = Σ_d x_{i,d} k_{j,d} exp(Γ_{i,d} − Γ_{j,d})      x = k (A_kk, j < i) or scale·q (A_qk, j ≤ i)
#     off-diagonal sub-tile pairs (row sub-tile r after column sub-tile c): one matmul, anchored at the first row a of
#         sub-tile r:  (x ⊙ e^{Γ − Γ_a}) (k ⊙ e^{Γ_a − Γ})ᵀ, both factors ≤ 1 for ANY gate;
#     diagonal sub-tiles: no safe shared anchor without a lower bound on g, so every pair (i, j ≤ i) exponentiates
#         its own Γ_i − Γ_j ≤ 0 per channel: a [16, 16, K] tensor per sub-tile instead of a matmul;
#     T̃ = (I + Diag(β) A_kk)⁻¹,  W = T̃ Diag(β)(K ⊙ e^Γ),  Ũ = T̃ Diag(β) V,  U = Ũ − W S₀,
#     O = scale (Q ⊙ e^Γ) S₀ + A_qk U,  S₀ ← Diag(e^{Γ_C}) S₀ + (K ⊙ e^{Γ_C − Γ})ᵀ U.
#
# Shapes: B batch, T tokens, H heads, K key dim, V value dim, n chunks, C = 64 chunk rows, c = 16 sub-tile rows,
# s = C / c sub-tiles per chunk.

LOGSPACE_CHUNK = 64
SUBTILE = 16


def kda_chunked_logspace(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The log-space chunked baseline; same contract as `kda_recurrent`. Valid for any g ≤ 0 (no lower bound)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return run_sequences(_logspace_sequence, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)


def _to_chunks(x_BTHD: torch.Tensor, n: int) -> torch.Tensor:
    """[B, T, H, D] -> [B, H, n, C, D], zero (neutral) rows padding T up to n·C."""
    B, T, H, D = x_BTHD.shape
    x_BTHD = F.pad(x_BTHD, (0, 0, 0, 0, 0, n * LOGSPACE_CHUNK - T))
    return x_BTHD.reshape(B, n, LOGSPACE_CHUNK, H, D).permute(0, 3, 1, 2, 4)


def _intra_chunk_scores(x_BHnCK, k_BHnCK, G_BHnCK, causal_diag: bool) -> torch.Tensor:
    """A [B, H, n, C, C] with A[i, j] = Σ_d x_i k_j e^{Γ_i − Γ_j} for j < i (j ≤ i when causal_diag)."""
    s = LOGSPACE_CHUNK // SUBTILE
    A = x_BHnCK.new_zeros(*x_BHnCK.shape[:-1], LOGSPACE_CHUNK)
    for r in range(s):
        rows = slice(r * SUBTILE, (r + 1) * SUBTILE)
        G_rows = G_BHnCK[..., rows, :]
        if r > 0:
            # Off-diagonal pairs: anchor at the sub-tile's first row; every factor is e^(≤ 0).
            G_a = G_rows[..., :1, :]
            x_a = x_BHnCK[..., rows, :] * (G_rows - G_a).exp()
            k_a = k_BHnCK[..., : r * SUBTILE, :] * (G_a - G_BHnCK[..., : r * SUBTILE, :]).exp()
            A[..., rows, : r * SUBTILE] = x_a @ k_a.mT
        # Diagonal sub-tile, pair by pair in log space: mask the exponent BEFORE exp (non-causal pairs would
        # overflow to inf and give 0·inf = NaN in backward).
        diff_ccK = G_rows[..., :, None, :] - G_rows[..., None, :, :]
        causal_cc = torch.ones(SUBTILE, SUBTILE, dtype=torch.bool, device=x_BHnCK.device).tril(0 if causal_diag else -1)
        diff_ccK = diff_ccK.masked_fill(~causal_cc[:, :, None], float("-inf"))
        pair_ccK = x_BHnCK[..., rows, None, :] * k_BHnCK[..., None, rows, :] * diff_ccK.exp()
        A[..., rows, rows] = pair_ccK.sum(-1)
    return A


def _logspace_sequence(q, k, v, g, beta, S_BHKV, scale):
    """kda_chunked_logspace for one run of tokens, all inputs already in the compute dtype."""
    B, T, H, _ = q.shape
    V = v.shape[-1]
    n = -(-T // LOGSPACE_CHUNK)
    q_c, k_c, v_c, g_c = (_to_chunks(x, n) for x in (q, k, v, g))
    beta_c = _to_chunks(beta[..., None], n)  # [B, H, n, C, 1]
    G = g_c.cumsum(-2)
    A_kk = beta_c * _intra_chunk_scores(k_c, k_c, G, causal_diag=False)
    A_qk = _intra_chunk_scores(scale * q_c, k_c, G, causal_diag=True)
    Tinv = unit_lower_inverse(A_kk)
    decay = G.exp()
    W = Tinv @ (beta_c * k_c * decay)
    U_tilde = Tinv @ (beta_c * v_c)
    Qd = scale * q_c * decay
    Kr = k_c * (G[..., -1:, :] - G).exp()
    D = G[..., -1, :].exp()[..., None]  # [B, H, n, K, 1]
    o_chunks = []
    for i in range(n):
        U = U_tilde[:, :, i] - W[:, :, i] @ S_BHKV
        o_chunks.append(Qd[:, :, i] @ S_BHKV + A_qk[:, :, i] @ U)
        S_BHKV = D[:, :, i] * S_BHKV + Kr[:, :, i].mT @ U
    if n == 0:
        return v.new_zeros(B, 0, H, V), S_BHKV
    o_BHnCV = torch.stack(o_chunks, dim=2)
    return o_BHnCV.permute(0, 2, 3, 1, 4).reshape(B, n * LOGSPACE_CHUNK, H, V)[:, :T], S_BHKV


if __name__ == "__main__":
    raise SystemExit(main())

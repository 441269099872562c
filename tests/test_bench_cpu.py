"""`k3 bench cpu` (benchmarks/cpu.py) on the tiny preset with a few tokens writes JSON and markdown with every section
and positive numbers, with llama.cpp (when llama-cpp-python is installed) and without it (`--no-llamacpp`). Both run
as their own process: the benchmark re-executes itself to set OMP_WAIT_POLICY, which an in-process call cannot
(its OpenMP runtimes are loaded), and llama.cpp's and torch's spinning threads would slow a pytest process ~5x on
2 cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from bench_scripts import load

bench_cpu = load("cpu")  # benchmarks/cpu.py

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "cpu.py")
SMOKE = ["--preset", "tiny", "--rounds", "1", "--prefill-tokens", "16", "--decode-tokens", "4", "--quick"]


def run(cmd: list[str], cwd, omp: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if omp:
        env["OMP_WAIT_POLICY"] = omp
    proc = subprocess.run([*cmd, *SMOKE, "--out-dir", "out"], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=180, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((cwd / "out" / "cpu.json").read_text())
    result["stdout"] = proc.stdout
    return result


def check_openk3_side(result: dict) -> None:
    assert {"machine", "cpu", "omp_wait_policy", "loadavg_before", "loadavg_after", "bandwidth", "matmul_gflops", "bound",
            "rounds", "summary", "profile", "targets"} <= set(result)  # fmt: skip
    assert result["bandwidth"]["read_gbs"] > 0 and result["bandwidth"]["copy_gbs"] > 0
    assert all(v > 0 for v in result["matmul_gflops"].values())
    for dtype in ("fp32", "bf16", "auto"):
        bound = result["bound"][dtype]
        assert bound["bytes"] == sum(bound["parts"].values()) > 0 and bound["ms_per_token"] > 0
        ours = result["summary"][dtype]["openk3"]
        assert ours["prefill_tok_s"]["median"] > 0 and ours["decode_tok_s"]["median"] > 0
        profile = result["profile"][dtype]
        assert profile["ms_per_step_unprofiled"] > 0 and profile["categories_ms_per_step"]["matmul"] > 0
        assert profile["top_ops"] and all(op["self_ms_per_step"] > 0 for op in profile["top_ops"])
    # fp32 weights are twice the bf16 ones, bar the few tensors bf16 keeps in fp32
    assert 1.9 < result["bound"]["fp32"]["bytes"] / result["bound"]["bf16"]["bytes"] <= 2
    # vs llama.cpp (prefill, decode) x (fp32, bf16); the bandwidth bound x 3 dtypes; (bf16, auto) / fp32 x 2; fidelity
    assert len(result["targets"]) == 12 and all("target" in t and "measured" in t for t in result["targets"])
    cpu = result["cpu"]
    assert cpu["kernels"]["isa"] in cpu["kernels"]["runnable"] and cpu["auto_dtype"] in ("float32", "bfloat16")
    for dtype in ("bf16", "auto"):
        over = result["summary"][dtype]["over_fp32"]
        assert over["prefill"] > 0 and over["decode"] > 0
        judged = [t for t in result["targets"] if t["target"].startswith(f"openk3 {dtype} ")]
        assert len(judged) == 2 and all((t["met"] is None) == cpu["bf16_native"] for t in judged)


def test_bench_cpu_without_llamacpp(tmp_path):
    """`python benchmarks/cpu.py --no-llamacpp`, OMP_WAIT_POLICY already passive: no re-execution needed."""
    result = run([sys.executable, BENCH, "--no-llamacpp", "--omp-wait-policy", "passive"], tmp_path, "passive")
    check_openk3_side(result)
    omp = result["omp_wait_policy"]
    assert omp["policy"] == "passive" and not omp["reexecuted"] and omp["applied"]
    assert not result["llamacpp"]["measured"] and "--no-llamacpp" in result["llamacpp"]["why_not"]
    assert all(t["met"] is None for t in result["targets"] if "llama.cpp" in t["target"])
    assert {r["side"] for r in result["rounds"]} == {"openk3"} and "fidelity" not in result
    assert "not measured" in (tmp_path / "out" / "cpu.md").read_text()


def test_bench_cpu_with_llamacpp(tmp_path):
    """`k3 bench cpu` (through the CLI's module) re-executes itself with OMP_WAIT_POLICY=passive, then measures both
    sides, every round and dtype, and the fidelity."""
    pytest.importorskip("llama_cpp")
    result = run([sys.executable, "-m", "openk3.cli", "bench", "cpu", "--omp-wait-policy", "passive"], tmp_path, None)
    assert "re-executing with OMP_WAIT_POLICY=passive" in result["stdout"]
    omp = result["omp_wait_policy"]
    assert omp["policy"] == "passive" and omp["reexecuted"] and omp["applied"]
    check_openk3_side(result)
    assert result["llamacpp"]["measured"] and all(os.path.exists(tmp_path / p) for p in result["gguf"].values())
    assert {(r["dtype"], r["side"]) for r in result["rounds"]} == {
        (d, s) for d in ("fp32", "bf16") for s in ("openk3", "llama.cpp")
    } | {("auto", "openk3")}
    for dtype in ("fp32", "bf16"):
        summary = result["summary"][dtype]
        assert (
            summary["llama.cpp"]["prefill_tok_s"]["median"] > 0 and summary["llama.cpp"]["decode_tok_s"]["median"] > 0
        )
        assert summary["decode_ratio"] > 0 and summary["prefill_ratio"] > 0
    assert result["fidelity"]["rel_rms"] < 1e-4  # the target is 1e-5; the tiny model's q/k eps differ (gguf.py)
    assert all(t["met"] is not None for t in result["targets"])
    assert (tmp_path / "out" / "cpu.md").read_text().startswith("# CPU inference: openk3 vs llama.cpp")


def test_omp_policy_decision(monkeypatch):
    """auto: passive above a 0.5 load average, else the runtimes' defaults; an in-process call never re-executes
    pytest, and records that the wanted policy was not applied."""
    assert bench_cpu.omp_policy("auto", 0.6) == "passive" and bench_cpu.omp_policy("auto", 0.4) is None
    assert bench_cpu.omp_policy("active", 3.0) == "active"
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    info = bench_cpu.ensure_omp_policy("passive", ["--omp-wait-policy", "passive"])
    assert info["wanted"] == "passive" and not info["applied"] and "OMP_WAIT_POLICY" not in os.environ

"""`k3 bench kda --quick` (benchmarks/kda.py through the CLI's entry point) runs in seconds and writes JSON and
markdown with every cell, skipped ones carrying a reason."""

import json

from bench_scripts import load

from openk3.cli import main as k3

bench_kda = load("kda")  # benchmarks/kda.py


def test_bench_kda_quick_writes_every_cell(tmp_path, monkeypatch):
    """Without --out, --quick writes under runs/bench/, never over the committed benchmarks/results/kda-cpu.*."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    committed = tmp_path / "benchmarks" / "results" / "kda-cpu.json"
    committed.write_text("committed")
    assert k3(["bench", "kda", "--quick"]) == 0
    assert committed.read_text() == "committed" and not (committed.parent / "kda-cpu.md").exists()
    out = tmp_path / "runs" / "bench" / "kda-quick.json"
    assert (tmp_path / "runs" / "bench" / "kda-quick.md").read_text().startswith("# KDA CPU benchmark")
    result = json.loads(out.read_text())
    assert {"machine", "matmul_gflops", "cells", "checks", "targets"} <= set(result)
    assert result["matmul_gflops"]["fp32"] > 0 and result["machine"]["torch"]
    cells = result["cells"]
    expected = {(d, p, m, T) for d in ("fp32", "bf16") for p in bench_kda.PATHS for m in bench_kda.MODES
                for T in (64, 256)}  # fmt: skip
    assert {(c["dtype"], c["path"], c["mode"], c["T"]) for c in cells} == expected
    for c in cells:
        assert c["status"] in ("ok", "skipped")
        if c["status"] == "skipped":
            assert c["reason"]
        else:
            assert c["seconds"] > 0 and c["gflops"] > 0 and c["matmul_fraction"] > 0
    assert any(c["status"] == "skipped" and c["path"] == "fla_naive" and c["mode"] == "fwd+bwd" for c in cells)
    assert all(ok for ok in result["checks"]["saturated_finite"].values())
    assert all(v["o"] <= 1e-2 for v in result["checks"]["bf16_rel_rms_vs_fp32"].values())
    assert all("target" in t and "measured" in t for t in result["targets"])

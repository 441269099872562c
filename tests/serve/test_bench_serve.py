"""`k3 bench serve --quick` runs in seconds, writes JSON and markdown with every section, and its cache arithmetic
matches `k3 plan` exactly (the one target that is exact rather than timed)."""

import json

from bench_scripts import load

bench_serve = load("serve")  # benchmarks/serve.py


def test_bench_serve_quick_writes_every_section(tmp_path, monkeypatch):
    """Without --out, --quick writes under runs/bench/, never over the committed benchmarks/results/serve-cpu.*."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    committed = tmp_path / "benchmarks" / "results" / "serve-cpu.json"
    committed.write_text("committed")
    assert bench_serve.main(["--quick", "--contexts", "64,256"]) == 0
    assert committed.read_text() == "committed" and not (committed.parent / "serve-cpu.md").exists()
    out = tmp_path / "runs" / "bench" / "serve-quick.json"
    result = json.loads(out.read_text())
    assert {"machine", "matmul_gflops", "cache", "decode", "ttft", "speculative", "throughput", "targets"} <= set(
        result
    )
    k3 = result["cache"]["k3-layout"]
    assert k3["measured_bytes_per_token"] == k3["plan_bytes_per_token"] == 27_648
    assert k3["measured_request_bytes"] == k3["plan_request_bytes"] == 449_372_160
    assert abs(k3["ratio_to_all_mla"] - 24 / 93) < 1e-12
    assert [c["context"] for c in result["decode"]["tiny"]["hybrid"]] == [64, 256]
    assert all(c["ms_per_token"] > 0 for c in result["decode"]["tiny"]["all_mla"])
    assert result["ttft"]["hit_tokens"] == result["ttft"]["shared"]  # the checkpoint at the earlier prompt's end
    assert set(result["throughput"]) == {"1", "4"}
    assert all("target" in t and "measured" in t for t in result["targets"])
    assert (out.parent / "serve-quick.md").read_text().startswith("# Serving benchmark")

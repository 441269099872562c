"""`k3 bench ep --quick`: quantile balancing evens the all-to-all, and the MoonEP-style plan gives every rank exactly
its share with replicas; bytes are reported per rank."""

import json

from bench_scripts import load

bench_ep = load("ep")  # benchmarks/ep.py


def test_ep_simulation_quick(tmp_path):
    out = tmp_path / "ep.json"
    assert bench_ep.main(["--quick", "--ranks", "8,32", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (tmp_path / "ep.md").read_text().startswith("# Expert-parallel balance")
    assert result["experts"] == 896 and result["top_k"] == 16
    rows = {(r["ranks"], r["scheme"]): r for r in result["rows"]}
    for R in (8, 32):
        assert rows[(R, "quantile")]["max_over_mean"] < rows[(R, "plain")]["max_over_mean"]
        moonep = rows[(R, "moonep")]
        assert moonep["max_over_mean"] <= 1 + R / (64 * R * 16) + 1e-9 and moonep["replicas"] > 0
        assert all(rows[(R, s)]["bytes_max"] >= rows[(R, s)]["bytes_mean"] > 0 for s in ("plain", "quantile", "moonep"))

#!/usr/bin/env bash
# Checks and times the GPU KDA path (fla-core chunk_kda with safe_gate, lower_bound -5) on a CUDA machine.
# Usage: bash benchmarks/gpu_kda.sh [OUT.json]  (needs torch with CUDA; installs fla-core + triton if missing)
# Runs in under 5 minutes: the GPU equivalence tests, then fwd / fwd+bwd timings against SDPA at T = 2K, 8K, 32K
# (H = 16 and 96, D = 128, bf16), printed and written to OUT.json (default runs/bench/kda-gpu.json, not committed;
# benchmarks/results/kda-gpu.json to commit them).
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,6p' "$0" | cut -c3-; exit 0 ;; esac
OUT="${1:-}"
if [ -n "$OUT" ]; then OUT="$(realpath -m "$OUT")"; fi  # the caller's folder, before the cd below
cd "$(dirname "$0")/.."
export KDA_GPU_OUT="${OUT:-runs/bench/kda-gpu.json}"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
python -c "import fla, triton" 2>/dev/null || pip install -q "fla-core>=0.6.0" triton einops
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 150 python -m pytest -q tests/ops/test_kda_gpu.py
timeout 120 python - <<'PY'
import json, os, time
import torch
import torch.nn.functional as F
from openk3.ops import dispatch
from openk3.ops.kda import kda_chunked, kda_gate

def bench(fn, reps=10):
    fn(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3

rows = []
for H in (16, 96):
    for T in (2048, 8192, 32768):
        K = V = 128
        q = F.normalize(torch.randn(1, T, H, K, device="cuda"), dim=-1).bfloat16()
        k = F.normalize(torch.randn(1, T, H, K, device="cuda"), dim=-1).bfloat16()
        v = torch.randn(1, T, H, V, device="cuda").bfloat16()
        g = kda_gate(torch.randn(1, T, H, K, device="cuda"), torch.zeros(H, device="cuda"), torch.zeros(H * K, device="cuda"))
        beta = torch.rand(1, T, H, device="cuda")
        leaves = [x.requires_grad_() for x in (q, k, v, g, beta)]
        with dispatch.use_impl("kda_chunked", "fla"):
            fwd = bench(lambda: dispatch.kda_chunked(q, k, v, g, beta))
            fb = bench(lambda: dispatch.kda_chunked(*leaves)[0].float().sum().backward(), reps=5)
        qs, ks, vs = (x.detach().transpose(1, 2).contiguous() for x in (q, k, v))
        sdpa = bench(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True))
        row = dict(H=H, T=T, kda_fwd_ms=fwd, kda_fwd_bwd_ms=fb, sdpa_fwd_ms=sdpa)
        print(row, flush=True)
        rows.append(row)
out = os.environ["KDA_GPU_OUT"]
os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, open(out, "w"), indent=1)
print(f"wrote {out}")
PY

"""The optional exact-threshold refinement of quantile balancing (not K3's rule): same fixed point as K3's rule, no
point mass at the current bias, so it converges where k is small (the tiny preset routes top-2 of 8)."""

from __future__ import annotations

import torch

from openk3.ops.moe.route import route_topk
from openk3.train.balance import bias_bounds, quantile_histogram, recover_quantile_bias, required_bias
from openk3.train.metrics import expert_loads, max_vio


def _iterate(scores_TE, k, iters, exact):
    bias_E = torch.zeros(scores_TE.shape[1])
    for _ in range(iters):
        lo, hi = bias_bounds(bias_E)
        hist = quantile_histogram(scores_TE, bias_E, k, lo, hi, 1000, exact_thresholds=exact)
        b_hat = recover_quantile_bias(hist, lo, hi, k)
        bias_E = (b_hat - b_hat.mean()).float()
    idx, _ = route_topk(scores_TE, bias_E, k)
    return max_vio(expert_loads(idx, scores_TE.shape[1]), k, scores_TE.shape[0])


def test_exact_thresholds_match_single_expert_thresholds():
    gen = torch.Generator().manual_seed(0)
    s = torch.rand(64, 8, generator=gen, dtype=torch.float64)
    b = torch.randn(8, generator=gen, dtype=torch.float64) * 0.1
    r = required_bias(s, b, 2, exact_thresholds=True)
    for j in range(8):
        others = torch.cat([s[:, :j] + b[:j], s[:, j + 1 :] + b[j + 1 :]], dim=1)
        kth_other = others.topk(2, dim=1).values[:, 1]  # expert j enters the top-2 iff s_ij + b_j > this
        assert torch.allclose(r[:, j], kth_other - s[:, j])
    # K3's surrogate equals it on selected entries and never exceeds it elsewhere.
    r_k3 = required_bias(s, b, 2)
    assert torch.all(r_k3 <= r + 1e-12)


def test_exact_thresholds_balance_small_k_where_the_k3_surrogate_oscillates():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(8192, 8, generator=gen) + torch.randn(8, generator=gen)  # skewed expert popularity
    s = torch.sigmoid(logits)
    k3 = _iterate(s, 2, 20, exact=False)
    refined = _iterate(s, 2, 20, exact=True)
    print(f"n=8, k=2, m=8192, 20 iterations: MaxVio K3 rule {k3:.4f}, exact thresholds {refined:.4f}")
    assert refined < 0.02 and refined < k3

"""Router-bias balancing: the hand-checked histogram vector, the Fig. 5 exact step, the property tests 1-8,
histogram ≡ exact within one bin, the tiny K3 model, and 2 gloo ranks ≡ one process."""

from __future__ import annotations

import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from openk3 import K3Config, K3ForCausalLM
from openk3.ops.moe.route import route_topk, route_topk_cutoff
from openk3.train.balance import (
    Balancer,
    bias_bounds,
    exact_quantile_bias,
    near_ties,
    quantile_histogram,
    recover_quantile_bias,
    required_bias,
    solve_exact,
)
from openk3.train.metrics import expert_loads, max_vio

FIG5_SCORES = [
    [0.73, 0.56, 0.37, 0.49], [0.68, 0.81, 0.20, 0.11], [0.70, 0.79, 0.13, 0.49], [0.19, 0.41, 0.78, 0.31],
    [0.79, 0.25, 0.31, 0.67], [0.95, 0.41, 0.26, 0.07], [0.61, 0.39, 0.48, 0.40], [0.29, 0.55, 0.42, 0.52],
]  # fmt: skip


# Bitwise comparisons (and speed on a shared 2-core box) need a fixed BLAS thread count (conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def synthetic_scores(m, n, sigma_e=0.5, seed=0, dtype=torch.float32):
    """A synthetic router: per-token logits N(0, 1) plus a per-expert popularity offset N(0, σ_e²)."""
    gen = torch.Generator().manual_seed(seed)
    popularity_E = sigma_e * torch.randn(n, generator=gen, dtype=torch.float64)
    logits = torch.randn(m, n, generator=gen, dtype=torch.float64) + popularity_E
    return torch.sigmoid(logits).to(dtype)


def loads_of(scores_TE, bias_E, k):
    return expert_loads(route_topk(scores_TE, bias_E, k)[0], scores_TE.shape[-1])


class FakeMoE(nn.Module):
    """Just the routing surface of StableLatentMoE: gate.e_score_correction_bias, top_k, observer."""

    def __init__(self, n, k):
        super().__init__()
        self.gate = nn.Module()
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(n), requires_grad=False)
        self.top_k, self.observer = k, None

    def forward(self, scores_TE):
        idx_Tk, _ = route_topk(scores_TE, self.gate.e_score_correction_bias, self.top_k)
        if self.observer is not None:
            self.observer(self, scores_TE, idx_Tk)
        return idx_Tk


def fake_model(num_layers, n, k):
    return nn.ModuleList(FakeMoE(n, k) for _ in range(num_layers))


def biases(model):
    return [layer.gate.e_score_correction_bias.detach().clone() for layer in model]


# ---- hand-checked histogram recovery and the Fig. 5 exact step ----------------------------------------------


def test_histogram_recovery_hand_checked_vector():
    hist_EB = torch.tensor([[0, 2, 2, 0], [2, 2, 0, 0]], dtype=torch.int32)
    b_hat = recover_quantile_bias(hist_EB, -1.0, 1.0, k=1)
    assert b_hat.tolist() == [0.0, -0.5]
    b = b_hat - b_hat.mean()
    assert b.tolist() == [0.25, -0.25]
    assert bias_bounds(b) == (-1.25, 1.25)


def test_fig5_exact_step_balances_4_3_1_0_to_2_2_2_2():
    s = torch.tensor(FIG5_SCORES, dtype=torch.float64)
    zero = torch.zeros(4, dtype=torch.float64)
    assert route_topk(s, zero, 1)[0][:, 0].tolist() == [0, 1, 1, 2, 0, 0, 0, 1]
    assert loads_of(s, zero, 1).tolist() == [4, 3, 1, 0]
    b = exact_quantile_bias(s, zero, 1)
    torch.testing.assert_close(b, torch.tensor([-0.11875, -0.02875, 0.08125, 0.06625], dtype=torch.float64))
    assert route_topk(s, b, 1)[0][:, 0].tolist() == [0, 1, 1, 2, 3, 0, 2, 3]
    assert loads_of(s, b, 1).tolist() == [2, 2, 2, 2]


def test_fig5_through_the_balancer_quantile_sign_none():
    s = torch.tensor(FIG5_SCORES)
    out = {}
    for method in ("quantile", "sign", "none"):
        model = fake_model(1, 4, 1)
        bal = Balancer(model, method=method, sign_rate=1e-3)
        with bal.collecting():
            model[0](s)
        metrics = bal.step()
        assert metrics["loads"] == [[4, 3, 1, 0]] and metrics["max_vio"] == 1.0
        assert metrics["tokens_per_step"] == 8 and metrics["q_bar"] == 2.0
        out[method] = model[0].gate.e_score_correction_bias.detach()
    # The histogram estimate sits within one bin of the exact rule's quantile and balances this batch too.
    assert loads_of(s, out["quantile"], 1).tolist() == [2, 2, 2, 2]
    assert torch.equal(out["sign"], torch.tensor([-1e-3, -1e-3, 1e-3, 1e-3]))  # γ·sign(q̄ − load)
    assert torch.equal(out["none"], torch.zeros(4))


# ---- properties 1-8 -----------------------------------------------------------------------------------------


def test_1_shift_invariance_of_midpoint_and_histogram_biases():
    s = synthetic_scores(2048, 16, seed=1, dtype=torch.float64)
    b_exact = solve_exact(s, 4, iters=5)
    model = fake_model(1, 16, 4)
    bal = Balancer(model)
    with bal.collecting():
        model[0](s.float())
    bal.step()
    b_hist = model[0].gate.e_score_correction_bias.detach().double()
    for b in (b_exact, b_hist):
        for c in (0.125, -0.3, 1.0):
            assert torch.equal(route_topk(s, b, 4)[0], route_topk(s, b + c, 4)[0])


def test_2_monotonicity_raising_one_bias():
    gen = torch.Generator().manual_seed(2)
    for _ in range(200):
        s = torch.rand(64, 8, generator=gen, dtype=torch.float64)
        b = 0.2 * torch.randn(8, generator=gen, dtype=torch.float64)
        j = int(torch.randint(8, (1,), generator=gen))
        raised = b.clone()
        raised[j] += 0.3 * float(torch.rand(1, generator=gen, dtype=torch.float64))
        before, after = loads_of(s, b, 2), loads_of(s, raised, 2)
        assert after[j] >= before[j]
        others = torch.arange(8) != j
        assert bool((after[others] <= before[others]).all())
        assert int(after.sum()) == int(before.sum()) == 64 * 2


def test_3_single_expert_exactness_with_exact_thresholds():
    m, n, k, j = 512, 8, 2, 3
    s = synthetic_scores(m, n, seed=3, dtype=torch.float64)
    b = 0.1 * torch.randn(n, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    others = torch.arange(n) != j
    c_m = (s[:, others] + b[others]).topk(k, dim=-1).values[:, -1]  # k-th largest among the other experts
    thresholds = (c_m - s[:, j]).sort().values
    for q in (1, 64, 128, 300, 511):
        b[j] = (thresholds[q - 1] + thresholds[q]) / 2
        assert int(loads_of(s, b, k)[j]) == q


def test_4_sharding_histograms_add_and_1_2_4_ranks_give_identical_b():
    m, n, k, B = 4096, 32, 4, 1000
    s = synthetic_scores(m, n, sigma_e=1.0, seed=4)
    bias = 0.05 * torch.randn(n, generator=torch.Generator().manual_seed(4))
    lo, hi = bias_bounds(bias)
    pooled = quantile_histogram(s, bias, k, lo, hi, B)
    assert int(pooled.sum()) == m * n
    shards = sum(quantile_histogram(part, bias, k, lo, hi, B) for part in s.chunk(4))
    assert torch.equal(shards, pooled)
    # The estimate shares a bin with the pooled exact ceil(q)-th smallest r, so |error| ≤ w.
    b_hat = recover_quantile_bias(pooled, lo, hi, k)
    r_sorted = required_bias(s, bias, k).double().sort(dim=0).values
    w = (hi - lo) / B
    assert float((b_hat - r_sorted[m * k // n - 1]).abs().max()) <= w
    # Ranks simulated as micro-batches of one Balancer: the summed counts, hence b, are bitwise identical.
    results = []
    for ranks in (1, 2, 4):
        model = fake_model(2, n, k)
        for layer in model:
            layer.gate.e_score_correction_bias.data.copy_(bias)
        bal = Balancer(model)
        for part in s.chunk(ranks):
            with bal.collecting():
                for layer in model:
                    layer(part)
        bal.step()
        results.append(biases(model) + [torch.tensor(bal.lo + bal.hi)])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_histogram_matches_exact_rule_within_one_bin_width():
    m, n, k = 8192, 64, 8
    for sigma_e in (0.5, 1.5):
        s = synthetic_scores(m, n, sigma_e=sigma_e, seed=5, dtype=torch.float64)
        bias = solve_exact(s, k, iters=3)  # a realistic, non-zero starting bias
        model = fake_model(1, n, k)
        model[0].gate.e_score_correction_bias.data.copy_(bias)
        bal = Balancer(model)
        w = (bal.hi[0] - bal.lo[0]) / bal.num_bins
        with bal.collecting():
            model[0](s.float())
        bal.step()
        b_hist = model[0].gate.e_score_correction_bias.detach().double()
        b_exact = exact_quantile_bias(s.float().double(), bias.float().double(), k)
        err = float((b_hist - b_exact).abs().max()) / w
        print(f"sigma_e={sigma_e}: max |b_hist - b_exact| = {err:.3f} w")
        assert err < 1.0


def test_5_exact_solver_and_histogram_converge_on_a_fixed_batch():
    m, n, k = 8192, 64, 8
    for sigma_e in (0.5, 1.5):
        s = synthetic_scores(m, n, sigma_e=sigma_e, seed=6, dtype=torch.float64)
        assert max_vio(loads_of(s, torch.zeros(n, dtype=torch.float64), k), k, m) > 0.3
        b = solve_exact(s, k, iters=20)
        exact_vio = max_vio(loads_of(s, b, k), k, m)
        model = fake_model(1, n, k)
        bal = Balancer(model)
        for _ in range(20):
            with bal.collecting():
                model[0](s.float())
            bal.step()
        hist_vio = max_vio(loads_of(s.float(), model[0].gate.e_score_correction_bias, k), k, m)
        print(f"sigma_e={sigma_e}: MaxVio after 20 iterations: exact {exact_vio:.4f}, histogram {hist_vio:.4f}")
        assert exact_vio < 0.02
        # Each token puts its runner-up expert's r exactly on that expert's current bias: a point mass of ~m/n
        # counts inside one bin, which within-bin interpolation can only place to a fraction of w. So on one fixed
        # batch the histogram settles at 0.02-0.05 (6 seeds; 0.004-0.01 at B = 10^4), still below the 0.066
        # per-batch noise floor of random routing at this q̄ = 1024, which hides it on fresh batches.
        assert hist_vio < 0.06


def test_6_bias_never_changes_mixture_weights():
    s = synthetic_scores(256, 16, seed=7)
    for scale in (0.0, 0.1, 1.0):
        b = scale * torch.randn(16, generator=torch.Generator().manual_seed(7))
        idx, w = route_topk(s, b, 4)
        picked = s.gather(-1, idx)
        torch.testing.assert_close(w, picked / picked.sum(-1, keepdim=True), rtol=1e-6, atol=0)


def test_7_eval_and_outside_collecting_mutate_nothing_and_cutoff_routes_match_topk():
    s = synthetic_scores(512, 16, seed=8)
    b = 0.1 * torch.randn(16, generator=torch.Generator().manual_seed(8))
    idx_k1, cutoff_T = route_topk_cutoff(s, b, 4)
    assert torch.equal(idx_k1, route_topk(s, b, 4)[0])
    assert torch.equal(cutoff_T, (s + b).topk(5, dim=-1).values[:, 4])
    # Scores that autocast left in bf16 are still cut off in fp32, as route_topk adds the fp32 bias.
    idx_bf16, cutoff_bf16 = route_topk_cutoff(s.bfloat16(), b, 4)
    assert cutoff_bf16.dtype == torch.float32 and torch.equal(idx_bf16, route_topk(s.bfloat16(), b, 4)[0])
    model = fake_model(2, 16, 4)
    bal = Balancer(model)
    before = biases(model)
    model[0](s)  # training mode, but outside collecting()
    model.eval()
    with bal.collecting():
        for layer in model:
            layer(s)
    assert bal._hist == [None, None] and bal._loads == [None, None]
    metrics = bal.step()
    assert metrics["tokens_per_step"] == 0 and metrics["max_vio"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, biases(model)))


def test_8_balancer_state_round_trip_and_counts_restart_at_zero():
    s = synthetic_scores(1024, 16, sigma_e=1.0, seed=9)
    model = fake_model(2, 16, 4)
    bal = Balancer(model)
    with bal.collecting():
        for layer in model:
            layer(s)
    bal.step()
    with bal.collecting():
        for layer in model:
            layer(s)
    state = bal.state_dict()
    assert state["lo"].dtype == torch.float64 and state["lo"].shape == (2,)
    clone = fake_model(2, 16, 4)
    clone.load_state_dict(model.state_dict())
    restored = Balancer(clone)
    restored.load_state_dict(state)
    assert restored.lo == bal.lo and restored.hi == bal.hi
    assert restored._hist == [None, None] and restored._loads == [None, None]
    assert [state["lo"][i].item() for i in range(2)] == [bias_bounds(b)[0] for b in biases(clone)]
    bal.load_state_dict(state)  # loading also drops counts gathered since
    assert bal._hist == [None, None]
    with bal.collecting():
        model[0](s)
    bal.discard()  # a skipped step: counts dropped, biases untouched
    before = biases(model)
    assert bal.step()["tokens_per_step"] == 0 and all(torch.equal(a, b) for a, b in zip(before, biases(model)))


def test_token_mask_leaves_tokens_out():
    s = synthetic_scores(600, 16, seed=10)
    keep_T = torch.arange(600) % 3 != 0
    masked, subset = fake_model(1, 16, 4), fake_model(1, 16, 4)
    bal_masked, bal_subset = Balancer(masked), Balancer(subset)
    with bal_masked.collecting(token_mask=keep_T):
        masked[0](s)
    with bal_subset.collecting():
        subset[0](s[keep_T])
    assert torch.equal(bal_masked._hist[0], bal_subset._hist[0])
    assert bal_masked.step()["loads"] == bal_subset.step()["loads"]
    assert torch.equal(masked[0].gate.e_score_correction_bias, subset[0].gate.e_score_correction_bias)
    with bal_masked.collecting(token_mask=keep_T[:10]), pytest.raises(ValueError, match="token_mask"):
        masked[0](s)


def test_bad_arguments_are_loud():
    with pytest.raises(ValueError, match="balance method"):
        Balancer(fake_model(1, 8, 2), method="aux")
    with pytest.raises(ValueError, match="no MoE layer"):
        Balancer(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="0 < k < n"):
        Balancer(fake_model(1, 8, 8))
    with pytest.raises(ValueError, match="ema"):
        Balancer(fake_model(1, 8, 2), ema=1.0)


# ---- optional EMA and router health ----------------------------------------------------------------------------


def test_ema_damps_the_update_and_zero_is_k3s_rule():
    s = synthetic_scores(2048, 16, sigma_e=1.0, seed=7)
    old = 0.05 * torch.randn(16, generator=torch.Generator().manual_seed(7))
    old = old - old.mean()
    out = {}
    for ema in (0.0, 0.6):
        model = fake_model(1, 16, 2)
        model[0].gate.e_score_correction_bias.data.copy_(old)
        bal = Balancer(model, ema=ema)
        with bal.collecting():
            model[0](s)
        bal.step()
        out[ema] = model[0].gate.e_score_correction_bias.detach().clone()
        assert bal.lo[0] == float(out[ema].min()) - 1.0 and bal.hi[0] == float(out[ema].max()) + 1.0
    # ema = 0 is the plain rule (the histogram estimate, centred); 0.6 keeps 60% of the old bias.
    lo, hi = bias_bounds(old)
    b_hat = recover_quantile_bias(quantile_histogram(s, old, 2, lo, hi, 1000), lo, hi, 2)
    torch.testing.assert_close(out[0.0], (b_hat - b_hat.mean()).float())
    torch.testing.assert_close(out[0.6], 0.6 * old + 0.4 * out[0.0])
    assert abs(float(out[0.6].sum())) < 1e-6  # still centred


def test_near_ties_hand_checked_and_reported_per_layer():
    # k = 1: the gap between the 1st and 2nd biased score; width 0.05.
    s = torch.tensor([[0.50, 0.52, 0.10], [0.90, 0.10, 0.80], [0.30, 0.31, 0.305], [0.2, 0.6, 0.1]])
    bias = torch.tensor([0.0, 0.0, 0.0])
    assert int(near_ties(s, bias, 1, 0.05)) == 2  # rows 0 and 2
    assert int(near_ties(s, torch.tensor([0.0, -0.4, 0.0]), 1, 0.05)) == 2  # the bias moves them: rows 2 and 3
    assert int(near_ties(s, bias, 1, 0.05, torch.tensor([True, True, False, True]))) == 1
    # Through the Balancer: the fraction of the step's tokens, summed over micro-batches like the loads.
    model = fake_model(2, 3, 1)
    bal = Balancer(model, num_bins=10)  # bounds [-1, 1]: w = 0.2
    for part in s.chunk(2):
        with bal.collecting():
            for layer in model:
                layer(part)
    metrics = bal.step()
    assert metrics["near_tie_fraction_per_layer"] == [0.75, 0.75]  # rows 0, 1 (0.9 vs 0.8) and 2 are within 0.2


# ---- the tiny K3 model --------------------------------------------------------------------------------------


def test_tiny_k3_model_step_balances_and_checkpoint_keeps_the_bias(tmp_path):
    model = K3ForCausalLM(K3Config.preset("tiny"))
    model.init_random_weights(0)
    model.train()
    bal = Balancer(model)
    assert len(bal.layers) == 8 and all(name.endswith("block_sparse_moe") for name in bal.names)
    ids = torch.randint(0, 768, (4, 64), generator=torch.Generator().manual_seed(0))
    before = [layer.gate.e_score_correction_bias.detach().clone() for layer in bal.layers]
    with torch.no_grad():
        for micro in ids.chunk(2):  # two micro-batches of one optimizer step
            with bal.collecting():
                model(micro)
        model(ids)  # outside collecting(): not counted
    first = bal.step()
    assert first["tokens_per_step"] == 256 and first["q_bar"] == 64.0
    with torch.no_grad(), bal.collecting():
        model(ids)
    second = bal.step()
    print(f"tiny K3, same batch: MaxVio {first['max_vio']:.3f} -> {second['max_vio']:.3f}")
    assert second["max_vio"] < first["max_vio"]
    for layer, old in zip(bal.layers, before):
        b = layer.gate.e_score_correction_bias
        assert b.dtype == torch.float32 and not b.requires_grad
        assert not torch.equal(b, old)
        assert abs(float(b.double().mean())) < 1e-7
    model.save_pretrained(tmp_path)
    loaded = K3ForCausalLM.from_pretrained(tmp_path)
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            assert torch.equal(loaded.get_parameter(name), p), name


# ---- two gloo ranks -----------------------------------------------------------------------------------------


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _dist_worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        # Synthetic layers: each rank routes its half of the same scores.
        model = fake_model(2, 16, 4)
        bal = Balancer(model, process_group=dist.group.WORLD)
        s = synthetic_scores(2048, 16, sigma_e=1.0, seed=11)
        with bal.collecting():
            for layer in model:
                layer(s.chunk(world)[rank])
        # Layer 1's bias sharded between steps as under FSDP2: the update must read and write it whole.
        mesh = init_device_mesh("cpu", (world,))
        b = model[1].gate.e_score_correction_bias
        sharded = distribute_tensor(b.detach(), mesh, [Shard(0)])
        model[1].gate.e_score_correction_bias = nn.Parameter(sharded, requires_grad=False)
        fake_metrics = bal.step()
        fake_biases = [model[0].gate.e_score_correction_bias.detach()]
        fake_biases.append(model[1].gate.e_score_correction_bias.full_tensor())
        # The tiny K3 model: each rank runs one micro-batch.
        k3 = K3ForCausalLM(K3Config.preset("tiny"))
        k3.init_random_weights(0)
        k3_bal = Balancer(k3, process_group=dist.group.WORLD)
        ids = torch.randint(0, 768, (4, 32), generator=torch.Generator().manual_seed(1))
        with torch.no_grad(), k3_bal.collecting():
            k3(ids.chunk(world)[rank])
        k3_metrics = k3_bal.step()
        k3_biases = [layer.gate.e_score_correction_bias.detach() for layer in k3_bal.layers]
        torch.save({"fake": fake_biases, "fake_metrics": fake_metrics, "k3": k3_biases, "k3_metrics": k3_metrics,
                    "k3_lo": k3_bal.lo, "k3_hi": k3_bal.hi}, os.path.join(out_dir, f"rank{rank}.pt"))  # fmt: skip
        # Both ranks done before either tears its gloo connections down: a rank that destroyed the group while its
        # peer's transport was still live aborted that peer at exit ("terminate called without an active
        # exception", about 1 run in 10).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_match_one_process():
    world = 2
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_dist_worker, args=(world, _free_port(), out_dir), nprocs=world, join=True)
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]
    for key in ("fake", "k3"):
        assert all(torch.equal(a, b) for a, b in zip(ranks[0][key], ranks[1][key])), key
    assert ranks[0]["k3_metrics"] == ranks[1]["k3_metrics"]
    # One process, the whole synthetic batch in one forward: bitwise identical (the bins are per token).
    model = fake_model(2, 16, 4)
    bal = Balancer(model)
    with bal.collecting():
        for layer in model:
            layer(synthetic_scores(2048, 16, sigma_e=1.0, seed=11))
    assert bal.step() == ranks[0]["fake_metrics"]
    assert all(torch.equal(a, b) for a, b in zip(biases(model), ranks[0]["fake"]))
    # One process, tiny K3: the two halves as two micro-batches are bitwise identical; one forward over the whole
    # batch routes the same tokens through differently shaped matmuls, so within one histogram bin.
    ids = torch.randint(0, 768, (4, 32), generator=torch.Generator().manual_seed(1))
    for micro_batches in (ids.chunk(world), [ids]):
        k3 = K3ForCausalLM(K3Config.preset("tiny"))
        k3.init_random_weights(0)
        w_L = [(hi - lo) / 1000 for lo, hi in zip(Balancer(k3).lo, Balancer(k3).hi)]
        k3_bal = Balancer(k3)
        for micro in micro_batches:
            with torch.no_grad(), k3_bal.collecting():
                k3(micro)
        metrics = k3_bal.step()
        got = [layer.gate.e_score_correction_bias.detach() for layer in k3_bal.layers]
        if len(micro_batches) == world:
            assert metrics == ranks[0]["k3_metrics"]
            assert all(torch.equal(a, b) for a, b in zip(got, ranks[0]["k3"]))
        else:
            diff = max(float((a - b).abs().max()) / w for a, b, w in zip(got, ranks[0]["k3"], w_L))
            print(f"tiny K3, 2 ranks vs one whole-batch forward: max bias difference {diff:.3g} bin widths")
            assert diff <= 1.0

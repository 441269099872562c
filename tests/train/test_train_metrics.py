"""MoE load metrics: loads, MaxVio, MinLoad, and the random-routing noise floor."""

from __future__ import annotations

import math

import torch

from openk3.train.metrics import (
    expert_loads,
    max_vio,
    min_load,
    random_routing_loads,
    random_routing_maxvio_floor,
)


def test_loads_maxvio_minload_on_the_fig5_routes():
    idx_Tk = torch.tensor([0, 1, 1, 2, 0, 0, 0, 1])[:, None]  # test_balance.FIG5_SCORES routed before the update
    loads_E = expert_loads(idx_Tk, 4)
    assert loads_E.tolist() == [4, 3, 1, 0]
    assert max_vio(loads_E, k=1, m=8) == 1.0  # 4 / q̄ − 1 with q̄ = 2
    assert min_load(loads_E, k=1, m=8) == 0.0
    balanced = torch.tensor([2, 2, 2, 2])
    assert max_vio(balanced, 1, 8) == 0.0 and min_load(balanced, 1, 8) == 1.0


def test_random_routing_picks_k_distinct_experts_per_token():
    gen = torch.Generator().manual_seed(0)
    loads_E = random_routing_loads(1000, 8, 3, gen, chunk=8 * 7)  # several chunks, one partial
    assert int(loads_E.sum()) == 3000
    idx_Tk = torch.rand(500, 8, generator=gen).topk(3, dim=-1).indices
    assert all(len(set(row)) == 3 for row in idx_Tk.tolist())


def test_random_floor_is_deterministic_and_scales_like_one_over_sqrt_q_bar():
    n, k = 8, 2
    f1 = random_routing_maxvio_floor(4096, n, k, trials=64, seed=0)
    assert f1 == random_routing_maxvio_floor(4096, n, k, trials=64, seed=0)
    f4 = random_routing_maxvio_floor(4 * 4096, n, k, trials=64, seed=1)
    assert 0.4 < f4 / f1 < 0.6  # noise ~ 1/√q̄: four times the tokens, half the floor
    # Gaussian estimate: loads ~ q̄ ± sqrt(q̄(1 − k/n)), max of 8 ≈ mean + 1.42 σ.
    q_bar = 4096 * k / n
    assert abs(f1 / (1.42 * math.sqrt((1 - k / n) / q_bar)) - 1) < 0.25
    assert random_routing_maxvio_floor(4096, n, k, trials=64, seed=0, num_layers=8) > f1  # max over layers


def test_each_evaluation_prints_one_line():
    """`k3 train` prints a line per evaluation (README: "evaluates every 50 steps and prints one line each time")."""
    from openk3.train.trainer import _eval_line, _print_above

    row = {"step": 50, "loss": 5.9, "val_loss": 5.8561, "unigram_loss": 5.77, "mqar_acc": 0.125, "needle_acc": 0.0}
    assert _eval_line(row) == "step 50: val_loss 5.856 (unigram 5.770), mqar 12%, needle 0%"
    assert _eval_line({"step": 3, "val_loss": 1.0}) == "step 3: val_loss 1.000"
    lines = []
    _print_above(object(), lines.append, "x")  # no bar (another rank, --no-progress): the trainer's log
    written = []

    class Bar:
        def write(self, line):
            written.append(line)

    _print_above(Bar(), print, "y")  # above the progress bar, which tqdm redraws below it
    assert lines == ["x"] and written == ["y"]

"""MoE load metrics: expert loads, MaxVio, MinLoad, and the noise floor that perfectly balanced random routing shows at
a given number of tokens per step.

    q̄        = m·k/n                        target load per expert for m tokens, n experts, k experts per token
    MaxVio   = max_j load_j / q̄ − 1          over one step's global batch (MaxVio_batch; Wang et al. 2024)
    MinLoad  = min_j load_j / q̄

Per-batch noise is about 1/√q̄, so a balance target must be stated against the floor measured at the same tokens per
step: `random_routing_maxvio_floor`.

Legend: T tokens, E experts (= n), k experts per token, L MoE layers.
"""

from __future__ import annotations

import torch


def expert_loads(idx_Tk: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert: int64 [E] (no capacity factor, so nothing is dropped)."""
    return torch.bincount(idx_Tk.reshape(-1), minlength=num_experts)


def max_vio(loads_E: torch.Tensor, k: int, m: int) -> float:
    """MaxVio = max load / q̄ − 1 with q̄ = m·k/n; 0 for a perfectly balanced step."""
    q_bar = m * k / loads_E.numel()
    return float(loads_E.max()) / q_bar - 1.0


def min_load(loads_E: torch.Tensor, k: int, m: int) -> float:
    """MinLoad = min load / q̄; 1 for a perfectly balanced step, 0 when an expert got no token."""
    q_bar = m * k / loads_E.numel()
    return float(loads_E.min()) / q_bar


def random_routing_loads(
    tokens: int, num_experts: int, k: int, generator: torch.Generator, chunk: int = 1 << 22
) -> torch.Tensor:
    """Loads [E] when each of `tokens` tokens picks k distinct experts uniformly at random (the top-k of i.i.d.
    uniform keys is a uniform k-subset). Chunked so that large m·n stays within a few MB."""
    loads_E = torch.zeros(num_experts, dtype=torch.int64)
    rows = max(1, chunk // num_experts)
    for start in range(0, tokens, rows):
        keys_TE = torch.rand(min(rows, tokens - start), num_experts, generator=generator)
        loads_E += expert_loads(keys_TE.topk(k, dim=-1).indices, num_experts)
    return loads_E


def random_routing_maxvio_floor(
    tokens_per_step: int, num_experts: int, k: int, trials: int = 32, seed: int = 0, num_layers: int = 1
) -> float:
    """Mean MaxVio of perfectly balanced *random* routing at `tokens_per_step` tokens: the per-batch noise floor no
    balancer can beat on fresh batches. With num_layers = L each trial takes the max over L independent layers,
    which is the floor to compare `Balancer.step()["max_vio"]` (a max over L layers) against; num_layers = 1 is the
    floor for one layer's MaxVio."""
    if not 0 < k < num_experts:
        raise ValueError(f"need 0 < k < num_experts, got k={k}, num_experts={num_experts}")
    gen = torch.Generator().manual_seed(seed)
    total = 0.0
    for _ in range(trials):
        total += max(
            max_vio(random_routing_loads(tokens_per_step, num_experts, k, gen), k, tokens_per_step)
            for _ in range(num_layers)
        )
    return total / trials


def tower_grad_norm(model) -> torch.Tensor:
    """The vision tower's gradient norm (the report's stability signal), fp64, on the gradients' device."""
    sq = torch.zeros((), dtype=torch.float64)
    for p in model.vision_tower.parameters():
        if p.grad is not None:
            sq = sq.to(p.grad.device) + p.grad.double().pow(2).sum()
    return sq.sqrt()

"""GRPO group advantages: each sample's reward against its group's (the same task's other samples').

Legend: S samples, G prompt groups.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards_S: Tensor, group_S: Tensor, normalize_std: bool = False, eps: float = 1e-6) -> Tensor:
    """GRPO advantages: each reward minus its group's mean, optionally divided by the group's std + eps. The std is
    the unbiased one (torch.std's default, as in verl and slime). A group of one sample gets 0: nothing to compare."""
    rewards_S = rewards_S.float()
    _, gid_S = torch.unique(group_S, return_inverse=True)  # group ids need not be contiguous
    num_groups = int(gid_S.max()) + 1 if gid_S.numel() else 0
    count_G = rewards_S.new_zeros(num_groups).index_add_(0, gid_S, torch.ones_like(rewards_S))
    mean_G = rewards_S.new_zeros(num_groups).index_add_(0, gid_S, rewards_S) / count_G
    adv_S = rewards_S - mean_G[gid_S]
    if normalize_std:
        sq_G = rewards_S.new_zeros(num_groups).index_add_(0, gid_S, adv_S.square())
        std_G = (sq_G / (count_G - 1).clamp(min=1)).sqrt()
        adv_S = adv_S / (std_G[gid_S] + eps)
    return torch.where(count_G[gid_S] > 1, adv_S, 0.0)

"""Optimizer parameter groups and learning-rate schedules.

Groups (spec/balancing.md §6): matrices (projections, experts, embeddings, LM head) get weight decay; vectors and
scalars (norm gains, AttnRes pseudo-queries, A_log, dt_bias, conv kernels) get none. The router's
`e_score_correction_bias` is not an optimizer parameter at all: load balancing overwrites it.

Schedules: warmup-stable-decay (linear warmup, constant, linear decay to min_lr over the final fraction) and
cosine (linear warmup, cosine to min_lr). Both are pure functions of the step, so a resumed run needs no
scheduler state beyond the step counter.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from openk3.train.config import TrainConfig

_NO_DECAY_SUFFIXES = ("A_log", "dt_bias", "conv1d.weight", "_res_proj.weight")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.dim() < 2 or name.endswith(_NO_DECAY_SUFFIXES) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    # foreach=False keeps the update order fixed so resumed and uninterrupted runs match bit for bit.
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=1e-8, foreach=False)  # fmt: skip


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    warm = cfg.warmup_steps
    if step < warm:
        return peak * (step + 1) / warm
    if cfg.schedule == "cosine":
        progress = (step - warm) / max(1, cfg.steps - warm)
        return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    decay_steps = max(1, int(round(cfg.decay_fraction * cfg.steps)))
    decay_start = cfg.steps - decay_steps
    if step < decay_start:
        return peak
    return peak + (floor - peak) * min(1.0, (step - decay_start + 1) / decay_steps)

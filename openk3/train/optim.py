"""Optimizer parameter groups and learning-rate schedules.

Groups: matrices (projections, experts, embeddings, LM head) get weight decay; vectors and scalars (norm gains, AttnRes
pseudo-queries, A_log, dt_bias, conv kernels) get none. The router's `e_score_correction_bias` is not an optimizer
parameter at all: load balancing overwrites it.

`--optimizer muon` (one process only): torch.optim.Muon (momentum 0.95, Nesterov, 5 Newton–Schulz steps, and
Moonshot's `match_rms_adamw` learning-rate scaling, so the AdamW learning rate carries over) for the 2-D weights of
the decoder layers, AdamW for everything else: embeddings, LM head, the router, the AttnRes pseudo-queries, the
3-D routed-expert tensors and all vectors (Muon is defined for matrices; Moonshot keeps embeddings and head on
AdamW). `MuonWithAdamW` presents the pair as one optimizer to the trainer and the checkpoint code.

Schedules: warmup-stable-decay (linear warmup, constant, linear decay to min_lr over the final fraction) and
cosine (linear warmup, cosine to min_lr). Both are pure functions of the step, so a resumed run needs no
scheduler state beyond the step counter.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from openk3.model.hf import VISION_PREFIXES
from openk3.train.config import TrainConfig

_NO_DECAY_SUFFIXES = ("A_log", "dt_bias", "conv1d.weight", "_res_proj.weight")


def param_groups(model: nn.Module, weight_decay: float, vision_lr_scale: float = 1.0) -> list[dict]:
    """[decay, no_decay] groups, and with `vision_lr_scale` != 1 the same two for the tower and projector, each
    group carrying `lr_scale` (the trainer sets a group's lr to lr_at(step) * lr_scale; empty groups dropped)."""
    groups: dict[tuple[bool, bool], list] = {(v, d): [] for v in (False, True) for d in (True, False)}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        vision = vision_lr_scale != 1.0 and name.startswith(VISION_PREFIXES)
        groups[vision, not (p.dim() < 2 or name.endswith(_NO_DECAY_SUFFIXES))].append(p)
    return [{"params": params, "weight_decay": weight_decay if decay else 0.0,
             "lr_scale": vision_lr_scale if vision else 1.0}
            for (vision, decay), params in groups.items() if params or not vision]  # fmt: skip


_ADAMW_MATRICES = ("gate.weight", "_res_proj.weight")  # the router and the AttnRes pseudo-queries


def is_muon_param(name: str, p: torch.Tensor) -> bool:
    """A hidden-layer matrix: 2-D, inside the decoder layers, not the router or an AttnRes pseudo-query."""
    return p.dim() == 2 and ".layers." in f".{name}" and not name.endswith(_ADAMW_MATRICES)


def build_optimizer(model: nn.Module, cfg: TrainConfig):
    # foreach=False keeps the update order fixed so resumed and uninterrupted runs match bit for bit.
    scale = cfg.vision_lr / cfg.lr if cfg.vision_lr is not None else 1.0
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(param_groups(model, cfg.weight_decay, scale), lr=cfg.lr,
                                 betas=(cfg.beta1, cfg.beta2), eps=1e-8, foreach=False)  # fmt: skip
    muon = [p for name, p in model.named_parameters() if p.requires_grad and is_muon_param(name, p)]
    chosen = {id(p) for p in muon}
    rest = [group | {"params": [p for p in group["params"] if id(p) not in chosen]}
            for group in param_groups(model, cfg.weight_decay, scale)]  # fmt: skip
    return MuonWithAdamW(muon, rest, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(cfg.beta1, cfg.beta2))


class MuonWithAdamW:
    """torch.optim.Muon over `muon_params` and torch.optim.AdamW over `adamw_groups`, as one optimizer.

    `param_groups` is the Muon groups followed by the AdamW groups (the inner optimizers' own dicts, so setting a
    group's "lr" reaches them). `state_dict()` has the layout of a torch optimizer's: parameters are numbered Muon first,
    then AdamW, and each group carries "optimizer": "muon" | "adamw" so that `load_state_dict` can split it back.
    """

    def __init__(self, muon_params, adamw_groups, lr: float, weight_decay: float, betas: tuple[float, float]):
        if not muon_params:
            raise ValueError("--optimizer muon found no hidden-layer matrix to optimize")
        self.muon = torch.optim.Muon(muon_params, lr=lr, weight_decay=weight_decay, momentum=0.95, nesterov=True,
                                     adjust_lr_fn="match_rms_adamw")  # fmt: skip
        self.adamw = torch.optim.AdamW([g for g in adamw_groups if g["params"]], lr=lr, betas=betas, eps=1e-8,
                                       foreach=False)  # fmt: skip

    @property
    def param_groups(self) -> list[dict]:
        # Built on every access: load_state_dict replaces the inner optimizers' group dicts.
        return self.muon.param_groups + self.adamw.param_groups

    @torch.no_grad()
    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        muon, adamw = self.muon.state_dict(), self.adamw.state_dict()
        shift = sum(len(g["params"]) for g in muon["param_groups"])
        state = dict(muon["state"]) | {i + shift: s for i, s in adamw["state"].items()}
        groups = [g | {"optimizer": "muon"} for g in muon["param_groups"]]
        groups += [
            g | {"optimizer": "adamw", "params": [i + shift for i in g["params"]]} for g in adamw["param_groups"]
        ]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        kinds = [g.get("optimizer") for g in state_dict["param_groups"]]
        if set(kinds) != {"muon", "adamw"}:
            raise ValueError(f"not a Muon + AdamW optimizer state (group kinds {sorted(set(map(str, kinds)))}); was the "
                             "run started with --optimizer adamw?")  # fmt: skip
        parts = {}
        for kind in ("muon", "adamw"):
            groups = [{k: v for k, v in g.items() if k != "optimizer"} for g in state_dict["param_groups"]
                      if g["optimizer"] == kind]  # fmt: skip
            ids = {i for g in groups for i in g["params"]}
            base = min(ids) if ids else 0
            parts[kind] = {
                "state": {int(i) - base: s for i, s in state_dict["state"].items() if int(i) in ids},
                "param_groups": [g | {"params": [i - base for i in g["params"]]} for g in groups],
            }
        self.muon.load_state_dict(parts["muon"])
        self.adamw.load_state_dict(parts["adamw"])


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    warm = cfg.warmup_steps
    if step < warm:
        return peak * (step + 1) / warm
    if cfg.schedule == "cosine":
        progress = (step - warm) / max(1, cfg.steps - warm)
        return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    decay_steps = max(1, round(cfg.decay_fraction * cfg.steps))
    return stable_then_decay(step, peak, floor, cfg.steps, decay_steps)


def stable_then_decay(step: int, peak: float, floor: float, steps: int, decay_steps: int) -> float:
    """The rate of step `step` (0-based) of `steps`: `peak`, then linear over the final `decay_steps` so that the
    last step runs at `floor` (the stable and decay phases of warmup-stable-decay; `k3 rl --lr-decay-steps` uses it
    alone)."""
    decay_start = steps - decay_steps
    if decay_steps <= 0 or step < decay_start:
        return peak
    return peak + (floor - peak) * min(1.0, (step - decay_start + 1) / decay_steps)

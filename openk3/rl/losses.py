"""RL policy losses on packed tokens: GRPO group advantages, the PPO / CISPO / Kimi k1.5 mirror-descent / REINFORCE
policy terms, the TIS and IcePop off-policy corrections between the trainer's and the rollout engine's log-probs, and
an optional k3 KL to a reference model (spec/rl.md §2-3).

Per-token tensors are packed over the loss tokens of many sequences: `seq_T` gives each token's sequence (0..S-1),
`mask_T` marks the tokens that count (generated tokens; tool and observation tokens are False). Log-ratios are tested
in log space, and every value that must not count is replaced with torch.where *before* any arithmetic: a where applied
afterwards still sends 0 * inf = NaN through the backward (spec/rl.md §4, "IcePop/TIS producing NaN at ±inf ratios").

Legend: T packed loss tokens, S sequences (rollout samples), G prompt groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

KINDS = ("ppo", "cispo", "k15", "reinforce")
AVERAGES = ("token", "sequence")
CORRECTIONS = (None, "tis", "icepop")
# Log-ratios are clamped to ±20 before exp (as verl does): a finite but huge ratio would overflow fp32 to inf, and
# the zero gradient of a clipped PPO branch times inf is NaN.
MAX_LOG_RATIO = 20.0


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


@dataclass
class LossConfig:
    """Which policy loss, how it is averaged, and which off-policy correction (spec/rl.md §3 defaults).

    kind: "ppo" (asymmetric clip, slime/Miles eps 0.2/0.28), "cispo" (MiniMax-M1: the importance weight is clipped
    from above at 1 + cispo_eps_high and stop-gradiented; no lower clip, as in the paper, which sets eps_low_IS large),
    "k15" (Kimi k1.5 mirror descent; sequence-level by construction, so `average` does not apply to it), "reinforce".
    correction: "tis" multiplies each token's loss by min(exp(old - rollout), tis_cap); "icepop" drops tokens whose
    exp(old - rollout) is outside [icepop_low, icepop_high]. "tis" is refused for "k15": its quadratic term is over
    whole-sequence log-prob sums, where a per-token weight has no defined place.
    """

    kind: str = "ppo"
    eps_low: float = 0.2
    eps_high: float = 0.28
    cispo_eps_high: float = 5.0
    tau: float = 0.1
    average: str = "token"
    correction: str | None = None
    tis_cap: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    kl_coef: float = 0.0

    def __post_init__(self):
        for name, allowed in (("kind", KINDS), ("average", AVERAGES), ("correction", CORRECTIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"LossConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not 0 <= self.eps_low < 1:
            raise ValueError(f"LossConfig.eps_low must be in [0, 1), got {self.eps_low}")
        for name in ("eps_high", "kl_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"LossConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("cispo_eps_high", "tau", "tis_cap"):
            if getattr(self, name) <= 0:
                raise ValueError(f"LossConfig.{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.icepop_low <= 1:
            raise ValueError(f"LossConfig.icepop_low must be in (0, 1], got {self.icepop_low}")
        if self.icepop_high < 1:
            raise ValueError(f"LossConfig.icepop_high must be >= 1, got {self.icepop_high}")
        if self.kind == "k15" and self.correction == "tis":
            raise ValueError("LossConfig.correction='tis' is undefined for kind='k15' (use 'icepop' or None)")


def _seq_sum(x_T: Tensor, seq_T: Tensor, num_seqs: int) -> Tensor:
    return x_T.new_zeros(num_seqs).index_add(0, seq_T, x_T)


def policy_loss(
    logp_T: Tensor,
    old_logp_T: Tensor,
    advantages_T: Tensor,
    mask_T: Tensor,
    seq_T: Tensor,
    cfg: LossConfig,
    rollout_logp_T: Tensor | None = None,
    ref_logp_T: Tensor | None = None,
    normalizers: tuple[int, int] | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The scalar policy loss (fp32) and python-float metrics.

    logp_T: current policy (carries the gradient); old_logp_T: the proximal policy the ratio is taken against;
    rollout_logp_T: the rollout engine's behaviour log-probs, needed by a correction; ref_logp_T: the reference model,
    for the KL term when cfg.kl_coef > 0. "token" averaging divides the kept tokens' sum by the number of mask tokens,
    so IcePop-dropped tokens lower the step rather than renormalising it; "sequence" averages each sequence's token mean
    over the sequences with at least one mask token. A mask token whose old log-prob is not finite defines no ratio and
    is dropped the same way. Metrics: loss, ratio_mean, clip_fraction (ppo/cispo), tis_weight_mean,
    icepop_masked_fraction, kl (when present), all over mask tokens.

    `normalizers` = (mask tokens, sequences with a mask token) of a larger batch this one is a micro-batch of (whole
    sequences only): the loss then divides by those totals instead of its own, so the micro-batches' losses sum to
    the whole batch's loss and their gradients accumulate to its gradient. The metrics stay this call's own.
    """
    if cfg.correction is not None and rollout_logp_T is None:
        raise ValueError(f"LossConfig.correction={cfg.correction!r} needs rollout_logp_T")
    mask_T = mask_T.bool()
    n_mask = mask_T.sum()
    n_mask_f = n_mask.clamp(min=1).float()
    num_seqs = int(seq_T.max()) + 1 if seq_T.numel() else 0
    # What the loss divides by: this batch's mask tokens and sequences with a mask token, or a larger batch's.
    if normalizers is None:
        loss_tokens = n_mask_f
        loss_seqs = (_seq_sum(mask_T.float(), seq_T, num_seqs) > 0).sum().clamp(min=1).float()
    else:
        loss_tokens, loss_seqs = (torch.tensor(float(max(n, 1))) for n in normalizers)
    old_T = old_logp_T.detach().float()
    keep_T = mask_T & torch.isfinite(old_T)
    metrics: dict[str, float] = {}

    weight_T = None
    if cfg.correction is not None:
        lr_T = old_T - rollout_logp_T.detach().float()
        if cfg.correction == "icepop":
            # NaN compares False both ways, so NaN and ±inf log-ratios fall outside the band.
            inband_T = (lr_T >= math.log(cfg.icepop_low)) & (lr_T <= math.log(cfg.icepop_high))
            metrics["icepop_masked_fraction"] = ((mask_T & ~inband_T).sum() / n_mask_f).item()
            keep_T = keep_T & inband_T
        else:
            # NaN -> weight 0; +inf -> the cap; -inf -> exp(-inf) = 0; all without an inf reaching the loss.
            lr_T = torch.where(torch.isnan(lr_T), -math.inf, lr_T)
            weight_T = torch.exp(lr_T.clamp(max=math.log(cfg.tis_cap)))
            metrics["tis_weight_mean"] = (torch.where(mask_T, weight_T, 0.0).sum() / n_mask_f).item()

    # Dropped tokens become logp = old = A = 0, so every kind's per-token loss there is exactly 0 and finite.
    live_logp_T = torch.where(keep_T, logp_T.float(), 0.0)
    old_T = torch.where(keep_T, old_T, 0.0)
    adv_T = torch.where(keep_T, advantages_T.detach().float(), 0.0)
    ratio_T = torch.exp((live_logp_T - old_T).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    metrics["ratio_mean"] = (torch.where(keep_T, ratio_T, 0.0).sum() / keep_T.sum().clamp(min=1)).item()

    if cfg.kind == "k15":
        loss = _mirror_descent(live_logp_T, old_T, advantages_T, mask_T, seq_T, num_seqs, cfg.tau) / loss_seqs
    else:
        if cfg.kind == "ppo":
            clipped_ratio_T = ratio_T.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
            loss_T = torch.maximum(-ratio_T * adv_T, -clipped_ratio_T * adv_T)
            # The clipped branch wins (zero gradient) when the ratio has left the band in the advantage's direction.
            clipped_T = ((adv_T > 0) & (ratio_T > 1 + cfg.eps_high)) | ((adv_T < 0) & (ratio_T < 1 - cfg.eps_low))
        elif cfg.kind == "cispo":
            clipped_T = ratio_T > 1 + cfg.cispo_eps_high
            weight_is_T = ratio_T.clamp(max=1 + cfg.cispo_eps_high).detach()
            loss_T = -weight_is_T * adv_T * live_logp_T
        else:
            clipped_T = None
            loss_T = -adv_T * live_logp_T
        if clipped_T is not None:
            metrics["clip_fraction"] = ((clipped_T & keep_T).sum() / n_mask_f).item()
        if weight_T is not None:
            loss_T = loss_T * weight_T
        if cfg.average == "token":
            loss = loss_T.sum() / loss_tokens
        else:
            count_S = _seq_sum(mask_T.float(), seq_T, num_seqs)
            per_seq_S = _seq_sum(loss_T, seq_T, num_seqs) / count_S.clamp(min=1)
            loss = per_seq_S.sum() / loss_seqs

    if ref_logp_T is not None and cfg.kl_coef > 0:
        # k3 estimator of KL(pi || ref) over mask tokens (Schulman's "approximating KL"); unbiased and >= 0.
        diff_T = torch.where(mask_T, ref_logp_T.detach().float(), 0.0) - torch.where(mask_T, logp_T.float(), 0.0)
        diff_T = diff_T.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        kl_sum = (torch.exp(diff_T) - diff_T - 1).sum()
        kl = kl_sum / n_mask_f
        loss = loss + cfg.kl_coef * kl_sum / loss_tokens
        metrics["kl"] = kl.item()
    metrics["loss"] = loss.item()
    return loss, metrics


def _mirror_descent(
    logp_T: Tensor, old_T: Tensor, advantages_T: Tensor, mask_T: Tensor, seq_T: Tensor, num_seqs: int, tau: float
) -> Tensor:
    """Kimi k1.5 online mirror descent (arXiv 2501.12599, spec/rl.md §2): per sequence j, with S_j and S_old_j the sums
    of the kept tokens' log-probs, L_j = -(A_j S_j - tau/2 (S_j - S_old_j)^2), averaged over the sequences that have a
    mask token (the caller divides the sum returned here by their count). A_j is the advantage at the sequence's first
    mask token (it is a sequence-level quantity broadcast)."""
    sum_S = _seq_sum(logp_T, seq_T, num_seqs)
    old_sum_S = _seq_sum(old_T, seq_T, num_seqs)
    num_tokens = logp_T.numel()
    idx_T = torch.arange(num_tokens, device=logp_T.device)
    first_S = torch.full((num_seqs,), num_tokens, device=logp_T.device, dtype=torch.long)
    first_S = first_S.scatter_reduce(0, seq_T[mask_T], idx_T[mask_T], "amin")
    # Index num_tokens is a padding 0 for sequences without mask tokens; unmasked advantages may be anything.
    adv_pad_T = torch.cat([torch.where(mask_T, advantages_T.detach().float(), 0.0), logp_T.new_zeros(1)])
    adv_S = adv_pad_T[first_S]
    loss_S = -(adv_S * sum_S - 0.5 * tau * (sum_S - old_sum_S).square())
    return loss_S.sum()

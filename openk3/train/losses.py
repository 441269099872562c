"""The one loss registry: every kind of training computes its loss here, from the model's scores on a packed batch
and the batch's per-token fields (train/batch.py), so one training core (train/core.py) serves them all.

    lm         summed cross-entropy over the loss-mask tokens: pre-training, SFT, copy pre-training, off-policy
               distillation on teacher samples (`token_weight_T` weighs tokens, e.g. each teacher key alike)
    ppo        asymmetric clipped ratio (slime/Miles eps 0.2 / 0.28)
    cispo      MiniMax-M1: the importance weight clipped from above and stop-gradiented
    k15        Kimi k1.5 online mirror descent (sequence level)
    reinforce  -A log p
    opd        K3's multi-teacher on-policy distillation reward (report Eq. 15) as a dense per-token reward added to
               the advantage inside `cfg.kind`'s policy loss: A_t + opd_weight * clip(sg(log p_teacher - log p), ±r_max)
    topk_kl    forward KL from the teacher's renormalised top-k next-token distribution to the policy

The policy losses take the TIS or IcePop correction between the trainer's and the rollout engine's log-probs and an
optional k3 KL to a reference model. A new loss is one function and one `@register_loss("name")` line.

A loss is `fn(scores, batch, cfg, norm) -> (scalar loss, metrics)`: `scores` the model's output on `batch` (logits, or
log-probs of the targets), `cfg` the LossConfig, `norm` the step's totals (`Normalizers`: loss tokens and sequences
over every micro-batch and rank), which the loss divides by, so micro-batches' and ranks' losses add up to the one
forward's loss and their gradients to its gradient.

Per-token tensors are packed: `seq_T` gives each position's sequence (0..S-1), `mask_T` marks the positions that count
(generated tokens; tool and observation tokens are False). Log-ratios are tested in log space, and every value that
must not count is replaced with torch.where *before* any arithmetic: a where applied afterwards still sends
0 * inf = NaN through the backward (IcePop/TIS with ratios at ±inf).

Legend: T packed positions (position t scores token t + 1), S sequences, V vocabulary, k top-k entries.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import Tensor

from openk3.data.packing import IGNORE_INDEX

KINDS = ("ppo", "cispo", "k15", "reinforce")
AVERAGES = ("token", "sequence")
CORRECTIONS = (None, "tis", "icepop")
# Log-ratios are clamped to ±20 before exp (as verl does): a finite but huge ratio would overflow fp32 to inf, and
# the zero gradient of a clipped PPO branch times inf is NaN.
MAX_LOG_RATIO = 20.0


@dataclass
class LossConfig:
    """Which policy loss, how it is averaged, and which off-policy correction (the defaults of K3's open RL stacks).

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
    opd_weight: float = 1.0  # opd: the weight of the per-token reward in the advantage
    r_max: float = 5.0  # opd: the reward's clip

    def __post_init__(self):
        for name, allowed in (("kind", KINDS), ("average", AVERAGES), ("correction", CORRECTIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"LossConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not 0 <= self.eps_low < 1:
            raise ValueError(f"LossConfig.eps_low must be in [0, 1), got {self.eps_low}")
        for name in ("eps_high", "kl_coef", "opd_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"LossConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("cispo_eps_high", "tau", "tis_cap", "r_max"):
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


@dataclass
class SequenceView:
    """How packed positions group into sequences, for the losses' per-sequence terms. On one rank a batch holds
    whole sequences. On a context-parallel shard it holds pieces: `reduce` turns the pieces' per-sequence sums into
    the whole sequences' (an all-reduce through autograd), `replicas` ranks then hold the same per-sequence value
    (a term built from it is divided by `replicas`, so the ranks' losses still add up to the whole batch's), and
    `first_T` marks each sequence's first loss position, which a piece cannot find alone."""

    seq_T: Tensor
    num: int
    reduce: Callable[[Tensor], Tensor] | None = None
    replicas: int = 1
    first_T: Tensor | None = None

    @classmethod
    def of(cls, batch, device: torch.device) -> SequenceView:
        """The view of a TokenBatch (train/batch.py), whole or a context-parallel shard."""
        num = len(batch.lengths) if batch.num_sequences is None else batch.num_sequences
        reduce = None if batch.context_parallel is None else batch.reduce_sequences
        return cls(batch.seq_T.to(device), num, reduce, batch.replicas, batch.first_mask_T)

    def sum(self, x_T: Tensor) -> Tensor:
        """[S] the whole sequences' sums of `x_T`."""
        out = _seq_sum(x_T, self.seq_T, self.num)
        return out if self.reduce is None else self.reduce(out)


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
    sequences: SequenceView | None = None,
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
    `sequences`: how the positions group into sequences when `seq_T` alone does not say it (a context-parallel
    shard's pieces); the per-sequence terms ("sequence" averaging, k15) then take the whole sequences' sums.
    """
    if cfg.correction is not None and rollout_logp_T is None:
        raise ValueError(f"LossConfig.correction={cfg.correction!r} needs rollout_logp_T")
    mask_T = mask_T.bool()
    n_mask = mask_T.sum()
    n_mask_f = n_mask.clamp(min=1).float()
    seqs = sequences or SequenceView(seq_T, int(seq_T.max()) + 1 if seq_T.numel() else 0)
    # What the loss divides by: this batch's mask tokens and sequences with a mask token, or a larger batch's.
    if normalizers is None:
        if seqs.reduce is not None:
            raise ValueError("a context-parallel shard's loss divides by the whole batch's totals: pass normalizers")
        loss_tokens = n_mask_f
        loss_seqs = (seqs.sum(mask_T.float()) > 0).sum().clamp(min=1).float()
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
        loss = _mirror_descent(live_logp_T, old_T, advantages_T, mask_T, seqs, cfg.tau) / (loss_seqs * seqs.replicas)
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
            # Linear in each piece's sum, so a shard adds its pieces' share; only the counts are the whole's.
            count_S = seqs.sum(mask_T.float())
            per_seq_S = _seq_sum(loss_T, seqs.seq_T, seqs.num) / count_S.clamp(min=1)
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


def _mirror_descent(logp_T: Tensor, old_T: Tensor, advantages_T: Tensor, mask_T: Tensor, seqs: SequenceView,
                    tau: float) -> Tensor:  # fmt: skip
    """Kimi k1.5 online mirror descent (arXiv 2501.12599): per sequence j, with S_j and S_old_j the sums
    of the kept tokens' log-probs, L_j = -(A_j S_j - tau/2 (S_j - S_old_j)^2), averaged over the sequences that have a
    mask token (the caller divides the sum returned here by their count). A_j is the advantage at the sequence's first
    mask token (it is a sequence-level quantity broadcast)."""
    sum_S = seqs.sum(logp_T)
    old_sum_S = seqs.sum(old_T)
    if seqs.first_T is None:
        num_tokens = logp_T.numel()
        idx_T = torch.arange(num_tokens, device=logp_T.device)
        first_S = torch.full((seqs.num,), num_tokens, device=logp_T.device, dtype=torch.long)
        first_S = first_S.scatter_reduce(0, seqs.seq_T[mask_T], idx_T[mask_T], "amin")
        # Index num_tokens is a padding 0 for sequences without mask tokens; unmasked advantages may be anything.
        adv_pad_T = torch.cat([torch.where(mask_T, advantages_T.detach().float(), 0.0), logp_T.new_zeros(1)])
        adv_S = adv_pad_T[first_S]
    else:  # one term per sequence, on the piece that holds its first mask position: an exact sum
        adv_S = seqs.sum(torch.where(seqs.first_T & mask_T, advantages_T.detach().float(), 0.0))
    loss_S = -(adv_S * sum_S - 0.5 * tau * (sum_S - old_sum_S).square())
    return loss_S.sum()


# ---- the registry ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Normalizers:
    """What a step's loss divides by, counted over the whole step (every micro-batch, every rank): loss-mask tokens,
    and sequences with at least one of them."""

    tokens: int
    sequences: int


class Scores:
    """The model's output on a packed batch, as a loss reads it: `logits_TV` (raw), `logp_TV` = log softmax of the
    fp32 logits, `logp_T` = the targets' log-probs. Built from logits by the training core, or from detached `logp_T`
    alone for whole-step metrics."""

    def __init__(self, targets_T: Tensor, logits_TV: Tensor | None = None, logp_T: Tensor | None = None):
        self.targets_T, self.logits_TV = targets_T, logits_TV
        if logp_T is not None:
            self.__dict__["logp_T"] = logp_T

    @cached_property
    def logp_TV(self) -> Tensor:
        return torch.log_softmax(self.logits_TV.float() / 1.0, dim=-1)  # / 1.0: the rollout's temperature-1 op order

    @cached_property
    def logp_T(self) -> Tensor:
        return self.logp_TV.gather(-1, self.targets_T[:, None]).squeeze(-1)


LossFn = Callable[..., "tuple[Tensor, dict[str, float]]"]
LOSSES: dict[str, LossFn] = {}
WHOLE_STEP_METRICS: set[str] = set()  # losses whose metrics are recomputed over the whole step's detached log-probs


def register_loss(name: str, whole_step_metrics: bool = False):
    """`@register_loss("name")` adds `fn(scores, batch, cfg, norm) -> (loss, metrics)` to the registry.
    `whole_step_metrics`: its metrics (ratios, clip fractions) are means over the whole step, so the core computes
    them once more over the step's detached log-probs rather than summing micro-batches'."""

    def add(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(f"loss {name!r} is registered twice")
        LOSSES[name] = fn
        if whole_step_metrics:
            WHOLE_STEP_METRICS.add(name)
        return fn

    return add


def get_loss(name: str) -> LossFn:
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; registered: {sorted(LOSSES)}")
    return LOSSES[name]


def lm_loss_sum(logits_TV: Tensor, labels_T: Tensor) -> Tensor:
    """Sum of per-token cross-entropy (fp32) over positions whose label is not -100."""
    return F.cross_entropy(logits_TV.float(), labels_T, ignore_index=IGNORE_INDEX, reduction="sum")


@register_loss("lm")
def lm_loss(scores: Scores, batch, cfg: LossConfig, norm: Normalizers):
    """Cross-entropy over the loss-mask tokens / the step's loss tokens; with a `token_weight_T` field, the
    weighted sum instead (the weights already normalise)."""
    labels_T = torch.where(batch.loss_mask_T, batch.targets_T, IGNORE_INDEX)
    weight_T = batch.fields.get("token_weight_T")
    if weight_T is None:
        loss = lm_loss_sum(scores.logits_TV, labels_T) / max(norm.tokens, 1)
    else:
        ce_T = F.cross_entropy(scores.logits_TV.float(), labels_T, ignore_index=IGNORE_INDEX, reduction="none")
        loss = (ce_T * weight_T).sum()
    return loss, {}


def _policy(scores: Scores, batch, cfg: LossConfig, norm: Normalizers, advantages_T: Tensor):
    f, seqs = batch.fields, SequenceView.of(batch, scores.logp_T.device)
    return policy_loss(scores.logp_T, scores.logp_T.detach(), advantages_T, batch.loss_mask_T, seqs.seq_T, cfg,
                       rollout_logp_T=f.get("behaviour_logp_T"), ref_logp_T=f.get("reference_logp_T"),
                       normalizers=(norm.tokens, norm.sequences), sequences=seqs)  # fmt: skip


def _register_policy(kind: str) -> None:
    @register_loss(kind, whole_step_metrics=True)
    def loss(scores, batch, cfg, norm):
        return _policy(scores, batch, replace(cfg, kind=kind), norm, batch.fields["advantages_T"])


for _kind in KINDS:
    _register_policy(_kind)


def opd_reward(teacher_logp_T: Tensor, student_logp_T: Tensor, r_max: float) -> Tensor:
    """K3 Eq. 15: clip(sg(log p_teacher - log p_student), -r_max, r_max), per token (fp32, no gradient)."""
    if r_max <= 0:
        raise ValueError(f"r_max must be positive, got {r_max}")
    diff_T = teacher_logp_T.detach().float() - student_logp_T.detach().float()
    return diff_T.clamp(-r_max, r_max)


@register_loss("opd", whole_step_metrics=True)
def opd_loss(scores: Scores, batch, cfg: LossConfig, norm: Normalizers):
    """`cfg.kind`'s policy loss with the advantage A_t + opd_weight * r_opd(y_t) on the mask tokens. The fields
    `teacher_logp_T` and `student_logp_T` are the teacher's and the student's log-probs of each token, scored in
    no-grad forwards batched alike (so a teacher with the student's weights gives a reward of exactly 0)."""
    f, mask_T = batch.fields, batch.loss_mask_T
    r_T = opd_reward(f["teacher_logp_T"], f["student_logp_T"], cfg.r_max)
    adv_T = f["advantages_T"] + cfg.opd_weight * torch.where(mask_T, r_T, 0.0)
    loss, metrics = _policy(scores, batch, cfg, norm, adv_T)
    n = max(int(mask_T.sum()), 1)
    metrics["opd_reward"] = float(r_T[mask_T].sum()) / n
    metrics["reverse_kl"] = -metrics["opd_reward"]  # the per-token estimate E[log p_student - log p_teacher]
    metrics["opd_clip_fraction"] = float((r_T[mask_T].abs() >= cfg.r_max).sum()) / n
    return loss, metrics


@register_loss("topk_kl")
def topk_kl_loss(scores: Scores, batch, cfg: LossConfig, norm: Normalizers):
    """KL(q || p) per mask token, q the teacher's top-k probabilities (`teacher_topk_probs_Tk`, renormalised, at
    `teacher_topk_ids_Tk`), summed per sequence and over sequences in order, / the step's loss tokens. The entropy
    term has no gradient; it makes the value the KL (0 for the teacher's own distribution)."""
    f = batch.fields
    ids_Tk, q_Tk = f["teacher_topk_ids_Tk"], f["teacher_topk_probs_Tk"]
    ce_T = -(q_Tk * scores.logp_TV.gather(-1, ids_Tk)).sum(-1)
    ent_T = (q_Tk * q_Tk.clamp(min=1e-30).log()).sum(-1)
    kl_T = torch.where(batch.loss_mask_T, ce_T + ent_T, 0.0)
    loss = 0.0
    for part in kl_T.split(batch.lengths):  # one sequence at a time, the summation order of a per-sequence loop
        loss = loss + part.sum() / max(norm.tokens, 1)
    return loss, {}

"""openk3.train.losses (the policy losses) and openk3.rl.advantages: each loss kind's gradient against its
hand-derived closed form, the asymmetric clip, IcePop and TIS at their band edges and on ±inf/NaN log-probs, GRPO
advantages, and LossConfig validation."""

from __future__ import annotations

import math

import pytest
import torch

from openk3.rl.advantages import group_advantages
from openk3.train.losses import LossConfig, policy_loss

F32 = torch.float32


def _close(actual, expected):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=F32), rtol=1e-5, atol=1e-6)


def _grad(cfg, logp, old, adv, mask=None, seq=None, rollout=None, ref=None):
    """Loss, d loss / d logp and metrics on a packed batch (defaults: all tokens masked in, one sequence)."""
    logp = logp.clone().requires_grad_(True)
    mask = torch.ones(logp.shape, dtype=torch.bool) if mask is None else mask
    seq = torch.zeros(logp.shape, dtype=torch.long) if seq is None else seq
    loss, metrics = policy_loss(logp, old, adv, mask, seq, cfg, rollout_logp_T=rollout, ref_logp_T=ref)
    loss.backward()
    return loss.detach(), logp.grad, metrics


def _from_ratios(ratios, old):
    """Current log-probs whose ratio to `old` is `ratios`."""
    return (torch.tensor(old, dtype=torch.float64) + torch.tensor(ratios, dtype=torch.float64).log()).to(F32)


OLD = [-1.0, -2.0, -0.5]
SEQ = torch.tensor([0, 0, 1])


def test_ppo_gradient_closed_form_token_and_sequence():
    # t0 inside the band; t1 above 1 + eps_high with A > 0 (clipped branch, zero gradient); t2 above the band with A < 0,
    # where the unclipped branch is the larger loss and keeps its gradient -r A.
    r, adv = [1.1, 1.5, 1.5], torch.tensor([1.0, 1.0, -2.0])
    logp = _from_ratios(r, OLD)
    loss, grad, m = _grad(LossConfig(), logp, torch.tensor(OLD), adv)
    _close(grad, [-r[0] * 1.0 / 3, 0.0, -r[2] * -2.0 / 3])
    _close(loss, (-r[0] * 1.0 - 1.28 * 1.0 - r[2] * -2.0) / 3)
    assert m["clip_fraction"] == pytest.approx(1 / 3)
    assert m["ratio_mean"] == pytest.approx(sum(r) / 3, rel=1e-5)
    # "sequence": seq 0 = {t0, t1} and seq 1 = {t2}; loss = (mean(l0, l1) + l2) / 2.
    loss, grad, _ = _grad(LossConfig(average="sequence"), logp, torch.tensor(OLD), adv, seq=SEQ)
    _close(grad, [-r[0] * 1.0 / 4, 0.0, -r[2] * -2.0 / 2])
    _close(loss, ((-r[0] - 1.28) / 2 + r[2] * 2.0) / 2)


def test_ppo_asymmetric_clip():
    # eps_high = .28: 1.25 inside, 1.3 clipped (A > 0); eps_low = .2: 0.79 clipped, 0.81 inside (A < 0).
    old = [-1.0, -1.0, -1.0, -1.0]
    r, adv = [1.25, 1.3, 0.79, 0.81], torch.tensor([1.0, 1.0, -1.0, -1.0])
    _, grad, m = _grad(LossConfig(), _from_ratios(r, old), torch.tensor(old), adv)
    _close(grad, [-1.25 / 4, 0.0, 0.0, 0.81 / 4])
    assert m["clip_fraction"] == pytest.approx(0.5)


def test_cispo_gradient_closed_form():
    # Weight sg(min(r, 1 + 5)): d/dlogp_t of -w A logp = -w A; the weight's own dependence on logp is stopped.
    r, adv = [1.1, 7.0, 0.5], torch.tensor([1.0, 1.0, -2.0])
    w = [1.1, 6.0, 0.5]
    logp = _from_ratios(r, OLD)
    loss, grad, m = _grad(LossConfig(kind="cispo"), logp, torch.tensor(OLD), adv)
    _close(grad, [-w[i] * adv[i].item() / 3 for i in range(3)])
    _close(loss, sum(-w[i] * adv[i].item() * logp[i].item() for i in range(3)) / 3)
    assert m["clip_fraction"] == pytest.approx(1 / 3)
    _, grad, _ = _grad(LossConfig(kind="cispo", average="sequence"), logp, torch.tensor(OLD), adv, seq=SEQ)
    _close(grad, [-w[0] / 4, -w[1] / 4, -w[2] * -2.0 / 2])


def test_reinforce_gradient_closed_form():
    adv = torch.tensor([0.5, 0.5, -1.5])
    logp = torch.tensor([-0.3, -1.2, -2.0])
    loss, grad, _ = _grad(LossConfig(kind="reinforce"), logp, torch.tensor(OLD), adv)
    _close(grad, -adv / 3)
    _close(loss, -(adv * logp).sum() / 3)
    _, grad, _ = _grad(LossConfig(kind="reinforce", average="sequence"), logp, torch.tensor(OLD), adv, seq=SEQ)
    _close(grad, [-0.5 / 4, -0.5 / 4, 1.5 / 2])


def test_k15_gradient_closed_form():
    # L_j = -(A_j S_j - tau/2 (S_j - S_old_j)^2), mean over 2 sequences: dL/dlogp_t = -(A_j - tau (S_j - S_old_j)) / 2.
    tau, adv = 0.1, torch.tensor([2.0, 2.0, -1.0])
    logp = torch.tensor([-0.4, -1.1, -0.2])
    s0, s0_old, s1, s1_old = -1.5, -3.0, -0.2, -0.5
    loss, grad, _ = _grad(LossConfig(kind="k15", tau=tau), logp, torch.tensor(OLD), adv, seq=SEQ)
    g0, g1 = -(2.0 - tau * (s0 - s0_old)) / 2, -(-1.0 - tau * (s1 - s1_old)) / 2
    _close(grad, [g0, g0, g1])
    l0 = -(2.0 * s0 - tau / 2 * (s0 - s0_old) ** 2)
    l1 = -(-1.0 * s1 - tau / 2 * (s1 - s1_old) ** 2)
    _close(loss, (l0 + l1) / 2)
    # A_j comes from the first mask token; a sequence without mask tokens does not count.
    mask = torch.tensor([False, True, False])
    adv = torch.tensor([9.0, 2.0, -1.0])
    _, grad, _ = _grad(LossConfig(kind="k15", tau=tau), logp, torch.tensor(OLD), adv, mask=mask, seq=SEQ)
    _close(grad, [0.0, -(2.0 - tau * (-1.1 - -2.0)), 0.0])


def test_kl_k3_term():
    # With A = 0 only the KL remains: d/dlogp of exp(ref - logp) - (ref - logp) - 1 is 1 - exp(ref - logp).
    logp, ref = torch.tensor([-0.5, -1.0, -2.0]), torch.tensor([-0.7, -1.0, -1.5])
    cfg = LossConfig(kind="reinforce", kl_coef=0.3)
    loss, grad, m = _grad(cfg, logp, torch.tensor(OLD), torch.zeros(3), ref=ref)
    d = ref - logp
    _close(grad, 0.3 * (1 - d.exp()) / 3)
    _close(loss, 0.3 * (d.exp() - d - 1).mean())
    assert m["kl"] == pytest.approx((d.exp() - d - 1).mean().item(), rel=1e-5)


def _edge(value, direction):
    """The fp32 neighbour of fp32(value) one ulp towards `direction`."""
    return torch.nextafter(torch.tensor(value, dtype=F32), torch.tensor(direction, dtype=F32)).item()


def test_icepop_band_edges_are_inclusive():
    # rollout = 0 makes the log-ratio exactly fp32(old): edges log(0.5) and log(5) kept, one ulp outside dropped.
    lo, hi = math.log(0.5), math.log(5.0)
    old = torch.tensor([lo, hi, _edge(lo, -1.0), _edge(hi, 10.0), 0.0])
    adv = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    cfg = LossConfig(kind="reinforce", correction="icepop")
    _, grad, m = _grad(cfg, torch.full((5,), -1.0), old, adv, rollout=torch.zeros(5))
    # Dropped tokens still count in the denominator (5): masking lowers their share instead of renormalising.
    _close(grad, [-1.0 / 5, -2.0 / 5, 0.0, 0.0, -5.0 / 5])
    assert m["icepop_masked_fraction"] == pytest.approx(2 / 5)


def test_tis_weights_at_cap_and_on_nonfinite():
    cap = math.log(2.0)
    old = torch.tensor([math.log(0.5), cap, _edge(cap, 10.0), 0.0, 0.0, 0.0])
    rollout = torch.tensor([0.0, 0.0, 0.0, -math.inf, math.inf, math.nan])
    w = [0.5, 2.0, 2.0, 2.0, 0.0, 0.0]  # +inf log-ratio -> cap, -inf -> 0, NaN -> 0
    cfg = LossConfig(kind="reinforce", correction="tis")
    loss, grad, m = _grad(cfg, torch.full((6,), -1.0), old, torch.ones(6), rollout=rollout)
    _close(grad, [-x / 6 for x in w])
    assert torch.isfinite(loss)
    assert m["tis_weight_mean"] == pytest.approx(sum(w) / 6, rel=1e-6)


@pytest.mark.parametrize("kind", ["ppo", "cispo", "reinforce"])
@pytest.mark.parametrize("correction", ["tis", "icepop"])
def test_nonfinite_old_and_rollout_give_finite_loss_and_grads(kind, correction):
    inf, nan = math.inf, math.nan
    # Tokens 0-2: old is ±inf/NaN (no ratio: dropped). Tokens 3-5: rollout is ±inf/NaN. Token 6: clean.
    old = torch.tensor([inf, -inf, nan, -1.0, -1.0, -1.0, -1.0])
    rollout = torch.tensor([-1.0, -1.0, -1.0, inf, -inf, nan, -1.0])
    logp, adv = torch.full((7,), -1.1), torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0, 1.0, 1.0])
    loss, grad, m = _grad(LossConfig(kind=kind, correction=correction), logp, old, adv, rollout=rollout)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(math.isfinite(v) for v in m.values())
    assert (grad[:3] == 0).all()
    if correction == "icepop":
        assert (grad[:6] == 0).all() and grad[6] != 0
        assert m["icepop_masked_fraction"] == pytest.approx(6 / 7)
    else:  # rollout -inf (log-ratio +inf) keeps weight 2; +inf and NaN give 0.
        assert grad[3] == 0 and grad[5] == 0 and grad[4] != 0


def poison(x, value):
    """`x` with one more token holding `value`."""
    return torch.cat([x, torch.tensor([value])])


@pytest.mark.parametrize("kind", ["ppo", "cispo", "k15", "reinforce"])
@pytest.mark.parametrize("correction", [None, "icepop", "tis"])
@pytest.mark.parametrize("average", ["token", "sequence"])
def test_masked_out_token_with_inf_logp_contributes_nothing(kind, correction, average):
    if kind == "k15" and correction == "tis":
        return
    cfg = LossConfig(kind=kind, correction=correction, average=average, kl_coef=0.1)
    logp, old = torch.tensor([-0.3, -0.9, -0.6]), torch.tensor([-0.4, -1.0, -0.5])
    adv, rollout, ref = torch.tensor([1.0, 1.0, -0.5]), old - 0.1, old + 0.2
    ref_loss, ref_grad, _ = _grad(cfg, logp, old, adv, seq=SEQ, rollout=rollout, ref=ref)
    # Append a mask-False token to sequence 1 whose every input is poisoned.
    mask = torch.tensor([True, True, True, False])
    loss, grad, m = _grad(
        cfg,
        poison(logp, -math.inf),
        poison(old, -math.inf),
        poison(adv, math.nan),
        mask=mask,
        seq=torch.tensor([0, 0, 1, 1]),
        rollout=poison(rollout, math.nan),
        ref=poison(ref, math.nan),
    )
    _close(loss, ref_loss)
    _close(grad, torch.cat([ref_grad, torch.zeros(1)]))
    assert all(math.isfinite(v) for v in m.values())


@pytest.mark.parametrize("kind", ["ppo", "cispo", "k15", "reinforce"])
def test_empty_mask_gives_zero_loss_with_grad(kind):
    logp = torch.tensor([-math.inf, -1.0])
    loss, grad, _ = _grad(LossConfig(kind=kind), logp, torch.zeros(2), torch.ones(2), mask=torch.zeros(2, dtype=bool))
    assert loss.item() == 0.0 and (grad == 0).all()


def test_group_advantages():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 5.0, 2.0, 4.0])
    groups = torch.tensor([7, 7, 7, 7, 3, 9, 9])  # ids need not be contiguous; group 3 is a singleton
    _close(group_advantages(rewards, groups), [0.25, -0.75, 0.25, 0.25, 0.0, -1.0, 1.0])
    # Unbiased stds: group 7 sqrt(0.75 / 3) = 0.5, group 9 sqrt(2).
    eps = 1e-6
    std7, std9 = 0.5 + eps, math.sqrt(2.0) + eps
    expected = [0.25 / std7, -0.75 / std7, 0.25 / std7, 0.25 / std7, 0.0, -1.0 / std9, 1.0 / std9]
    _close(group_advantages(rewards, groups, normalize_std=True), expected)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("kind", "gspo"),
        ("average", "batch"),
        ("correction", "is"),
        ("eps_low", 1.0),
        ("eps_high", -0.1),
        ("cispo_eps_high", 0.0),
        ("tau", 0.0),
        ("tis_cap", 0.0),
        ("icepop_low", 1.5),
        ("icepop_high", 0.9),
        ("kl_coef", -1.0),
    ],
)
def test_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"LossConfig.{field} "):
        LossConfig(**{field: value})


def test_config_refuses_tis_for_k15_and_missing_rollout_logp():
    with pytest.raises(ValueError, match="correction"):
        LossConfig(kind="k15", correction="tis")
    with pytest.raises(ValueError, match="rollout_logp_T"):
        _grad(LossConfig(correction="icepop"), torch.zeros(3), torch.zeros(3), torch.ones(3))


@pytest.mark.parametrize("kind", ["ppo", "cispo", "k15", "reinforce"])
@pytest.mark.parametrize("average", ["token", "sequence"])
def test_micro_batches_with_normalizers_sum_to_the_whole_batch(kind, average):
    """Split by whole sequences, with the whole batch's totals as normalizers: the losses and gradients add up to the
    one-call loss and gradient (KL included; one sequence has no mask token, one token is IcePop-dropped)."""
    g = torch.Generator().manual_seed(3)
    lengths = [4, 3, 5, 2]
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    T = len(seq)
    logp = -torch.rand(T, generator=g) * 3
    old = logp + 0.3 * torch.randn(T, generator=g)
    rollout = old.clone()
    rollout[2] = old[2] - 5.0  # outside the IcePop band
    ref = logp + 0.2 * torch.randn(T, generator=g)
    adv = torch.randn(len(lengths), generator=g)[seq]
    mask = torch.rand(T, generator=g) > 0.2
    mask[seq == 3] = False  # a sequence with nothing to train
    cfg = LossConfig(kind=kind, average=average, correction="icepop" if kind != "reinforce" else None, kl_coef=0.1)
    whole, grad_whole, _ = _grad(cfg, logp, old, adv, mask, seq, rollout, ref)
    normalizers = (int(mask.sum()), sum(int(mask[seq == i].any()) for i in range(len(lengths))))
    leaf = logp.clone().requires_grad_(True)
    total = 0.0
    for ids in ([0, 1], [2, 3]):
        sel = torch.isin(seq, torch.tensor(ids))
        loss, _ = policy_loss(leaf[sel], old[sel], adv[sel], mask[sel], seq[sel] - ids[0], cfg,
                              rollout_logp_T=rollout[sel], ref_logp_T=ref[sel], normalizers=normalizers)  # fmt: skip
        loss.backward()
        total = total + loss.detach()
    _close(total, whole)
    _close(leaf.grad, grad_whole)

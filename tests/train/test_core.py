"""The training core (train/core.py) and its loss registry (train/losses.py): micro-batches add up to one forward, a
padding micro-batch changes nothing, a non-finite step is skipped without touching the weights, and the registry
names what it holds."""

from __future__ import annotations

import pytest
import torch

from openk3.config import K3Config
from openk3.model.model import K3ForCausalLM
from openk3.train import losses
from openk3.train.balance import Balancer
from openk3.train.batch import TokenBatch
from openk3.train.core import TrainCore
from openk3.train.distributed import Layout
from tests.train.train_helpers import capture_grads


def _core(seed: int = 0, lr_model=None) -> TrainCore:
    model = K3ForCausalLM(K3Config.preset("tiny"))
    model.init_weights(torch.Generator().manual_seed(seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    return TrainCore(model, Layout.single(), optimizer, balancer=Balancer(model, "none"), grad_clip=1e9)


def _examples(n: int = 5, seed: int = 1) -> tuple[list[list[int]], list[list[bool]]]:
    g = torch.Generator().manual_seed(seed)
    seqs, masks = [], []
    for i in range(n):
        length = 6 + 5 * i
        seqs.append(torch.randint(3, 200, (length,), generator=g).tolist())
        masks.append([j >= 2 and j % 4 != 3 for j in range(length)])  # a prompt, then holes
    return seqs, masks


@pytest.mark.parametrize("loss", ["lm", "reinforce"])
def test_micro_batches_add_up_to_one_forward_and_padding_changes_nothing(loss):
    seqs, masks = _examples()
    fields = {"advantages_T": [torch.full((len(s) - 1,), 0.5 - i / 4) for i, s in enumerate(seqs)]}
    whole, split = _core(), _core()
    g_whole, g_split = capture_grads(whole), capture_grads(split)
    one = [TokenBatch.from_sequences(seqs, masks, fields=fields)]
    parts = [TokenBatch.from_sequences(seqs[a:b], masks[a:b], fields={k: v[a:b] for k, v in fields.items()})
             for a, b in ((0, 2), (2, 3), (3, 5))] + [TokenBatch.padding_batch()]  # fmt: skip
    r_whole, r_split = whole.step(one, loss, 1e-3), split.step(parts, loss, 1e-3)
    assert r_split["loss"] == pytest.approx(r_whole["loss"], rel=1e-6)
    assert r_split["grad_norm"] == pytest.approx(r_whole["grad_norm"], rel=1e-5) and r_whole["grad_norm"] > 0
    for name, g in g_whole.items():
        torch.testing.assert_close(g_split[name], g, rtol=1e-4, atol=1e-5 * float(g.abs().max()) + 1e-12, msg=name)
    # The padding batch itself: bitwise nothing.
    a, b = _core(), _core()
    ga, gb = capture_grads(a), capture_grads(b)
    a.step(one, loss, 1e-3)
    b.step([*one, TokenBatch.padding_batch()], loss, 1e-3)
    assert all(torch.equal(ga[k], gb[k]) for k in ga)


def test_a_non_finite_step_is_skipped_and_changes_nothing(monkeypatch):
    core = _core()
    seqs, masks = _examples(2)
    before = {k: v.clone() for k, v in core.model.state_dict().items()}
    real = losses.lm_loss_sum
    monkeypatch.setattr(losses, "lm_loss_sum", lambda logits, labels: real(logits, labels) * float("nan"))
    row = core.step([TokenBatch.from_sequences(seqs, masks)], "lm", 1e-3)
    assert row["skipped"] and core.nonfinite_run == core.nonfinite_total == 1
    assert all(torch.equal(v, before[k]) for k, v in core.model.state_dict().items())
    assert all(p.grad is None for p in core.model.parameters())
    monkeypatch.setattr(losses, "lm_loss_sum", real)
    assert not core.step([TokenBatch.from_sequences(seqs, masks)], "lm", 1e-3)["skipped"]
    assert core.nonfinite_run == 0 and core.nonfinite_total == 1


def test_the_registry_names_its_losses_and_takes_a_new_one_in_one_line():
    assert {"lm", "ppo", "cispo", "k15", "reinforce", "opd", "topk_kl"} <= set(losses.LOSSES)
    with pytest.raises(ValueError, match=r"unknown loss 'nope'; registered: \[.*'topk_kl'"):
        losses.get_loss("nope")
    with pytest.raises(ValueError, match="registered twice"):
        losses.register_loss("lm")(lambda *a: None)

    @losses.register_loss("test_sum_logp")
    def sum_logp(scores, batch, cfg, norm):  # maximise the mask tokens' log-probs: a new loss, one function
        return -(scores.logp_T * batch.loss_mask_T).sum() / max(norm.tokens, 1), {}

    try:
        seqs, masks = _examples(3)
        a, b = _core(), _core()
        ra = a.step([TokenBatch.from_sequences(seqs, masks)], "test_sum_logp", 1e-3)
        rb = b.step([TokenBatch.from_sequences(seqs, masks)], "lm", 1e-3)
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-6)  # the same quantity as lm, summed another way
    finally:
        del losses.LOSSES["test_sum_logp"]

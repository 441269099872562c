"""The training core (train/core.py) and its loss registry (train/losses.py): micro-batches add up to one forward, a
padding micro-batch changes nothing, a non-finite step is skipped without touching the weights, and the registry
names what it holds."""

from __future__ import annotations

import itertools
import math

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


# ---- context parallelism: a cp rank trains on a piece of every packed sequence ---------------------------------
# (loss, LossConfig overrides, per-token fields): every per-sequence term is here (sequence averaging, k15's sums
# and first-token advantage), the corrections, the KL, opd's reward and topk's per-sequence sum.
CP_CASES = [
    ("lm", {}, ()),
    ("lm", {}, ("token_weight_T",)),
    ("ppo", {"correction": "icepop", "kl_coef": 0.1}, ("advantages_T", "behaviour_logp_T", "reference_logp_T")),
    ("ppo", {"average": "sequence"}, ("advantages_T",)),
    ("k15", {}, ("advantages_T",)),
    ("cispo", {"correction": "tis"}, ("advantages_T", "behaviour_logp_T")),
    ("opd", {}, ("advantages_T", "teacher_logp_T", "student_logp_T")),
    ("topk_kl", {}, ("teacher_topk_ids_Tk", "teacher_topk_probs_Tk")),
]


def _cp_batches(names, seed: int, replay: bool) -> list[TokenBatch]:
    """Two micro-batches of packed sequences (ragged, some cut by the shard edge) with random fields and, with
    `replay`, random recorded routes."""
    seqs, masks = _examples(5, seed)
    text = K3Config.preset("tiny").text_config
    g = torch.Generator().manual_seed(seed)
    fields = {}
    for name in names:
        n = [len(s) - 1 for s in seqs]
        if name == "teacher_topk_ids_Tk":
            fields[name] = [torch.rand(m, text.vocab_size, generator=g).topk(4).indices for m in n]
        elif name == "teacher_topk_probs_Tk":
            fields[name] = [torch.softmax(torch.randn(m, 4, generator=g), -1) for m in n]
        elif name == "advantages_T":  # a sequence-level value plus per-token noise, as opd's reward makes it
            fields[name] = [torch.randn((), generator=g).expand(m) + 0.1 * torch.randn(m, generator=g) for m in n]
        elif name == "token_weight_T":
            fields[name] = [torch.rand(m, generator=g) / 50 for m in n]
        else:  # log-probs near the policy's (a fresh tiny model's are about -log V), some outside IcePop's band
            fields[name] = [-math.log(text.vocab_size) + 0.5 * torch.randn(m, generator=g) for m in n]
    routes = None
    if replay:
        from openk3.model.moe import moe_layer_indices

        M = len(moe_layer_indices(text))
        routes = [torch.rand(len(s), M, text.num_experts, generator=g).topk(text.num_experts_per_token).indices
                  for s in seqs]  # fmt: skip
    cut = (0, 3, 5)
    return [TokenBatch.from_sequences(seqs[a:b], masks[a:b], fields={k: v[a:b] for k, v in fields.items()},
                                      routes=None if routes is None else routes[a:b])
            for a, b in itertools.pairwise(cut)]  # fmt: skip


def _cp_steps(core: TrainCore, case, replay: bool) -> list[dict]:
    loss, overrides, names = case
    cfg = losses.LossConfig(**overrides)
    return [core.step(_cp_batches(names, seed, replay), loss, 1e-4, cfg) for seed in (1, 2)]  # k3 rl's rate


def _cp_rank(rank: int, world: int, cases, replay: bool):
    from openk3.parallel.dims import ParallelDims

    out = []
    for case in cases:
        layout = Layout(ParallelDims(cp=world), "cpu")
        model = K3ForCausalLM(K3Config.preset("tiny"))
        model.init_weights(torch.Generator().manual_seed(0))
        layout.parallelize(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        balancer = Balancer(model, "none", process_group=layout.data_group)
        core = TrainCore(model, layout, optimizer, balancer=balancer, grad_clip=1e9)
        rows = _cp_steps(core, case, replay)
        weights = {name: t.clone() for name, t in layout.full_tensors(model)}
        out.append((rows, weights, core.last_logp_T))
    return out


@pytest.mark.parametrize("replay", [False, True], ids=["natural", "replay"])
def test_context_parallel_steps_equal_one_process_for_every_loss(replay):
    """2 cp ranks, each holding a piece of every packed sequence: two steps of each loss equal one process (loss,
    gradient norm, the whole step's metrics, the gathered log-probs, the weights after), with natural routing and
    with replayed routes cut alike."""
    from tests.parallel.dist_helpers import run_ranks

    cases = CP_CASES if not replay else [c for c in CP_CASES if c[0] in ("ppo", "k15")]
    got = run_ranks(2, _cp_rank, cases, replay)[0]
    for case, (rows, weights, logp_T) in zip(cases, got):
        single = _core()
        want = _cp_steps(single, case, replay)
        for g, w in zip(rows, want):
            assert set(g) == set(w), case
            for key, value in w.items():
                if isinstance(value, float):
                    assert g[key] == pytest.approx(value, rel=2e-5, abs=1e-7), (case, key)
        # The second step's log-probs, after one AdamW update: its division by sqrt(v) makes the rounding of
        # near-zero gradients a larger relative change of their weights (the weights as a whole agree to 1e-5).
        torch.testing.assert_close(logp_T, single.last_logp_T, rtol=1e-4, atol=1e-4)
        want_w = single.model.state_dict()
        diff = sum(float((weights[k] - t).double().square().sum()) for k, t in want_w.items()) ** 0.5
        norm = sum(float(t.double().square().sum()) for t in want_w.values()) ** 0.5
        assert diff / norm <= 1e-5, (case, diff / norm)

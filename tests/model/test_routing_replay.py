"""Routing replay (R3, spec/rl.md §3): `ForwardBatch.routed_experts` forces each MoE layer's experts while the
weights are recomputed from the router, so the router gate keeps getting gradients.

Replaying the natural routes is bitwise the natural forward (logits and gate gradients); replaying other routes
matches a by-hand MoE with the forced experts and a whole model whose router bias forces the same experts; bad
routes are rejected; dense leading layers have no entry (spec/rl.md §4: K3's layer 0 is dense).
"""

from __future__ import annotations

import pytest
import torch

from openk3 import K3Config, K3ForCausalLM
from openk3.model.batch import ForwardBatch
from openk3.model.moe import moe_layer_indices
from openk3.ops.moe.route import route_replay, route_topk
from openk3.ops.situ import situ_glu
from openk3.utils import rel_rms

LENGTHS = [[7, 1, 12, 4], [3]]  # ragged packed; [3] puts T*k below E (the gathered dispatch)


def build(first_k_dense: int = 1) -> K3ForCausalLM:
    config = K3Config.preset("tiny")
    config.text_config.first_k_dense_replace = first_k_dense
    torch.manual_seed(0)
    model = K3ForCausalLM(config)
    model.init_random_weights(0)
    return model.eval()


@pytest.fixture(scope="module")
def tiny():
    return build()


def moe_modules(model):
    return [layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe")]


def packed(lengths, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (sum(lengths),), generator=gen)


def record_routes(model, ids_T, lengths):
    """A natural forward's logits [T, V] and the routes [T, M, k] its MoE layers chose (via the observer)."""
    seen = {}
    moes = moe_modules(model)
    for moe in moes:
        moe.observer = lambda module, scores_TE, idx_Tk: seen.__setitem__(module.moe_index, idx_Tk.clone())
    try:
        logits_TV = model.forward_batch(ForwardBatch.from_lengths(ids_T, lengths))
    finally:
        for moe in moes:
            moe.observer = None
    return logits_TV, torch.stack([seen[m] for m in range(len(moes))], dim=1)


def replay(model, ids_T, lengths, routes_TMk):
    return model.forward_batch(ForwardBatch.from_lengths(ids_T, lengths, routed_experts=routes_TMk))


def other_routes(routes_TMk: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Each token's experts shifted by one id (distinct, in range, different from the natural ones)."""
    return (routes_TMk + 1) % num_experts


def test_moe_layer_indices_and_ordinals(tiny):
    text = tiny.text_config
    assert moe_layer_indices(text) == list(range(1, text.num_hidden_layers))  # layer 0 is dense
    layers = [layer for layer in tiny.model.layers if hasattr(layer, "block_sparse_moe")]
    assert [layer.layer_idx for layer in layers] == moe_layer_indices(text)
    assert [layer.block_sparse_moe.moe_index for layer in layers] == list(range(len(layers)))


def test_route_replay_shares_route_topk_weights():
    gen = torch.Generator().manual_seed(0)
    scores_TE = torch.rand(11, 8, generator=gen)
    bias_E = 0.05 * torch.randn(8, generator=gen)
    for renormalize, scaling in [(True, 1.0), (True, 2.5), (False, 1.0)]:
        idx_Tk, w_Tk = route_topk(scores_TE, bias_E, 3, renormalize, scaling)
        shuffled_Tk = idx_Tk.flip(-1).to(torch.int16)  # any order and integer dtype; used sorted
        ridx_Tk, rw_Tk = route_replay(scores_TE, shuffled_Tk, renormalize, scaling)
        assert ridx_Tk.dtype == torch.long and torch.equal(ridx_Tk, idx_Tk) and torch.equal(rw_Tk, w_Tk)


@pytest.mark.parametrize("lengths", LENGTHS)
def test_replaying_natural_routes_is_bitwise_natural(tiny, lengths, one_thread):
    ids_T = packed(lengths)
    with torch.no_grad():
        natural_TV, routes_TMk = record_routes(tiny, ids_T, lengths)
        assert routes_TMk.shape == (sum(lengths), len(moe_modules(tiny)), tiny.text_config.num_experts_per_token)
        for routes in (routes_TMk, routes_TMk.flip(-1).to(torch.int16)):  # int16, unsorted: sorted inside
            assert torch.equal(replay(tiny, ids_T, lengths, routes), natural_TV)


def test_observer_sees_the_replayed_experts(tiny):
    lengths = LENGTHS[0]
    ids_T = packed(lengths)
    with torch.no_grad():
        _, routes_TMk = record_routes(tiny, ids_T, lengths)
        forced_TMk = other_routes(routes_TMk, tiny.text_config.num_experts).flip(-1)
        seen = {}
        for moe in moe_modules(tiny):
            moe.observer = lambda module, scores_TE, idx_Tk: seen.__setitem__(module.moe_index, idx_Tk.clone())
        try:
            replay(tiny, ids_T, lengths, forced_TMk)
        finally:
            for moe in moe_modules(tiny):
                moe.observer = None
    assert torch.equal(torch.stack([seen[m] for m in sorted(seen)], 1), forced_TMk.sort(-1).values)


def moe_by_hand(moe, x_TD: torch.Tensor, idx_Tk: torch.Tensor) -> torch.Tensor:
    """StableLatentMoE with forced experts, token by token and expert by expert (no dispatcher)."""
    ex = moe.experts
    scores_TE = torch.sigmoid(x_TD.float() @ moe.gate.weight.float().t())
    z_TL = moe.routed_expert_down_proj(x_TD)
    rows = []
    for t in range(x_TD.shape[0]):
        s_k = scores_TE[t, idx_Tk[t]]
        w_k = s_k / s_k.sum() * moe.scaling
        y_L = sum(w_k[j] * (situ_glu(ex.w1[e] @ z_TL[t], ex.w3[e] @ z_TL[t], ex.beta, ex.linear_beta) @ ex.w2[e].t())
                  for j, e in enumerate(idx_Tk[t].tolist()))  # fmt: skip
        rows.append(y_L)
    out_TD = moe.routed_expert_up_proj(moe.routed_expert_norm(torch.stack(rows)))
    return out_TD + moe.shared_experts(x_TD)


@pytest.mark.parametrize("lengths", LENGTHS)
def test_replaying_other_routes_matches_by_hand_moe(tiny, lengths):
    ids_T = packed(lengths)
    moes = moe_modules(tiny)
    assert tiny.text_config.moe_renormalize
    with torch.no_grad():
        natural_TV, routes_TMk = record_routes(tiny, ids_T, lengths)
        forced_TMk = other_routes(routes_TMk, tiny.text_config.num_experts)
        io = {}
        hooks = [moes[m].register_forward_hook(lambda mod, args, out: io.__setitem__(mod.moe_index, (args, out)))
                 for m in (0, len(moes) - 1)]  # fmt: skip
        try:
            forced_TV = replay(tiny, ids_T, lengths, forced_TMk)
        finally:
            for h in hooks:
                h.remove()
        assert rel_rms(forced_TV, natural_TV) > 1e-2
        for m, ((x_TD, routes_Tk), out_TD) in io.items():
            assert torch.equal(routes_Tk, forced_TMk[:, m])
            assert rel_rms(out_TD, moe_by_hand(moes[m], x_TD, forced_TMk[:, m])) <= 1e-6


def test_replay_equals_a_bias_forced_model(one_thread):
    """Every token replaying the same two experts per layer is what a router bias of +100 on them selects
    naturally, with the same unbiased weights: the whole-model logits agree bitwise."""
    model, lengths = build(), LENGTHS[0]
    ids_T, T = packed(lengths), sum(lengths)
    moes = moe_modules(model)
    pairs = [sorted({m % 8, (3 * m + 5) % 8}) for m in range(len(moes))]
    assert all(len(p) == 2 for p in pairs)
    forced_TMk = torch.tensor(pairs).expand(T, -1, -1)
    with torch.no_grad():
        natural_TV = model.forward_batch(ForwardBatch.from_lengths(ids_T, lengths))
        replayed_TV = replay(model, ids_T, lengths, forced_TMk)
        for moe, pair in zip(moes, pairs):
            moe.gate.e_score_correction_bias[pair] += 100.0
        biased_TV = model.forward_batch(ForwardBatch.from_lengths(ids_T, lengths))
    assert rel_rms(replayed_TV, natural_TV) > 1e-2
    assert torch.equal(replayed_TV, biased_TV)


def gate_grads(model, ids_T, lengths, routes_TMk=None):
    model.zero_grad(set_to_none=True)
    logits_TV = model.forward_batch(ForwardBatch.from_lengths(ids_T, lengths, routed_experts=routes_TMk))
    torch.nn.functional.cross_entropy(logits_TV[:-1], ids_T[1:]).backward()
    return [moe.gate.weight.grad.clone() for moe in moe_modules(model)]


def test_router_gets_gradients_under_replay(one_thread):
    model, lengths = build(), LENGTHS[0]
    ids_T = packed(lengths)
    with torch.no_grad():
        _, routes_TMk = record_routes(model, ids_T, lengths)
    natural = gate_grads(model, ids_T, lengths)
    same = gate_grads(model, ids_T, lengths, routes_TMk)
    forced = gate_grads(model, ids_T, lengths, other_routes(routes_TMk, model.text_config.num_experts))
    assert all(torch.equal(a, b) for a, b in zip(same, natural))
    assert all(g.abs().sum() > 0 for g in forced)
    assert all(rel_rms(f, n) > 1e-3 for f, n in zip(forced, natural))


def test_bad_routes_are_rejected(tiny):
    lengths = LENGTHS[0]
    ids_T, T = packed(lengths), sum(lengths)
    text = tiny.text_config
    M, k, E = len(moe_layer_indices(text)), text.num_experts_per_token, text.num_experts
    good_TMk = torch.arange(k).expand(T, M, k)
    bad_shapes = [good_TMk[:-1], torch.arange(k).expand(T, text.num_hidden_layers, k), good_TMk[..., :1], good_TMk[0]]
    with torch.no_grad():
        for bad in bad_shapes:
            with pytest.raises(ValueError, match=rf"\(T, M, k\) = \({T}, {M}, {k}\)"):
                replay(tiny, ids_T, lengths, bad)
        with pytest.raises(ValueError, match="integer"):
            replay(tiny, ids_T, lengths, good_TMk.float())
        for value in (-1, E):
            bad = good_TMk.clone()
            bad[3, 2, 1] = value
            with pytest.raises(ValueError, match=rf"\[0, {E}\)"):
                replay(tiny, ids_T, lengths, bad)
        bad = good_TMk.clone()
        bad[5, 0] = 4
        with pytest.raises(ValueError, match="repeats an expert"):
            replay(tiny, ids_T, lengths, bad)


def test_two_leading_dense_layers(one_thread):
    model = build(first_k_dense=2)
    text = model.text_config
    assert moe_layer_indices(text) == list(range(2, text.num_hidden_layers))
    assert [moe.moe_index for moe in moe_modules(model)] == list(range(text.num_hidden_layers - 2))
    lengths = LENGTHS[0]
    ids_T = packed(lengths)
    with torch.no_grad():
        natural_TV, routes_TMk = record_routes(model, ids_T, lengths)
        assert routes_TMk.shape[1] == text.num_hidden_layers - 2
        assert torch.equal(replay(model, ids_T, lengths, routes_TMk), natural_TV)
        forced_TV = replay(model, ids_T, lengths, other_routes(routes_TMk, text.num_experts))
        assert rel_rms(forced_TV, natural_TV) > 1e-2
        with pytest.raises(ValueError, match="shape"):  # one entry per layer, dense ones included: wrong
            k = text.num_experts_per_token
            replay(model, ids_T, lengths, torch.arange(k).expand(sum(lengths), text.num_hidden_layers, k))

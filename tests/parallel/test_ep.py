"""Expert parallelism on gloo: with the all-to-all dispatcher and the experts split over 2 ranks, each taking half
of the global batch, the loss and every gradient equal the single-process run (fp32; relative RMS <= 2e-5 over all
gradients, <= 1e-4 per tensor)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_helpers import run_ranks
from grad_match import assert_gradients_match

from openk3 import K3Config, K3ForCausalLM


def two_layer_model() -> K3ForCausalLM:
    """Four layers, despite the name kept by the other tests: KDA, KDA, KDA, MLA, so that two AttnRes blocks start
    (layers 0 and 3; a wrapper that copied the layer arguments once hid a lost block here), dense FFN then MoE."""
    config = K3Config.preset("tiny")
    text = config.text_config
    text.num_hidden_layers, text.first_k_dense_replace = 4, 1
    text.linear_attn_config.kda_layers, text.linear_attn_config.full_attn_layers = [1, 2, 3], [4]
    model = K3ForCausalLM(config)
    model.init_random_weights(0)
    return model


def batch() -> torch.Tensor:
    return torch.randint(0, 700, (4, 24), generator=torch.Generator().manual_seed(1))


def loss_and_grads(model, ids):
    logits = model(ids[:, :-1]).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def ep_rank(rank: int, world: int):
    from openk3.parallel.ep import apply_expert_parallel

    model = two_layer_model()
    assert apply_expert_parallel(model, dist.group.WORLD) == 3
    ids = batch().chunk(world)[rank]  # each rank routes its own tokens
    loss, grads = loss_and_grads(model, ids)
    dist.all_reduce(loss)
    moe = model.model.layers[1].block_sparse_moe
    for name, g in grads.items():
        if ".experts." not in name:  # dense: average over ranks; local experts already hold the global gradient
            dist.all_reduce(g)
            g.div_(world)
    return float(loss) / world, grads, moe.expert_range


def test_expert_parallel_matches_single_process():
    ref_loss, ref_grads = loss_and_grads(two_layer_model(), batch())
    results = run_ranks(2, ep_rank)
    for loss, grads, (lo, hi) in results:
        assert abs(loss - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
        assert_gradients_match(grads, {name: g[lo:hi] if ".experts." in name else g for name, g in ref_grads.items()})


def _route_to_rank0(model) -> None:
    """Bias every MoE router so that all tokens pick experts 0 and 1, which rank 0 owns: rank 1 receives no rows."""
    for layer in model.model.layers:
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is not None and hasattr(moe, "gate"):
            bias = moe.gate.e_score_correction_bias
            with torch.no_grad():
                bias.fill_(-100.0)
                bias[:2] = 100.0


def idle_rank(rank: int, world: int):
    from openk3.parallel.ep import apply_expert_parallel

    model = two_layer_model()
    _route_to_rank0(model)
    apply_expert_parallel(model, dist.group.WORLD)
    ids = batch().chunk(world)[rank]
    loss, grads = loss_and_grads(model, ids)
    dist.all_reduce(loss)  # a collective after backward: a rank that skipped the reverse all-to-all deadlocks here
    for name, g in grads.items():
        if ".experts." not in name:
            dist.all_reduce(g)
            g.div_(world)
    return float(loss) / world, grads, model.model.layers[1].block_sparse_moe.expert_range


def test_a_rank_whose_experts_get_no_tokens_joins_every_backward_collective():
    """The EP hang at step 8: when routing sends no rows to a rank, its reverse all-to-alls in backward must still
    run (the empty expert output used to be cut from the graph, so the other ranks waited in all_to_all until the
    collective timeout). Same loss and gradients as one process, including the idle rank's zero expert gradients."""
    ref = two_layer_model()
    _route_to_rank0(ref)
    ref_loss, ref_grads = loss_and_grads(ref, batch())
    for loss, grads, (lo, hi) in run_ranks(2, idle_rank):
        assert abs(loss - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
        assert_gradients_match(grads, {name: g[lo:hi] if ".experts." in name else g for name, g in ref_grads.items()})
        if lo > 0:
            assert all(not g.any() for n, g in grads.items() if ".experts." in n)  # the idle rank's experts: zeros

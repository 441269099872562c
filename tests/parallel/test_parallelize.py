"""parallelize() on gloo: data parallel (FSDP2), expert parallel and both (2x2) give the single-process loss and
every parameter's gradient on the same global batch (fp32; relative RMS <= 2e-5 over all gradients, <= 1e-4 per
tensor), including packed documents."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from grad_match import assert_gradients_match
from test_ep import batch, loss_and_grads, two_layer_model

from openk3.model.batch import ForwardBatch


def packed_loss_and_grads(model, ids):
    """Rows of two packed documents each (document boundaries respected by KDA and MLA)."""
    import torch.nn.functional as F

    rows = ids[:, :-1]
    fb = ForwardBatch.from_rows(rows, [[9, 14]] * rows.shape[0])
    logits = model.forward_batch(fb)
    loss = F.cross_entropy(logits, ids[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def parallel_rank(rank: int, world: int, dp: int, ep: int, packed: bool):
    from torch.distributed.tensor import DTensor

    from openk3.parallel.dims import ParallelDims
    from openk3.parallel.parallelize import parallelize, sync_expert_grads

    dims = ParallelDims(dp=dp, ep=ep)
    dims.validate(world)
    mesh = dims.build_mesh("cpu")
    model = parallelize(two_layer_model(), mesh, dims)
    ids = batch().chunk(dims.data_ranks)[rank]  # dp x ep ranks each take their share of the global batch
    loss, _ = (packed_loss_and_grads if packed else loss_and_grads)(model, ids)
    sync_expert_grads(model, mesh, dims)
    dist.all_reduce(loss)
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads[name] = g.detach().clone()
    moe = model.model.layers[1].block_sparse_moe
    return float(loss) / world, grads, getattr(moe, "expert_range", None)


@pytest.mark.parametrize(("dp", "ep", "packed"), [(2, 1, False), (1, 2, True), (2, 2, False)])
def test_parallel_layouts_match_single_process(dp, ep, packed):
    ref_loss, ref_grads = (packed_loss_and_grads if packed else loss_and_grads)(two_layer_model(), batch())
    for loss, grads, expert_range in run_ranks(dp * ep, parallel_rank, dp, ep, packed):
        assert abs(loss - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
        want = {name: g[expert_range[0] : expert_range[1]] if ".experts." in name and expert_range is not None else g
                for name, g in ref_grads.items()}  # fmt: skip
        assert_gradients_match(grads, want)


def balance_rank(rank: int, world: int, dp: int, ep: int):
    from openk3.parallel.dims import ParallelDims
    from openk3.parallel.parallelize import parallelize
    from openk3.train.balance import Balancer

    dims = ParallelDims(dp=dp, ep=ep)
    mesh = dims.build_mesh("cpu")
    model = parallelize(two_layer_model(), mesh, dims)
    balancer = Balancer(model, "quantile", process_group=dist.group.WORLD)
    with balancer.collecting():
        loss_and_grads(model, batch().chunk(dims.data_ranks)[rank])
    metrics = balancer.step()
    bias = model.model.layers[1].block_sparse_moe.gate.e_score_correction_bias.detach().clone()
    return bias, metrics["bin_width_per_layer"][0]


@pytest.mark.parametrize(("dp", "ep"), [(2, 1), (2, 2)])
def test_quantile_biases_agree_across_ranks_and_with_single_process(dp, ep):
    from openk3.train.balance import Balancer

    model = two_layer_model()
    balancer = Balancer(model, "quantile")
    with balancer.collecting():
        loss_and_grads(model, batch())
    balancer.step()
    want = model.model.layers[1].block_sparse_moe.gate.e_score_correction_bias.detach()
    results = run_ranks(dp * ep, balance_rank, dp, ep)
    for bias, width in results:
        assert torch.equal(bias, results[0][0])  # bitwise identical on every rank
        assert (bias - want).abs().max() <= width  # within one histogram bin of the single process

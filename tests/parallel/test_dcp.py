"""Distributed checkpoints: train a step at world size 4 (dp 2 x ep 2), save with DCP, load at world size 1 and 2
(dp 2): identical weights, and the next batch's loss equals the world-4 run's."""

from __future__ import annotations

import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from test_ep import loss_and_grads, two_layer_model

from openk3.utils import rel_rms


def next_batch() -> torch.Tensor:
    return torch.randint(0, 700, (4, 24), generator=torch.Generator().manual_seed(7))


def _run(rank: int, world: int, dp: int, ep: int, path: str, save: bool):
    from test_ep import batch

    from openk3.parallel.checkpoint import export_pretrained, full_state_dict, load_distributed, save_distributed
    from openk3.parallel.dims import ParallelDims
    from openk3.parallel.parallelize import parallelize, sync_expert_grads

    dims = ParallelDims(dp=dp, ep=ep)
    mesh = dims.build_mesh("cpu") if world > 1 else None
    model = two_layer_model()
    if mesh is not None:
        parallelize(model, mesh, dims)
    if save:
        loss_and_grads(model, batch().chunk(dims.data_ranks)[rank])
        if mesh is not None:
            sync_expert_grads(model, mesh, dims)
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        save_distributed(model, path, mesh, dims)
        export_pretrained(model, path + "-hf", mesh, dims)
    else:
        load_distributed(model, path, mesh, dims)
    model.zero_grad(set_to_none=True)
    loss, _ = loss_and_grads(model, next_batch().chunk(dims.data_ranks)[rank])
    if world > 1:
        dist.all_reduce(loss)
    return float(loss) / world, {k: v.clone() for k, v in full_state_dict(model, mesh, dims).items()}


def test_save_at_4_load_at_1_and_2(tmp_path):
    path = str(tmp_path / "dcp")
    saved = run_ranks(4, _run, 2, 2, path, True)
    loss4, weights4 = saved[0]
    assert all(torch.equal(w, saved[1][1][k]) for k, w in weights4.items())  # every rank gathers the same model
    for world, dp in ((1, 1), (2, 2)):
        for loss, weights in run_ranks(world, _run, dp, 1, path, False):
            assert set(weights) == set(weights4)
            for name, w in weights.items():
                assert torch.equal(w, weights4[name]), (world, name)
            assert rel_rms(torch.tensor(loss), torch.tensor(loss4)) <= 1e-5
    # The official-format export from the sharded run loads in the plain model with the same weights.
    from openk3 import K3ForCausalLM

    exported = K3ForCausalLM.from_pretrained(path + "-hf", dtype=torch.float32).state_dict()
    for name, w in weights4.items():
        assert torch.equal(exported[name], w), name

"""Distributed checkpoints: train a step at world size 4 (dp 2 x ep 2), save with DCP (each rank its shards), load
at world size 1 and 2 (dp 2) and in one process with no process group: identical weights, and the next batch's
loss equals the world-4 run's. Training checkpoints resume across layouts: a one-process run continues on 2 ranks
(dp 2, ep 2) and a 2-rank run in one process, with the uninterrupted run's losses."""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from test_ep import loss_and_grads, two_layer_model

from openk3.train.config import TrainConfig
from openk3.utils import rel_rms


def next_batch() -> torch.Tensor:
    return torch.randint(0, 700, (4, 24), generator=torch.Generator().manual_seed(7))


def _run(rank: int, world: int, dp: int, ep: int, path: str, save: bool):
    from test_ep import batch

    from openk3.parallel.checkpoint import full_state_dict, load_distributed, save_distributed
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
    assert len([f for f in os.listdir(path) if f.endswith(".distcp")]) == 4  # every rank wrote its own shards
    # The offline export: one process with no process group reads the sharded checkpoint into a plain model, whose
    # official-format save loads with the same weights.
    from openk3 import K3ForCausalLM
    from openk3.parallel.checkpoint import load_distributed
    from openk3.parallel.dims import ParallelDims

    assert not dist.is_initialized()
    plain = two_layer_model()
    load_distributed(plain, path, None, ParallelDims())
    plain.save_pretrained(path + "-hf")
    exported = K3ForCausalLM.from_pretrained(path + "-hf", dtype=torch.float32).state_dict()
    assert exported.keys() == weights4.keys()
    for name, w in weights4.items():
        assert torch.equal(exported[name], w), name


def _train_cfg(out, **overrides) -> TrainConfig:
    """The tiny preset on the synthetic MQAR task: 2 steps of 4 (then 16 at the curriculum's quarter length) rows."""
    return TrainConfig(**{**dict(preset="tiny", data="mqar", tokenizer="byte", batch_size=4, seq_len=32, steps=2,
                                 eval_every=1000, eval_batches=1, out=str(out), progress=False, sample_tokens=0),
                          **overrides})  # fmt: skip


def _rows(run) -> list[dict]:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _train_runs(rank: int, world: int, runs: list) -> None:
    from openk3.train.trainer import Trainer

    for out, overrides in runs:
        Trainer(_train_cfg(out, **overrides), log=lambda *a: None).run()


def test_training_resumes_across_layouts(tmp_path):
    """One process -> 2 ranks (dp 2, ep 2) and 2 ranks -> one process, from the step-1 checkpoint: step 2's loss,
    gradient norm and MaxVio match the uninterrupted one-process run (the cross-layout tolerances of test_launch)."""
    from openk3.train.trainer import Trainer

    Trainer(_train_cfg(tmp_path / "whole"), log=lambda *a: None).run()
    want = _rows(tmp_path / "whole")
    Trainer(_train_cfg(tmp_path / "one", stop_after=1), log=lambda *a: None).run()
    for layout in ("dp", "ep"):
        shutil.copytree(tmp_path / "one", tmp_path / f"one-to-{layout}")
    runs = [(tmp_path / "one-to-dp", dict(resume=True, dp=2)), (tmp_path / "one-to-ep", dict(resume=True, ep=2)),
            (tmp_path / "dp-to-one", dict(dp=2, stop_after=1)), (tmp_path / "ep-to-one", dict(ep=2, stop_after=1))]  # fmt: skip
    run_ranks(2, _train_runs, [(str(out), kw) for out, kw in runs])
    for layout in ("dp", "ep"):
        assert len([f for f in os.listdir(tmp_path / f"{layout}-to-one" / "checkpoints" / "step-00000001")
                    if f.endswith(".distcp")]) == 2  # fmt: skip
        Trainer(_train_cfg(tmp_path / f"{layout}-to-one", resume=True), log=lambda *a: None).run()
    for out, _ in runs:
        rows = _rows(out)
        assert [r["step"] for r in rows] == [1, 2], out
        for got, ref in zip(rows, want):
            assert abs(got["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), (out, got["step"])
            assert abs(got["grad_norm"] - ref["grad_norm"]) <= 1e-4 * ref["grad_norm"], (out, got["step"])
            assert got["max_vio"] == ref["max_vio"], (out, got["step"])

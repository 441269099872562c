"""Distributed checkpoints with torch.distributed.checkpoint (DCP): save at one world size and layout, load at
another (e.g. 4 -> 2 -> 1), and export the official safetensors format from a sharded run.

Every tensor of the model state dict goes to DCP as a DTensor that says how it is laid out, so DCP can reshard on
load: FSDP2 parameters already are DTensors; the routed experts of an expert-parallel run are wrapped as
Shard(0) over the `ep` mesh dimension (replicated over `dp`); everything else is a plain replicated tensor. Names are
the model's own (`model.layers.3.block_sparse_moe.experts.w1`), which the official export maps with model/hf.py.

Legend: E experts, R ep ranks.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from openk3.parallel.dims import ParallelDims


def _expert_placements(dims: ParallelDims):
    """Over the ("dp", "ep", "cp") mesh: replicated over dp and cp, split along the expert dimension over ep."""
    return [Replicate(), Shard(0), Replicate()]


def _distributed_state(model: nn.Module, mesh: DeviceMesh | None, dims: ParallelDims) -> dict[str, torch.Tensor]:
    state = get_model_state_dict(model)
    if mesh is not None and dims.ep > 1:
        for name, p in model.named_parameters():
            if ".experts.w" in name:
                state[name] = DTensor.from_local(p.detach(), mesh, _expert_placements(dims), run_check=False)
    return state


def save_distributed(model: nn.Module, path: str, mesh: DeviceMesh | None, dims: ParallelDims) -> None:
    """Every rank writes its shards under `path` (a DCP folder); rank 0 writes the metadata."""
    dcp.save(_distributed_state(model, mesh, dims), checkpoint_id=path)


def load_distributed(model: nn.Module, path: str, mesh: DeviceMesh | None, dims: ParallelDims) -> None:
    """Fill `model` (already parallelized for this run's layout) from a DCP folder saved at any layout."""
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise FileNotFoundError(f"{path} is not a torch.distributed.checkpoint folder (no .metadata)")
    state = _distributed_state(model, mesh, dims)
    dcp.load(state, checkpoint_id=path)
    experts = {name: t for name, t in state.items() if ".experts.w" in name and isinstance(t, DTensor)}
    set_model_state_dict(model, {k: v for k, v in state.items() if k not in experts},
                         options=StateDictOptions(strict=False))  # fmt: skip
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in experts:
                p.copy_(experts[name].to_local())


def full_state_dict(model: nn.Module, mesh: DeviceMesh | None, dims: ParallelDims) -> dict[str, torch.Tensor]:
    """The whole model as plain tensors on every rank (for export and tests): FSDP shards and EP experts gathered."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if mesh is not None and dims.ep > 1:
        group = mesh["ep"].get_group()
        for name, p in model.named_parameters():
            if ".experts.w" in name:
                parts = [torch.empty_like(p) for _ in range(dist.get_world_size(group))]
                dist.all_gather(parts, p.detach().contiguous(), group=group)
                state[name] = torch.cat(parts)
    return state


def export_pretrained(model: nn.Module, path: str, mesh: DeviceMesh | None, dims: ParallelDims) -> None:
    """Write the official checkpoint format (config.json + safetensors under the release's names) from a sharded
    run: every rank joins the gathers, rank 0 builds a plain model from the full state and saves it."""
    state = full_state_dict(model, mesh, dims)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    # fully_shard swaps the module's class for an FSDP subclass; the first openk3 class in its MRO is the model's own.
    cls = next(c for c in type(model).__mro__ if c.__module__.startswith("openk3."))
    plain = cls(model.config)
    plain.load_state_dict(state)
    plain.save_pretrained(path)


def _optimizer_state(model: nn.Module, optimizer, mesh: DeviceMesh | None, dims: ParallelDims):
    """The optimizer state under parameter names, with the EP experts' moments as DTensors (see module doc)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer)
    wrapped: list[tuple[dict, str]] = []
    if mesh is not None and dims.ep > 1:
        for name, entry in state["state"].items():
            if ".experts.w" in name:
                for key, t in entry.items():
                    if isinstance(t, torch.Tensor) and t.dim() > 0:
                        entry[key] = DTensor.from_local(t, mesh, _expert_placements(dims), run_check=False)
                        wrapped.append((entry, key))
    return state, wrapped


def save_optimizer(model: nn.Module, optimizer, path: str, mesh: DeviceMesh | None, dims: ParallelDims) -> None:
    state, _ = _optimizer_state(model, optimizer, mesh, dims)
    dcp.save({"optim": state}, checkpoint_id=path)


def load_optimizer(model: nn.Module, optimizer, path: str, mesh: DeviceMesh | None, dims: ParallelDims) -> None:
    """Fill `optimizer` (built on the model of this run's layout) from a DCP folder saved at any layout."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    state, wrapped = _optimizer_state(model, optimizer, mesh, dims)
    # A parameter that never had a gradient (e.g. layer 0's first AttnRes mix, which an empty bank skips) has no
    # saved moments; it keeps the zeros that get_optimizer_state_dict initialised.
    dcp.load({"optim": state}, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
    for entry, key in wrapped:
        entry[key] = entry[key].to_local()
    set_optimizer_state_dict(model, optimizer, state)

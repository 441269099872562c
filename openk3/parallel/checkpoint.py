"""Distributed checkpoints with torch.distributed.checkpoint (DCP): every rank writes only its own shards (nothing
is gathered), and a checkpoint saved at one world size and layout loads at any other (4 -> 2 -> 1), one process
with no process group included (DCP then runs without collectives).

One DCP checkpoint holds the model (`model.<name>`), optionally the optimizer (`optim.state.<name>.<slot>`,
`optim.param_groups`) and any extra tensors the caller adds (the trainer's balancing state and RNG). Every tensor
goes to DCP as a DTensor that says how it is laid out, so DCP can reshard on load: FSDP2 parameters already are
DTensors; the routed experts of an expert-parallel run (and their optimizer moments) are wrapped as Shard(0) over
the `ep` mesh dimension (replicated over `dp`); everything else is a plain replicated tensor, which DCP writes once.
Names are the model's own (`model.layers.3.block_sparse_moe.experts.w1`); the official export maps them with
model/hf.py after `load_distributed` has filled a plain model in one process.

`storage_problem` says whether a DCP folder is complete (every byte its metadata names is on disk) without
reading tensor data. DCP's `.metadata` is a pickle and its non-tensor items (the optimizer's param groups) are
`torch.load(weights_only=False)` blobs; every load here goes through `SafeReader` and `SafePlanner` instead, which
unpickle only DCP's own metadata classes and torch's weights-only types, so a crafted checkpoint cannot run code.

Legend: E experts, R ep ranks.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._nested_dict import set_element  # DCP's own (private) helper, as its planner uses
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from openk3.parallel.dims import ParallelDims

METADATA = ".metadata"

# The globals a DCP `.metadata` pickle may name (torch 2.x writes these); anything else is refused.
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",)
_METADATA_GLOBALS = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
                     ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                     ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
                     ("pathlib", "PureWindowsPath"), ("pathlib", "Path")}  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if module in _METADATA_MODULES or (module, name) in _METADATA_GLOBALS or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{METADATA} names {module}.{name}, which a DCP checkpoint never holds")


class SafeReader(FileSystemReader):
    """DCP's file reader with `.metadata` unpickled through an allowlist (see module doc)."""

    def read_metadata(self, *args, **kwargs):
        with open(os.path.join(self.path, METADATA), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, dcp.Metadata):
            raise pickle.UnpicklingError(f"{METADATA} holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner with its non-tensor items read by `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _expert_placements(dims: ParallelDims):
    """Over the ("dp", "ep", "cp") mesh: replicated over dp and cp, split along the expert dimension over ep."""
    return [Replicate(), Shard(0), Replicate()]


def _model_state(model: nn.Module, mesh: DeviceMesh | None, dims: ParallelDims) -> dict[str, torch.Tensor]:
    state = get_model_state_dict(model)
    if mesh is not None and dims.ep > 1:
        for name, p in model.named_parameters():
            if ".experts.w" in name:
                state[name] = DTensor.from_local(p.detach(), mesh, _expert_placements(dims), run_check=False)
    return state


def _optimizer_state(model: nn.Module, optimizers, mesh: DeviceMesh | None, dims: ParallelDims):
    """The optimizer state under parameter names, with the EP experts' moments as DTensors (see module doc).
    `optimizers` is one torch optimizer or a list of them (their parameter sets disjoint)."""
    state = get_optimizer_state_dict(model, optimizers)
    wrapped: list[tuple[dict, str]] = []
    if mesh is not None and dims.ep > 1:
        for name, entry in state["state"].items():
            if ".experts.w" in name:
                # A copy: for a plain (non-FSDP) parameter this is the live optimizer's own state dict, and wrapping
                # its moments in place would break the next optimizer step after a save.
                entry = state["state"][name] = dict(entry)
                for key, t in entry.items():
                    if isinstance(t, torch.Tensor) and t.dim() > 0:
                        entry[key] = DTensor.from_local(t, mesh, _expert_placements(dims), run_check=False)
                        wrapped.append((entry, key))
    return state, wrapped


def _dcp(fn, state: dict, path: str, mesh: DeviceMesh | None, **kwargs) -> None:
    """dcp.save / dcp.load; a world of 1 (no mesh) runs without collectives, process group or not (one process is
    the intent there, so DCP's warning that it assumes one is silenced)."""
    if fn is dcp.load:
        kwargs.setdefault("planner", SafePlanner())
        kwargs["storage_reader"] = SafeReader(path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        fn(state, checkpoint_id=path, no_dist=mesh is None, **kwargs)


def save_distributed(model: nn.Module, path: str, mesh: DeviceMesh | None, dims: ParallelDims, optimizers=None,
                     extra: dict | None = None) -> None:  # fmt: skip
    """Every rank writes its shards of the model (and of `optimizers`, and the `extra` tensors, a nested dict of
    replicated tensors) under `path`, a DCP folder; the coordinator writes the metadata last. Nothing is gathered."""
    state: dict = {"model": _model_state(model, mesh, dims)}
    if optimizers is not None:
        state["optim"] = _optimizer_state(model, optimizers, mesh, dims)[0]
    state.update(extra or {})
    _dcp(dcp.save, state, path, mesh)


def load_distributed(model: nn.Module, path: str, mesh: DeviceMesh | None, dims: ParallelDims, optimizers=None,
                     extra: dict | None = None) -> None:  # fmt: skip
    """Fill `model` (already parallelized for this run's layout, or a plain model in one process), `optimizers`
    (built on it) and the `extra` tensors (filled in place; same nesting as saved) from a DCP folder saved at any
    layout."""
    if not os.path.isfile(os.path.join(path, METADATA)):
        raise FileNotFoundError(f"{path} is not a torch.distributed.checkpoint folder (no {METADATA})")
    problem = storage_problem(path)  # named here, not inside DCP's wrapped per-rank errors
    if problem is not None:
        raise ValueError(f"{path} cannot be loaded: {problem}")
    state = {"model": _model_state(model, mesh, dims), **(extra or {})}
    _dcp(dcp.load, state, path, mesh)
    experts = {name: t for name, t in state["model"].items() if ".experts.w" in name and isinstance(t, DTensor)}
    set_model_state_dict(model, {k: v for k, v in state["model"].items() if k not in experts},
                         options=StateDictOptions(strict=False))  # fmt: skip
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in experts:
                p.copy_(experts[name].to_local())
    if optimizers is None:
        return
    opt, wrapped = _optimizer_state(model, optimizers, mesh, dims)
    # A parameter that never had a gradient (e.g. layer 0's first AttnRes mix, which an empty bank skips) has no
    # saved moments; it keeps the zeros that get_optimizer_state_dict initialised (and the optimizer skips it, as it
    # has no gradient). So this load alone is partial; the model's load above is strict.
    _dcp(dcp.load, {"optim": opt}, path, mesh, planner=SafePlanner(allow_partial_load=True))
    for entry, key in wrapped:
        entry[key] = entry[key].to_local()
    set_optimizer_state_dict(model, optimizers, opt)


def full_tensors(model: nn.Module, mesh: DeviceMesh | None, dims: ParallelDims):
    """(name, whole tensor) of the laid-out `model`'s state, one at a time: an FSDP2 shard gathered with
    `full_tensor`, EP experts all-gathered over the ep group, the rest as they are. Every rank must iterate all of it
    (the gathers are collectives); a caller that copies each tensor away holds one whole tensor at a time."""
    ep_group = mesh["ep"].get_group() if mesh is not None and dims.ep > 1 else None
    for name, t in model.state_dict().items():
        if isinstance(t, DTensor):
            yield name, t.full_tensor()
        elif ep_group is not None and ".experts.w" in name:
            parts = [torch.empty_like(t) for _ in range(dims.ep)]
            dist.all_gather(parts, t.detach().contiguous(), group=ep_group)
            yield name, torch.cat(parts)
        else:
            yield name, t.detach()


def full_state_dict(model: nn.Module, mesh: DeviceMesh | None, dims: ParallelDims) -> dict[str, torch.Tensor]:
    """The whole model as plain tensors on every rank, for tests at tiny sizes (checkpoints never gather)."""
    return dict(full_tensors(model, mesh, dims))


def storage_problem(path: str, required: tuple[str, ...] = ()) -> str | None:
    """What makes DCP folder `path` unloadable, in a few words; None when its metadata reads, names the `required`
    keys and at least one `model.` tensor, and every file it names is on disk and long enough (a file cut short or
    missing is caught without reading tensor data)."""
    try:
        metadata = SafeReader(path).read_metadata()
    except FileNotFoundError:
        return f"{METADATA} is missing"
    except Exception as err:  # noqa: BLE001 - any unreadable pickle (cut short, overwritten) is a damaged file
        return f"{METADATA}: {type(err).__name__} {err}".rstrip()
    keys = metadata.state_dict_metadata.keys()
    missing = [k for k in required if k not in keys]
    if not any(k.startswith("model.") for k in keys):
        missing.append("model weights")
    if missing:
        return f"{METADATA}: no {', '.join(missing)}"
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        if os.path.getsize(file) < size:
            return f"{name}: cut short ({os.path.getsize(file)} of {size} bytes)"
    return None

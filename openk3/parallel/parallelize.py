"""`parallelize(model, mesh, dims)`: the one place that applies parallelism to a built model, in order
(torchtitan's pattern): expert parallelism (swap the MoE dispatcher, keep the local experts), then FSDP2 over the
dense parameters. The model code never learns about ranks.

FSDP2 (`fully_shard`) shards every dense parameter over all ranks that hold distinct tokens, dp x ep x cp
(flattened into one 1-D mesh); its reduction averages the gradients over them, matching a global-mean loss when every rank's loss is a mean over equally many
tokens. The routed experts are left out of FSDP2: GroupedExperts is called through `expert_forward`, not `forward`,
so FSDP2's unshard hooks would never fire for it. Under ep they are already split; over dp they are replicated,
and `sync_expert_grads` averages their gradients after backward. The router biases stay out too: quantile
balancing writes them identically on every rank (train/balance.py all-reduces its histograms over the data ranks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

from openk3.parallel.dims import ParallelDims
from openk3.parallel.ep import apply_expert_parallel


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for name, p in model.named_parameters() if ".experts.w" in name]


def router_biases(model: nn.Module) -> list[nn.Parameter]:
    """Quantile balancing overwrites these on every rank alike (from all-reduced histograms); they have no
    gradient, so they stay plain replicated tensors outside FSDP2."""
    return [p for name, p in model.named_parameters() if name.endswith("e_score_correction_bias")]


def _mesh_over(mesh: DeviceMesh, dims: ParallelDims, names: tuple[str, ...]) -> DeviceMesh | None:
    """The sub-mesh over the named dimensions that are > 1 (flattened to 1-D), or None if all are 1."""
    used = tuple(n for n in names if getattr(dims, n) > 1)
    if not used:
        return None
    return mesh[used[0]] if len(used) == 1 else mesh[used]._flatten("_".join(used))


def parallelize(model: nn.Module, mesh: DeviceMesh, dims: ParallelDims, cp=None) -> nn.Module:
    """Apply EP, CP (`cp`: a parallel.cp.ContextParallel over mesh["cp"], required when dims.cp > 1) and FSDP2."""
    if dims.ep > 1:
        apply_expert_parallel(model, mesh["ep"].get_group())
    if dims.cp > 1:
        if cp is None:
            raise ValueError("dims.cp > 1 needs a ContextParallel over the cp mesh dimension")
        from openk3.parallel.cp import apply_context_parallel

        apply_context_parallel(model, cp)
    # Dense gradients are summed over every rank that holds distinct tokens: dp x ep rows and cp positions.
    dense_mesh = _mesh_over(mesh, dims, ("dp", "ep", "cp"))
    if dense_mesh is not None:
        ignored = set(expert_parameters(model)) | set(router_biases(model))
        for layer in model.model.layers:
            fully_shard(layer, mesh=dense_mesh, ignored_params=ignored)
        fully_shard(model, mesh=dense_mesh, ignored_params=ignored)
        # The trainer calls `forward_batch` (packed documents), not `forward`: give it FSDP2's unshard hooks too.
        register_fsdp_forward_method(model, "forward_batch")
    return model


def sync_expert_grads(model: nn.Module, mesh: DeviceMesh, dims: ParallelDims) -> None:
    """Average the routed experts' gradients over their replicas (dp and cp ranks); call after backward."""
    replicas = _mesh_over(mesh, dims, ("dp", "cp"))
    if replicas is None:
        return
    group, n = replicas.get_group(), dims.dp * dims.cp
    for p in expert_parameters(model):
        if p.grad is None:  # no token reached these experts on this replica: every replica must join the all-reduce
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=group)
        p.grad.div_(n)

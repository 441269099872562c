"""`parallelize(model, mesh, dims)`: the one place that applies parallelism to a built model, in order
(torchtitan's pattern): expert parallelism (swap the MoE dispatcher, keep the local experts), then FSDP2 over the
dense parameters. The model code never learns about ranks.

FSDP2 (`fully_shard`) shards every dense parameter over the ranks that see different sequences, dp x ep (flattened
into one 1-D mesh when both are > 1; the 2-D hybrid-sharding form failed on gloo with mixed Tensor/DTensor
embedding inputs); its reduction averages the gradients over them, matching a global-mean loss when every rank's loss is a mean over equally many
tokens. The routed experts are left out of FSDP2: GroupedExperts is called through `expert_forward`, not `forward`,
so FSDP2's unshard hooks would never fire for it. Under ep they are already split; over dp they are replicated,
and `sync_expert_grads` averages their gradients after backward. The router biases stay out too: quantile
balancing writes them identically on every rank (train/balance.py all-reduces its histograms over the data ranks).
"""

from __future__ import annotations

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


def parallelize(model: nn.Module, mesh: DeviceMesh, dims: ParallelDims) -> nn.Module:
    if dims.cp > 1:
        raise ValueError("context parallelism (--cp > 1) is not built yet")
    if dims.ep > 1:
        apply_expert_parallel(model, mesh["ep"].get_group())
    if dims.data_ranks > 1:
        if dims.dp > 1 and dims.ep > 1:
            dense_mesh = mesh["dp", "ep"]._flatten("dp_ep")  # one 1-D shard group over every data rank
        else:
            dense_mesh = mesh["dp"] if dims.dp > 1 else mesh["ep"]
        ignored = set(expert_parameters(model)) | set(router_biases(model))
        for layer in model.model.layers:
            fully_shard(layer, mesh=dense_mesh, ignored_params=ignored)
        fully_shard(model, mesh=dense_mesh, ignored_params=ignored)
        # The trainer calls `forward_batch` (packed documents), not `forward`: give it FSDP2's unshard hooks too.
        register_fsdp_forward_method(model, "forward_batch")
    return model


def sync_expert_grads(model: nn.Module, mesh: DeviceMesh, dims: ParallelDims) -> None:
    """Average the routed experts' gradients over dp (their replicas); call after backward."""
    if dims.dp == 1:
        return
    group = mesh["dp"].get_group()
    for p in expert_parameters(model):
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(dims.dp)

"""Expert parallelism: the experts of every StableLatentMoE are split evenly over the ranks of an `ep` process
group, and the layer's `dispatcher` swap point is replaced by an all-to-all one. The model code is unchanged.

    dispatch: each (token, slot) pair's latent row goes to the rank owning its expert (rank = e // E_local), rows
              sorted by expert id so each destination's block is contiguous; counts are exchanged first
    compute:  every rank runs its local experts once on the rows it received
    combine:  results travel back by the reverse all-to-all; each token adds its k weighted outputs in fp32 in
              ascending expert id, the order `local_dispatch` uses

The row all-to-alls are autograd functions (the backward is the reverse all-to-all), so gradients reach both the
tokens' owners and the experts' owners. An expert's gradient sums the losses of every EP rank that sent it tokens;
with each rank's loss a mean over its own tokens (the data-parallel convention), the global-mean gradient is that
sum over the EP degree, so the dispatcher scales the expert weights' gradients by 1 / ep (`_GradScale`).

Legend: T tokens, k experts per token, P = T*k (token, slot) pairs, L latent width, E experts, R ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from openk3.model.moe import GroupedExperts, StableLatentMoE, combine_topk
from openk3.ops.situ import situ_glu


class _GradScale(torch.autograd.Function):
    """Identity forward; multiplies the gradient by `scale` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _expert_forward(experts: GroupedExperts, e: int, z_nL: torch.Tensor, scale: float) -> torch.Tensor:
    """`GroupedExperts.expert_forward` with the expert's weight gradients scaled by `scale`."""
    w1, w3, w2 = (_GradScale.apply(w[e], scale) for w in (experts.w1, experts.w3, experts.w2))
    h = situ_glu(z_nL @ w1.t(), z_nL @ w3.t(), experts.beta, experts.linear_beta)
    return h @ w2.t()


class AllToAllDispatcher:
    def __init__(self, group: dist.ProcessGroup, num_experts: int):
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if num_experts % self.world:
            raise ValueError(f"ep degree {self.world} must divide num_experts {num_experts}")
        self.num_local = num_experts // self.world

    def _exchange_counts(self, send_R: torch.Tensor) -> torch.Tensor:
        recv_R = torch.empty_like(send_R)
        dist.all_to_all_single(recv_R, send_R, group=self.group)
        return recv_R

    def __call__(self, z_TL: torch.Tensor, idx_Tk: torch.Tensor, w_Tk: torch.Tensor, experts: GroupedExperts):
        _T, k = idx_Tk.shape
        flat_P = idx_Tk.reshape(-1)
        order_P = torch.argsort(flat_P, stable=True)  # pairs by expert, hence by destination rank
        expert_P = flat_P[order_P]
        send_R = torch.bincount(expert_P // self.num_local, minlength=self.world)
        recv_R = self._exchange_counts(send_R)
        send, recv = send_R.tolist(), recv_R.tolist()
        rows_PL = z_TL[order_P // k]
        recv_rows = _AllToAll.apply(rows_PL, recv, send, self.group)
        recv_expert = torch.empty(sum(recv), dtype=expert_P.dtype, device=expert_P.device)
        dist.all_to_all_single(recv_expert, expert_P.contiguous(), recv, send, group=self.group)
        local = recv_expert - self.rank * self.num_local
        by_expert = torch.argsort(local, stable=True)
        counts = torch.bincount(local, minlength=self.num_local).tolist()
        rows_sorted, outs, start = recv_rows[by_expert], [], 0
        for e, n in enumerate(counts):
            if n:
                outs.append(_expert_forward(experts, e, rows_sorted[start : start + n], 1.0 / self.world))
                start += n
        if not outs:
            # No rows here (routing sent every token elsewhere). The empty output must still hang off recv_rows and
            # the expert weights: else autograd drops this rank's reverse all-to-alls from the backward while the
            # other ranks wait in them (the EP hang), and the weights get no gradient where one process gives zeros.
            outs.append(_expert_forward(experts, 0, rows_sorted[:0], 1.0 / self.world))
        out_sorted = torch.cat(outs)
        out_recv = out_sorted[torch.argsort(by_expert)]
        back_PL = _AllToAll.apply(out_recv, send, recv, self.group)
        return combine_topk(back_PL[torch.argsort(order_P)], w_Tk, z_TL.dtype)


class _AllToAll(torch.autograd.Function):
    """`dist.all_to_all_single` of rows (`recv[r]` rows arrive from rank r, `send[r]` leave for it) whose backward
    sends the gradients home by the reverse all-to-all. torch.distributed.nn.functional.all_to_all_single is the same
    function but deprecated (a FutureWarning per call site and process); its suggested replacement, the private
    functional collectives, returns asynchronous tensors."""

    @staticmethod
    def forward(ctx, x_NL: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out_ML = x_NL.new_empty(sum(recv), *x_NL.shape[1:])
        dist.all_to_all_single(out_ML, x_NL.contiguous(), recv, send, group=group)
        return out_ML

    @staticmethod
    def backward(ctx, grad_ML: torch.Tensor):
        return _AllToAll.apply(grad_ML.contiguous(), ctx.send, ctx.recv, ctx.group), None, None, None


def apply_expert_parallel(model: nn.Module, group: dist.ProcessGroup) -> int:
    """Keep only this rank's slice of every MoE layer's experts and swap in the all-to-all dispatcher. Returns the
    number of MoE layers changed."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    changed = 0
    for module in model.modules():
        if isinstance(module, StableLatentMoE):
            dispatcher = AllToAllDispatcher(group, module.experts.w1.shape[0])
            lo, hi = rank * dispatcher.num_local, (rank + 1) * dispatcher.num_local
            for name in ("w1", "w2", "w3"):
                full = getattr(module.experts, name)
                setattr(module.experts, name, nn.Parameter(full.detach()[lo:hi].clone(), full.requires_grad))
            module.dispatcher = dispatcher
            module.expert_range = (lo, hi)
            changed += 1
    assert world >= 1
    return changed

"""Context parallelism: every rank of the `cp` group holds one contiguous shard of each sequence (rank r the r-th
piece along time), and the KDA and MLA layers exchange what crosses shard boundaries (spec/kda.md §9). AttnRes,
norms and FFNs are per token and need nothing.

KDA, per layer (`kda_forward`):
  1. conv halo: every rank's last W-1 pre-conv rows of q, k, v are all-gathered; rank r uses rank r-1's as its conv
     tail (rank 0: zeros);
  2. summary: each rank computes its shard's affine state map (M, S_ext) from zero state (ops/kda/affine.py) and the
     summaries are all-gathered once: H·K·(K+V) fp32 per sequence, independent of the shard length;
  3. rank r folds its predecessors, S_in = M_{r-1}(… (M_0·0 + S_ext_0) …) + S_ext_{r-1}, and runs the ordinary
     chunked kernel from S_in.
MLA, per layer (`mla_forward`): the 576-wide latents of every shard are all-gathered; rank r attends causally over the
latents of ranks 0..r (positions are global: the earlier shards come first).

All gathers are autograd functions whose backward all-reduces the gathered gradient and keeps this rank's slice
(gloo has no reduce-scatter), so the backward protocol of §9.3 falls out of autograd. Every rank ties every
gathered tensor into its graph (rank 0 through zero-weighted uses), so all ranks run the same backward collectives
in the same order. `CommCounter` records the
bytes each collective moves. Packed documents inside a shard are not handled yet: one sequence per row.

Legend: N rows (sequences), L this rank's shard length, P = H*K, W conv width, R latent width, C cp ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from openk3.model.batch import ForwardBatch
from openk3.model.kda import KimiDeltaAttention
from openk3.model.mla import GatedMLA
from openk3.ops.attention.ref import causal_attention
from openk3.ops.conv import short_conv
from openk3.ops.dispatch import kda_chunked
from openk3.ops.kda.affine import kda_segment_summary
from openk3.ops.norm import l2_norm
from openk3.utils import fp32_region


@dataclass
class CommCounter:
    """Bytes this rank contributed to each kind of collective (forward and backward)."""

    bytes: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, tensor: torch.Tensor) -> None:
        self.bytes[kind] = self.bytes.get(kind, 0) + tensor.numel() * tensor.element_size()


class _AllGather(torch.autograd.Function):
    """All-gather equal-shaped tensors along a new leading dim; backward sums the gradients over ranks (all-reduce)
    and returns this rank's slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, counter: CommCounter | None, kind: str) -> torch.Tensor:
        ctx.group, ctx.counter, ctx.kind = group, counter, kind
        ctx.rank = dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        if counter is not None:
            counter.add(kind, x)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        if ctx.counter is not None:
            ctx.counter.add(ctx.kind + "_backward", grad)
        return grad[ctx.rank], None, None, None


class ContextParallel:
    def __init__(self, group: dist.ProcessGroup, shard_lengths: list[int], counter: CommCounter | None = None):
        """`shard_lengths[r]`: tokens of each row that rank r holds (rank order = time order)."""
        self.group, self.lengths, self.counter = group, shard_lengths, counter
        self.rank = dist.get_rank(group)
        if len(shard_lengths) != dist.get_world_size(group) or min(shard_lengths) < 1:
            raise ValueError(f"need one positive shard length per cp rank, got {shard_lengths}")

    def gather(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        return _AllGather.apply(x, self.group, self.counter, kind)

    def _rows(self, batch: ForwardBatch) -> tuple[int, int]:
        if not batch.uniform or batch.cache is not None or batch.row_len is not None:
            raise ValueError("context parallelism takes equal-length rows of one sequence each, without a cache")
        return batch.num_seqs, batch.max_len

    def kda_forward(self, layer: KimiDeltaAttention, x_TD: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        N, L = self._rows(batch)
        H, K = layer.num_heads, layer.head_dim
        pre, g_THK, beta_TH = layer._projections(x_TD)
        convs = (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)
        W1 = layer.q_conv1d.weight.shape[-1] - 1
        if min(self.lengths) < W1:
            raise ValueError(f"every cp shard needs at least {W1} tokens (the conv halo), got {self.lengths}")
        outs = []
        for x_TP, conv in zip(pre, convs):
            x_NLP = x_TP.view(N, L, -1)
            last_NWP = x_NLP[:, -W1:]
            halos = self.gather(last_NWP, "conv_halo")
            # Rank 0's tail is zeros, but it still takes a (zero) dependency on the gather: every rank must reach
            # the gather's backward collective, in the same order.
            tail = halos[self.rank - 1] if self.rank > 0 else 0.0 * halos[0]
            y_NLP, _ = short_conv(x_NLP, conv.weight, tail)
            outs.append(y_NLP)
        q_NLHK = l2_norm(outs[0].view(N, L, H, K)).to(x_TD.dtype)
        k_NLHK = l2_norm(outs[1].view(N, L, H, K)).to(x_TD.dtype)
        v_NLHV, g_NLHK, beta_NLH = outs[2].view(N, L, H, K), g_THK.view(N, L, H, K), beta_TH.view(N, L, H)
        with fp32_region():
            M_NHKK, S_NHKV = kda_segment_summary(q_NLHK, k_NLHK, v_NLHV, g_NLHK, beta_NLH)
            summaries = self.gather(torch.cat([M_NHKK, S_NHKV], dim=-1), "kda_summary")  # [C, N, H, K, K+V]
            state = 0.0 * summaries[0, ..., K:]  # rank 0 starts from zeros (still tied to the gather, see above)
            for j in range(self.rank):
                M_j, S_j = summaries[j].split([K, K], dim=-1)
                state = M_j @ state + S_j
            o_NLHV, _ = kda_chunked(q_NLHK, k_NLHK, v_NLHV, g_NLHK, beta_NLH, initial_state=state)
        return layer._output(o_NLHV.reshape(N * L, H, K), x_TD)

    def mla_forward(self, layer: GatedMLA, x_TD: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        N, L = self._rows(batch)
        q_NLHD = layer.queries(x_TD).view(N, L, layer.num_heads, -1)
        latent_NLR = layer.latent(x_TD).view(N, L, -1)
        # Shards may differ in length by one token: pad to the longest for the gather, then cut each back.
        longest = max(self.lengths)
        padded = torch.cat([latent_NLR, latent_NLR.new_zeros(N, longest - L, latent_NLR.shape[-1])], 1)
        gathered = self.gather(padded, "mla_latent")
        keys_NSR = torch.cat([gathered[j, :, : self.lengths[j]] for j in range(self.rank + 1)], dim=1)
        k, v = layer.expand(keys_NSR)
        attn_NLHV = causal_attention(q_NLHD, k, v, layer.scale)  # queries are the last L of the S keys
        return layer.output(attn_NLHV.reshape(N * L, layer.num_heads, -1), x_TD)


def shard_lengths(total: int, degree: int) -> list[int]:
    """Contiguous shards as equal as possible, the longer ones first (any total, any degree <= total)."""
    if not 1 <= degree <= total:
        raise ValueError(f"cannot split {total} tokens over {degree} cp ranks")
    base, extra = divmod(total, degree)
    return [base + (1 if r < extra else 0) for r in range(degree)]


def apply_context_parallel(model: nn.Module, cp: ContextParallel) -> int:
    """Install the CP forwards on every KDA and MLA layer (the model's `context_parallel` swap points)."""
    count = 0
    for module in model.modules():
        if isinstance(module, KimiDeltaAttention):
            module.context_parallel = cp.kda_forward
            count += 1
        elif isinstance(module, GatedMLA):
            module.context_parallel = cp.mla_forward
            count += 1
    return count

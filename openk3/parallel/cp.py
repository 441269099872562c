"""Context parallelism: every rank of the `cp` group holds one contiguous shard of each sequence (rank r the r-th
piece along time), and the KDA and MLA layers exchange what crosses shard boundaries (spec/kda.md §9). AttnRes,
norms and FFNs are per token and need nothing.

KDA, per layer (`kda_forward`):
  1. conv halo: every rank's last W-1 pre-conv rows of q, k, v are all-gathered; rank r uses rank r-1's as the conv
     tail of each row's first segment when it continues a document (zeros otherwise);
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
bytes each collective moves.

Packed documents: rows are cut into contiguous shards whatever their documents; only a row's first local segment
can continue a document from the previous rank (its conv tail and entering state come from there), and a row hands
on the state of its last segment, with M = 0 when that segment starts inside the shard, so resets compose through
the same fold. MLA masks by global position and global document id.

Legend: N rows (sequences), L this rank's shard length, P = H*K, W conv width, R latent width, C cp ranks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from openk3.model.batch import ForwardBatch
from openk3.model.kda import KimiDeltaAttention
from openk3.model.mla import GatedMLA
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


@dataclass
class _Layout:
    """Where this rank's shard sits in the global rows, per row: whether its first local segment continues a
    document from the previous rank, its last segment's length, and every position's global document id."""

    lengths: list[int]  # shard length of every rank
    start: int
    first_continues: list[bool]
    last_segment: list[int]
    segments_per_row: list[int]
    doc_id_RL: torch.Tensor  # [R, L_total] global document index of every position


class ContextParallel:
    def __init__(self, group: dist.ProcessGroup, counter: CommCounter | None = None):
        self.group, self.counter = group, counter
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.layout: _Layout | None = None

    def gather(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        return _AllGather.apply(x, self.group, self.counter, kind)

    def shard(self, input_ids_RL: torch.Tensor, doc_lens: list[list[int]]) -> ForwardBatch:
        """Global rows of packed documents -> this rank's ForwardBatch: its contiguous time slice of every row, the
        documents cut at the shard edges. Remembers the layout for the KDA and MLA layers of the next forward."""
        L = input_ids_RL.shape[1]
        lengths = shard_lengths(L, self.world)
        start = sum(lengths[: self.rank])
        end = start + lengths[self.rank]
        local_lens, first_cont, last_len, doc_ids = [], [], [], []
        for lens in doc_lens:
            bounds = [0, *torch.tensor(lens).cumsum(0).tolist()]
            if bounds[-1] != L or min(lens) <= 0:
                raise ValueError(f"document lengths {lens} must be positive and sum to the row length {L}")
            segs = [(max(a, start), min(b, end)) for a, b in itertools.pairwise(bounds) if a < end and b > start]
            local_lens.append([b - a for a, b in segs])
            first_cont.append(start not in bounds)  # the document at `start` began on an earlier rank
            last_len.append(segs[-1][1] - segs[-1][0])
            doc_ids.append(torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)))
        self.layout = _Layout(lengths, start, first_cont, last_len, [len(x) for x in local_lens],
                              torch.stack(doc_ids))  # fmt: skip
        return ForwardBatch.from_rows(input_ids_RL[:, start:end], local_lens)

    def _local(self, batch: ForwardBatch) -> tuple[_Layout, int, int]:
        lay = self.layout
        if lay is None or batch.row_len != lay.lengths[self.rank] or batch.cache is not None:
            raise ValueError("context parallelism runs on the ForwardBatch from ContextParallel.shard(), no cache")
        return lay, batch.input_ids_T.shape[0] // batch.row_len, batch.row_len

    def kda_forward(self, layer: KimiDeltaAttention, x_TD: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        lay, R, L = self._local(batch)
        H, K = layer.num_heads, layer.head_dim
        W1 = layer.q_conv1d.weight.shape[-1] - 1
        if min(lay.lengths) < W1:
            raise ValueError(f"every cp shard needs at least {W1} tokens (the conv halo), got {lay.lengths}")
        first_seg = torch.tensor([0, *torch.tensor(lay.segments_per_row).cumsum(0)[:-1].tolist()])
        last_seg = torch.tensor(lay.segments_per_row).cumsum(0) - 1
        cont_R = torch.tensor(lay.first_continues, dtype=x_TD.dtype)
        pre, g_THK, beta_TH = layer._projections(x_TD)
        # Halo rows may only carry this rank's last document: earlier positions are another document's (zeros).
        keep_RW = (torch.arange(L - W1, L)[None, :] >= L - torch.tensor(lay.last_segment)[:, None]).to(x_TD.dtype)
        convs = (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)
        outs = []
        for x_TP, conv in zip(pre, convs):
            halos = self.gather(x_TP.view(R, L, -1)[:, -W1:] * keep_RW[..., None], "conv_halo")
            # Rank 0 takes a zero-weighted dependency on the gather so that every rank reaches its backward
            # collective, in the same order.
            prev = halos[self.rank - 1] if self.rank > 0 else 0.0 * halos[0]
            tails = x_TP.new_zeros(batch.num_seqs, W1, x_TP.shape[-1]).index_copy(
                0, first_seg, prev * cont_R[:, None, None]
            )
            outs.append(layer._conv(x_TP, conv, tails, batch)[0])
        T = x_TD.shape[0]
        q, k = (l2_norm(y.view(T, H, K)).to(x_TD.dtype)[None] for y in outs[:2])
        v, g, beta = outs[2].view(1, T, H, K), g_THK[None], beta_TH[None]
        cu = batch.cu_seqlens
        with fp32_region():
            M_SHKK, S_SHKV = kda_segment_summary(q, k, v, g, beta, cu_seqlens=cu)
            # What a row hands to the next rank: its last segment's map; M = 0 unless that segment also continues
            # from the previous rank (a document that starts inside the shard forgets everything before it).
            passes = torch.tensor([n == 1 and c for n, c in zip(lay.segments_per_row, lay.first_continues)])
            M_RHKK = M_SHKK[last_seg] * passes.to(M_SHKK.dtype)[:, None, None, None]
            summaries = self.gather(torch.cat([M_RHKK, S_SHKV[last_seg]], dim=-1), "kda_summary")  # [C, R, H, K, K+V]
            state = 0.0 * summaries[0, ..., K:]
            for j in range(self.rank):
                M_j, S_j = summaries[j].split([K, K], dim=-1)
                state = M_j @ state + S_j
            init = state.new_zeros(batch.num_seqs, H, K, K).index_copy(
                0, first_seg, state * cont_R[:, None, None, None]
            )
            o, _ = kda_chunked(q, k, v, g, beta, initial_state=init, cu_seqlens=cu)
        return layer._output(o[0], x_TD)

    def mla_forward(self, layer: GatedMLA, x_TD: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        lay, R, L = self._local(batch)
        q_RLHD = layer.queries(x_TD).view(R, L, layer.num_heads, -1)
        latent_RLW = layer.latent(x_TD).view(R, L, -1)
        # Shards may differ in length by one token: pad to the longest for the gather, then cut each back.
        longest = max(lay.lengths)
        padded = torch.cat([latent_RLW, latent_RLW.new_zeros(R, longest - L, latent_RLW.shape[-1])], 1)
        gathered = self.gather(padded, "mla_latent")
        keys_RSW = torch.cat([gathered[j, :, : lay.lengths[j]] for j in range(self.rank + 1)], dim=1)
        S = keys_RSW.shape[1]  # = lay.start + L: every position up to this shard's end
        k, v = layer.expand(keys_RSW)
        q_pos = torch.arange(lay.start, lay.start + L)
        doc = lay.doc_id_RL[:, :S]
        allowed_RLS = (torch.arange(S)[None, None, :] <= q_pos[None, :, None]) & (
            doc[:, None, :] == doc[:, lay.start : lay.start + L, None]
        )
        with fp32_region():
            qf, kf, vf = (t.float().transpose(1, 2) for t in (q_RLHD, k, v))  # [R, H, ., D]
            o = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=allowed_RLS[:, None], scale=layer.scale)
        attn = o.transpose(1, 2).to(v.dtype)
        return layer.output(attn.reshape(R * L, layer.num_heads, -1), x_TD)


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

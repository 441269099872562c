"""Context parallelism: every rank of the `cp` group holds one contiguous shard of each sequence (rank r the r-th
piece along time), and the KDA and MLA layers exchange what crosses shard boundaries. AttnRes, norms and FFNs are
per token and need nothing.

`ContextParallel.shard` returns this rank's ForwardBatch carrying a `ShardLayout` as `batch.context_parallel`: the
layers run their one forward and call its hand-off methods where something crosses a shard boundary.

KDA, per layer (the hand-off `ShardLayout.kda_handoff`, called by KimiDeltaAttention.forward):
  1. conv halo: every rank's last W-1 pre-conv rows of q, k, v are all-gathered; rank r uses rank r-1's as the conv
     tail of each row's first segment when it continues a document (zeros otherwise);
  2. summary: each rank computes its shard's affine state map (M, S_ext) from zero state (ops/kda/affine.py) and the
     summaries are all-gathered once: H·K·(K+V) fp32 per sequence, independent of the shard length;
  3. rank r folds its predecessors, S_in = M_{r-1}(… (M_0·0 + S_ext_0) …) + S_ext_{r-1}, and runs the ordinary
     chunked kernel from S_in (the layer's own call).
MLA, per layer (the hand-off `ShardLayout.mla_contexts`, called by GatedMLA.forward): the 576-wide latents of every
shard are all-gathered; rank r attends causally over the latents of ranks 0..r (positions are global: the earlier
shards come first).

All gathers are autograd functions whose backward all-reduces the gathered gradient and keeps this rank's slice
(gloo has no reduce-scatter), so the backward hand-off (each rank's entering-state gradient folded back over the
ranks after it, the reverse of the forward fold) falls out of autograd. Every rank ties every gathered tensor into
its graph (rank 0 through zero-weighted uses), so all ranks run the same backward collectives in the same order.
`CommCounter` records the bytes each collective moves.

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
from torch import nn

from openk3.model.batch import ForwardBatch, Mode
from openk3.model.kda import KimiDeltaAttention
from openk3.model.mla import GatedMLA, MLAContext
from openk3.ops.kda.affine import kda_segment_summary


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
class ShardLayout:
    """Where this rank's shard sits in the global rows, per row: whether its first local segment continues a
    document from the previous rank, its last segment's length, and every position's global document id. Built by
    `ContextParallel.shard` and carried by the shard's ForwardBatch (`context_parallel`), so each step's layout
    travels with its batch; its methods are the layers' context-parallel hand-offs."""

    cp: ContextParallel
    lengths: list[int]  # shard length of every rank
    start: int
    first_continues: list[bool]
    last_segment: list[int]
    segments_per_row: list[int]
    doc_id_RL: torch.Tensor  # [R, L_total] global document index of every position

    def kda_handoff(self, batch: ForwardBatch) -> KDAShardHandOff:
        return KDAShardHandOff(self, batch)

    def mla_contexts(self, latent_TR: torch.Tensor, batch: ForwardBatch) -> list[MLAContext]:
        """GatedMLA's hand-off on a cp shard: the latents of every shard are all-gathered, and this rank's queries
        attend over those of ranks 0..r (global positions, earlier shards first), masked by global position and
        global document id."""
        cp, L = self.cp, batch.row_len
        if batch.mode is not Mode.FULL or L != self.lengths[cp.rank]:
            raise ValueError("context parallelism runs on the ForwardBatch from ContextParallel.shard(), no cache")
        R = latent_TR.shape[0] // L
        latent_RLW = latent_TR.view(R, L, -1)
        # Shards may differ in length by one token: pad to the longest for the gather, then cut each back.
        padded = torch.cat([latent_RLW, latent_RLW.new_zeros(R, max(self.lengths) - L, latent_RLW.shape[-1])], 1)
        gathered = cp.gather(padded, "mla_latent")
        keys_RSW = torch.cat([gathered[j, :, : self.lengths[j]] for j in range(cp.rank + 1)], dim=1)
        S = keys_RSW.shape[1]  # = start + L: every position up to this shard's end
        q_pos = torch.arange(self.start, self.start + L)
        doc = self.doc_id_RL[:, :S]
        allowed_RLS = (torch.arange(S)[None, None, :] <= q_pos[None, :, None]) & (
            doc[:, None, :] == doc[:, self.start : self.start + L, None]
        )
        return [MLAContext(slice(0, R * L), keys_RSW, allowed_RLS)]


class KDAShardHandOff:
    """KimiDeltaAttention's hand-off on a cp shard: the conv tails come from the previous rank's halo, the
    entering state from folding the predecessors' summaries; nothing leaves but through those exchanges."""

    def __init__(self, lay: ShardLayout, batch: ForwardBatch):
        cp = lay.cp
        if batch.mode is not Mode.FULL or batch.row_len != lay.lengths[cp.rank]:
            raise ValueError("context parallelism runs on the ForwardBatch from ContextParallel.shard(), no cache")
        self.lay, self.cp, self.batch = lay, cp, batch
        self.R, self.L = batch.input_ids_T.shape[0] // batch.row_len, batch.row_len
        segs = torch.tensor(lay.segments_per_row)
        self.first_seg = torch.tensor([0, *segs.cumsum(0)[:-1].tolist()])
        self.last_seg = segs.cumsum(0) - 1

    def conv_tails(self, pre_TP, width: int):
        """Rank r-1's last W-1 pre-conv rows of each row, as the tail of that row's first segment when it continues
        a document (zeros otherwise)."""
        lay, R, L, W1 = self.lay, self.R, self.L, width - 1
        if min(lay.lengths) < W1:
            raise ValueError(f"every cp shard needs at least {W1} tokens (the conv halo), got {lay.lengths}")
        dtype = pre_TP[0].dtype
        cont_R = torch.tensor(lay.first_continues, dtype=dtype)
        # Halo rows may only carry this rank's last document: earlier positions are another document's (zeros).
        keep_RW = (torch.arange(L - W1, L)[None, :] >= L - torch.tensor(lay.last_segment)[:, None]).to(dtype)
        tails = []
        for x_TP in pre_TP:
            halos = self.cp.gather(x_TP.view(R, L, -1)[:, -W1:] * keep_RW[..., None], "conv_halo")
            # Rank 0 takes a zero-weighted dependency on the gather so that every rank reaches its backward
            # collective, in the same order.
            prev = halos[self.cp.rank - 1] if self.cp.rank > 0 else 0.0 * halos[0]
            tails.append(x_TP.new_zeros(self.batch.num_seqs, W1, x_TP.shape[-1]).index_copy(
                0, self.first_seg, prev * cont_R[:, None, None]
            ))  # fmt: skip
        return tuple(tails)

    def initial_state(self, q_THK, k_THK, v_THV, g_THK, beta_TH) -> torch.Tensor:
        """Each segment's entering state: the fold of the predecessors' shard summaries for a row's first segment
        when it continues a document, zeros for every other segment."""
        lay, K = self.lay, q_THK.shape[-1]
        M_SHKK, S_SHKV = kda_segment_summary(
            q_THK[None], k_THK[None], v_THV[None], g_THK[None], beta_TH[None], cu_seqlens=self.batch.cu_seqlens
        )
        # What a row hands to the next rank: its last segment's map; M = 0 unless that segment also continues
        # from the previous rank (a document that starts inside the shard forgets everything before it).
        passes = torch.tensor([n == 1 and c for n, c in zip(lay.segments_per_row, lay.first_continues)])
        M_RHKK = M_SHKK[self.last_seg] * passes.to(M_SHKK.dtype)[:, None, None, None]
        summaries = self.cp.gather(torch.cat([M_RHKK, S_SHKV[self.last_seg]], dim=-1), "kda_summary")
        state = 0.0 * summaries[0, ..., K:]  # [C, R, H, K, K+V] gathered; rank 0's zero-weighted dependency
        for j in range(self.cp.rank):
            M_j, S_j = summaries[j].split([K, K], dim=-1)
            state = M_j @ state + S_j
        cont_R = torch.tensor(lay.first_continues, dtype=state.dtype)
        return state.new_zeros(self.batch.num_seqs, *state.shape[1:]).index_copy(
            0, self.first_seg, state * cont_R[:, None, None, None]
        )

    def store(self, tails, state_NHKV) -> None:
        """Nothing to keep: a shard's tails and final states reach the next rank through the exchanges above."""


class ContextParallel:
    def __init__(self, group: dist.ProcessGroup, counter: CommCounter | None = None):
        self.group, self.counter = group, counter
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def gather(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        return _AllGather.apply(x, self.group, self.counter, kind)

    def sum(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        """The sum of every rank's equal-shaped `x` (an all-reduce through autograd: each rank's gradient is the
        sum of every rank's gradient of the result). The training losses' per-sequence sums on shards use it."""
        return self.gather(x, kind).sum(0)

    @torch.no_grad()
    def gather_positions(self, x_T: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """The whole row back from its shards (no gradient): rank r's `x_T` holds positions of shard r, `lengths`
        the shard lengths (they may differ by one)."""
        if x_T.shape[0] != lengths[self.rank]:
            raise ValueError(f"this rank holds {x_T.shape[0]} positions, its shard has {lengths[self.rank]}")
        longest = max(lengths)
        padded = torch.cat([x_T, x_T.new_zeros(longest - x_T.shape[0], *x_T.shape[1:])]).contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([part[:n] for part, n in zip(parts, lengths)])

    def shard(self, input_ids_RL: torch.Tensor, doc_lens: list[list[int]]) -> ForwardBatch:
        """Global rows of packed documents -> this rank's ForwardBatch: its contiguous time slice of every row, the
        documents cut at the shard edges, carrying its `ShardLayout` (`batch.context_parallel`)."""
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
        batch = ForwardBatch.from_rows(input_ids_RL[:, start:end], local_lens)
        batch.context_parallel = ShardLayout(self, lengths, start, first_cont, last_len, [len(x) for x in local_lens],
                                             torch.stack(doc_ids))  # fmt: skip
        return batch


def shard_lengths(total: int, degree: int) -> list[int]:
    """Contiguous shards as equal as possible, the longer ones first (any total, any degree <= total)."""
    if not 1 <= degree <= total:
        raise ValueError(f"cannot split {total} tokens over {degree} cp ranks")
    base, extra = divmod(total, degree)
    return [base + (1 if r < extra else 0) for r in range(degree)]


def apply_context_parallel(model: nn.Module, cp: ContextParallel) -> int:
    """Nothing to install: the KDA and MLA layers call the hand-offs that the shard's batch carries
    (`batch.context_parallel`). Returns the number of KDA and MLA layers context parallelism reaches."""
    return sum(isinstance(module, (KimiDeltaAttention, GatedMLA)) for module in model.modules())

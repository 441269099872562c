"""The cache the model sees during one engine forward: per-layer views over the pools, for the N sequences of the
batch. They implement the entry interface of model/cache.py, so the model runs unchanged on paged memory:

    KDA view: load() gathers the batch's slots; store() scatters the new state and tails back; record() keeps the
              inputs of a verify pass (spec/serving.md §4.3) for the fold
    MLA view: past(i) gathers sequence i's latents from its pages; append(i, x) writes new latents into them

Sequence i writes positions start_i, start_i + 1, ... of its page table; reads stop at what it has written, so an
unwritten (NaN-poisoned) position can never be read.

Legend: N sequences, S tokens of one sequence, R latent width, B page size.
"""

from __future__ import annotations

import torch

from openk3.model.cache import VerifyStep
from openk3.serve.kv.block_pool import HybridPools


class KDASlotView:
    def __init__(self, pools: HybridPools, index: int, slots_N: torch.Tensor, records: list[VerifyStep] | None):
        self.pools, self.index, self.slots_N, self.records = pools, index, slots_N, records

    def load(self):
        conv = self.pools.conv_Nk3SWP[self.index]
        tails = tuple(conv[j].index_select(0, self.slots_N) for j in range(3))
        return tails, self.pools.state_NkSHKV[self.index].index_select(0, self.slots_N)

    def store(self, tails, state_NHKV: torch.Tensor) -> None:
        conv = self.pools.conv_Nk3SWP[self.index]
        for j in range(3):
            conv[j].index_copy_(0, self.slots_N, tails[j].to(conv.dtype))
        self.pools.state_NkSHKV[self.index].index_copy_(0, self.slots_N, state_NHKV)

    def record(self, step: VerifyStep) -> None:
        assert self.records is not None, "record() outside a verify pass"
        self.records.append(step)


class MLAPageView:
    def __init__(
        self, pools: HybridPools, index: int, flat_index: list[torch.Tensor], start: list[int], runs: list[int | None]
    ):
        self.flat_RR = pools.latent_MNBR[index].view(-1, pools.latent_MNBR.shape[-1])  # [NB*B, R]
        self.flat_index, self.written, self.runs = flat_index, list(start), runs

    def past(self, i: int) -> torch.Tensor:
        """[S_i, R]: a view of the pool when the sequence's pages are consecutive, else a gathered copy."""
        if self.runs[i] is not None:
            return self.flat_RR[self.runs[i] : self.runs[i] + self.written[i]]
        return self.flat_RR.index_select(0, self.flat_index[i][: self.written[i]])

    def append(self, i: int, latents_SR: torch.Tensor) -> None:
        n = latents_SR.shape[0]
        idx = self.flat_index[i][self.written[i] : self.written[i] + n]
        assert idx.numel() == n, "sequence writes past the pages allocated for this step"
        self.flat_RR.index_copy_(0, idx, latents_SR.to(self.flat_RR.dtype))
        self.written[i] += n


class PagedCache:
    """`ForwardBatch.cache` for an engine step: `.layers[l]` is layer l's view; `records[j]` collects the verify
    steps of the j-th KDA layer when `verify` is set."""

    def __init__(
        self,
        pools: HybridPools,
        slots: list[int],
        block_tables: list[list[int]],
        start: list[int],
        lengths: list[int],
        verify: bool = False,
    ):
        device = pools.state_NkSHKV.device
        self.num_seqs = len(slots)
        slots_N = torch.tensor(slots, dtype=torch.long, device=device)
        B = pools.block_size
        flat_index, runs = [], []
        for table, s, n in zip(block_tables, start, lengths, strict=True):
            pos = torch.arange(s + n, device=device)
            table_t = torch.tensor(table, dtype=torch.long, device=device)
            flat_index.append(table_t[pos // B] * B + pos % B)
            # Consecutive pages (the common case for a request allocated alone) are read in place, without a gather.
            runs.append(table[0] * B if table and table == list(range(table[0], table[0] + len(table))) else None)
        num_kda = sum(kind == "kda" for kind, _ in pools.layer_slots)
        self.records: list[list[VerifyStep]] | None = [[] for _ in range(num_kda)] if verify else None
        self.layers = []
        for kind, index in pools.layer_slots:
            if kind == "kda":
                recs = self.records[index] if self.records is not None else None
                self.layers.append(KDASlotView(pools, index, slots_N, recs))
            else:
                self.layers.append(MLAPageView(pools, index, flat_index, start, runs))

    def advance(self, seq_lens: list[int]) -> None:
        """The engine keeps the token counters (Request.num_computed); nothing to do here."""

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
    def __init__(self, pools: HybridPools, index: int, pages: PageTables, start: list[int]):
        self.flat_RR = pools.latent_MNBR[index].view(-1, pools.latent_MNBR.shape[-1])  # [NB*B, R]
        self.pages, self.written = pages, list(start)

    def past(self, i: int) -> torch.Tensor:
        """[S_i, R]: a view of the pool when the sequence's pages are consecutive, else a gathered copy."""
        run = self.pages.runs[i]
        if run is not None:
            return self.flat_RR[run : run + self.written[i]]
        return self.flat_RR.index_select(0, self.pages.flat_index(i)[: self.written[i]])

    def append(self, i: int, latents_SR: torch.Tensor) -> None:
        n, w, run = latents_SR.shape[0], self.written[i], self.pages.runs[i]
        assert w + n <= self.pages.capacity[i], "sequence writes past the pages allocated for this step"
        if run is not None:
            self.flat_RR[run + w : run + w + n] = latents_SR
        else:
            self.flat_RR.index_copy_(0, self.pages.flat_index(i)[w : w + n], latents_SR.to(self.flat_RR.dtype))
        self.written[i] += n


class PageTables:
    """Where each sequence's token positions live in the flattened page pool. Consecutive pages (the common case
    for a request allocated alone) are one run, read and written in place; other tables get a position index,
    built once per forward and shared by every MLA layer."""

    def __init__(self, block_tables: list[list[int]], block_size: int, device):
        self.tables, self.B, self.device = block_tables, block_size, device
        self.capacity = [len(t) * block_size for t in block_tables]
        self.runs = [t[0] * block_size if t and t == list(range(t[0], t[0] + len(t))) else None for t in block_tables]
        self._index: dict[int, torch.Tensor] = {}

    def flat_index(self, i: int) -> torch.Tensor:
        if i not in self._index:
            pos = torch.arange(self.capacity[i], device=self.device)
            table = torch.tensor(self.tables[i], dtype=torch.long, device=self.device)
            self._index[i] = table[pos // self.B] * self.B + pos % self.B
        return self._index[i]


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
        pages = PageTables(block_tables, pools.block_size, device)
        for cap, s, n in zip(pages.capacity, start, lengths, strict=True):
            assert s + n <= cap, "the scheduler allocates pages before the forward"
        num_kda = sum(kind == "kda" for kind, _ in pools.layer_slots)
        self.records: list[list[VerifyStep]] | None = [[] for _ in range(num_kda)] if verify else None
        self.layers = []
        for kind, index in pools.layer_slots:
            if kind == "kda":
                recs = self.records[index] if self.records is not None else None
                self.layers.append(KDASlotView(pools, index, slots_N, recs))
            else:
                self.layers.append(MLAPageView(pools, index, pages, start))

    def advance(self, seq_lens: list[int]) -> None:
        """The engine keeps the token counters (Request.num_computed); nothing to do here."""

"""The cache the model sees during one engine forward: per-layer views over the pools, for the N sequences of the
batch. They implement the entry interface of model/cache.py, so the model runs unchanged on paged memory:

    KDA view: load() gathers the batch's slots; store() scatters the new state and tails back; record() keeps the
              inputs of a verify pass as a `KDARecord` for the fold; decode_in_out() hands
              the fused CPU decode kernel the pools and slots to update in place
    MLA view: append(x, lens) writes every sequence's new latents into its pages in one index_copy; past(i) reads
              sequence i's latents (a view of the pool when its pages are consecutive); block() gathers every
              sequence through its page table into one right-padded [N, S_max, R] block in one index_select

Sequence i writes positions start_i, start_i + 1, ... of its page table; reads stop at what it has written (block()
pads a short sequence by repeating its last written position), so an unwritten (NaN-poisoned) position is never
read.

Legend: N sequences, S tokens of one sequence, R latent width, B page size.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from openk3.model.cache import KDAInOut
from openk3.ops.kda.step import KDASteps
from openk3.serve.kv.block_pool import HybridPools


class KDARecord(NamedTuple):
    """What one KDA layer's verify pass fed its state and conv tails: the G decode steps' inputs and the pre-conv
    q, k, v rows [N, G, P]. The fold replays a prefix of them; never recompute these (a gate recomputed in
    the fold by a slightly different formula lets the state drift while the outputs still look right)."""

    steps: KDASteps
    pre_conv_NGP: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class KDASlotView:
    def __init__(self, pools: HybridPools, index: int, slots_N: torch.Tensor, records: list[KDARecord | None] | None):
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

    def decode_in_out(self) -> KDAInOut:
        """The fused decode kernel updates the batch's slots of the pools in place (no gather, no scatter)."""
        conv = self.pools.conv_Nk3SWP[self.index]
        tails = (conv[0], conv[1], conv[2])
        state = self.pools.state_NkSHKV[self.index]
        rows = self.slots_N.tolist()
        return KDAInOut(tails, state, rows, tails, state, rows, lambda: None)

    def record(self, steps: KDASteps, pre_conv_NGP: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        assert self.records is not None, "record() outside a verify pass"
        self.records[self.index] = KDARecord(steps, pre_conv_NGP)


class MLAPageView:
    def __init__(self, pools: HybridPools, index: int, pages: PageTables, start: list[int]):
        self.flat_RR = pools.latent_MNBR[index].view(-1, pools.latent_MNBR.shape[-1])  # [NB*B, R]
        self.pages, self.written = pages, list(start)

    def append(self, latents_TR: torch.Tensor, seq_lens: list[int]) -> None:
        self.flat_RR.index_copy_(0, self._write_index(seq_lens), latents_TR.to(self.flat_RR.dtype))
        self.advance(seq_lens)

    def _write_index(self, seq_lens: list[int]) -> torch.Tensor:
        """[T] the pool rows of the next `seq_lens` positions of each sequence, within its pages."""
        for w, n, cap in zip(self.written, seq_lens, self.pages.capacity, strict=True):
            assert w + n <= cap, "sequence writes past the pages allocated for this step"
        return self.pages.write_index(tuple(self.written), tuple(seq_lens))

    def pool_rows(self) -> torch.Tensor:
        """The layer's page pool as rows [NB * B, R] (model/decode_stack.py appends and reads there in C)."""
        return self.flat_RR

    def decode_rows(self, seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For a step that appends and reads in one kernel call: the pool rows its new latents go to [T], then the
        rows each sequence reads [N, S_max] (as `block()` gathers them) and its lengths [N]. `advance` after."""
        lens = tuple(w + n for w, n in zip(self.written, seq_lens))
        return self._write_index(seq_lens), self.pages.read_index(lens), self.pages.lengths(lens)

    def advance(self, seq_lens: list[int]) -> None:
        """The bookkeeping of `append` after the latents were written through `decode_rows`."""
        self.written = [w + n for w, n in zip(self.written, seq_lens)]

    def past(self, i: int) -> torch.Tensor:
        """[S_i, R]: a view of the pool when the sequence's pages are consecutive, else a gathered copy."""
        run = self.pages.runs[i]
        if run is not None:
            return self.flat_RR[run : run + self.written[i]]
        return self.flat_RR.index_select(0, self.pages.flat_index(i)[: self.written[i]])

    def block(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, S_max, R] and the lengths [N]: one index_select through the block tables (a view of the pool for a
        single sequence on consecutive pages). Positions past a sequence's length repeat its last written one."""
        lens = tuple(self.written)
        assert min(lens) > 0, "block() reads sequences that have written at least one latent"
        len_N = self.pages.lengths(lens)
        if len(lens) == 1 and self.pages.runs[0] is not None:
            return self.flat_RR[self.pages.runs[0] : self.pages.runs[0] + lens[0]][None], len_N
        index_NS = self.pages.read_index(lens)
        return self.flat_RR.index_select(0, index_NS.flatten()).view(*index_NS.shape, -1), len_N


class PageTables:
    """Where each sequence's token positions live in the flattened page pool: the gather/scatter indices of the
    block tables, built once per forward and shared by every MLA layer (cached by length tuple: every MLA layer of
    a forward writes and reads the same positions).
    Consecutive pages (the common case for a request allocated alone) are also one run, read in place by past(i)."""

    def __init__(self, block_tables: list[list[int]], block_size: int, device):
        self.tables, self.B, self.device = block_tables, block_size, device
        self.capacity = [len(t) * block_size for t in block_tables]
        self.runs = [t[0] * block_size if t and t == list(range(t[0], t[0] + len(t))) else None for t in block_tables]
        self._table_NP: torch.Tensor | None = None
        self._cache: dict[tuple, torch.Tensor] = {}

    def _flat(self, seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Flat pool row of position `pos` of sequence `seq` (broadcasting), through the padded [N, P] tables."""
        if self._table_NP is None:
            width = max((len(t) for t in self.tables), default=0)
            # Padding entries are never reached: every index stays below its sequence's capacity.
            self._table_NP = torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.long,
                                          device=self.device).view(len(self.tables), width)  # fmt: skip
        return self._table_NP[seq, pos // self.B] * self.B + pos % self.B

    def flat_index(self, i: int) -> torch.Tensor:
        """[capacity_i] the pool rows of sequence i's positions."""
        key = ("seq", i)
        if key not in self._cache:
            self._cache[key] = self._flat(torch.tensor(i, device=self.device),
                                          torch.arange(self.capacity[i], device=self.device))  # fmt: skip
        return self._cache[key]

    def write_index(self, written: tuple[int, ...], seq_lens: tuple[int, ...]) -> torch.Tensor:
        """[T] the pool rows that the packed new tokens go to: positions written_i, written_i + 1, ... of each i."""
        key = ("write", written, seq_lens)
        if key not in self._cache:
            # Built on the host one page-run at a time: a decode step writes one row per sequence, and a handful of
            # Python ranges is several times cheaper than the tensor ops (or kernel launches) that would compute it.
            rows: list[int] = []
            for table, w, n in zip(self.tables, written, seq_lens, strict=True):
                pos, stop = w, w + n
                while pos < stop:
                    page, offset = divmod(pos, self.B)
                    end = min(stop, (page + 1) * self.B)
                    first = table[page] * self.B + offset
                    rows.extend(range(first, first + end - pos))
                    pos = end
            self._cache[key] = torch.tensor(rows, dtype=torch.long, device=self.device)
        return self._cache[key]

    def read_index(self, lengths: tuple[int, ...]) -> torch.Tensor:
        """[N, S_max] the pool rows of every sequence's positions, those past its length clamped to its last."""
        key = ("read", lengths)
        if key not in self._cache:
            S = max(lengths)
            pos_NS = torch.minimum(torch.arange(S, device=self.device)[None, :], self.lengths(lengths)[:, None] - 1)
            self._cache[key] = self._flat(torch.arange(len(lengths), device=self.device)[:, None], pos_NS)
        return self._cache[key]

    def lengths(self, lengths: tuple[int, ...]) -> torch.Tensor:
        key = ("len", lengths)
        if key not in self._cache:
            self._cache[key] = torch.tensor(lengths, dtype=torch.long, device=self.device)
        return self._cache[key]


class PagedCache:
    """`ForwardBatch.cache` for an engine step: `.layers[l]` is layer l's view; `records[j]` is the verify
    record of the j-th KDA layer when `verify` is set."""

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
        self.records: list[KDARecord | None] | None = [None] * num_kda if verify else None
        self.layers = []
        for kind, index in pools.layer_slots:
            if kind == "kda":
                self.layers.append(KDASlotView(pools, index, slots_N, self.records))
            else:
                self.layers.append(MLAPageView(pools, index, pages, start))

    def advance(self, seq_lens: list[int]) -> None:
        """The engine keeps the token counters (Request.num_computed); nothing to do here."""

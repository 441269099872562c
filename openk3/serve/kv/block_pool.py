"""The cache memory and its accounting: the pool tensors, MLA pages with reference counts, KDA state slots.

`HybridPools` holds the tensors (arithmetic in serve/plan.py): per MLA layer, pages of B tokens of the 576-wide latent
(normalised c_kv followed by raw k_pe); per KDA layer, state slots of the fp32 recurrent state [H, K, V] and the three
conv tails [W-1, P]. Working slots (one per running request) and read-only state checkpoints share the slot tensors.
Slot 0 is the dummy slot: it is never handed out, so a stray index can never reach a request's state.

`BlockPool` counts references to MLA pages. A page whose count drops to zero is free when it holds no registered
prefix unit, and evictable (kept, in least-recently-used order) when it does; allocation takes a free page first and
evicts the oldest evictable page only when none is free. `SlotPool` hands out state slots the same way.

Legend: M MLA layers, Nk KDA layers, NB pages, B tokens per page, R latent width, NS slots, H heads, K/V head dims,
W conv width, P = H*K.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

import torch

from openk3.model.cache import CONV_PROJECTIONS, STATE_DTYPE, cache_specs, layer_cache_spec


class HybridPools:
    """The pool tensors, shaped by the layers' `CacheSpec`s (model/cache.py), the geometry `k3 plan` prices."""

    def __init__(self, text_config, num_blocks: int, block_size: int, num_slots: int, dtype: torch.dtype, device):
        specs = cache_specs(text_config, dtype)
        self.layer_slots: list[tuple[str, int]] = []  # model layer -> ("kda" | "mla", index into its pool)
        counts = {"kda": 0, "mla": 0}
        for spec in specs:
            self.layer_slots.append((spec.kind, counts[spec.kind]))
            counts[spec.kind] += 1
        M, Nk = counts["mla"], counts["kda"]
        mla = layer_cache_spec(text_config, "mla", dtype)
        kda = layer_cache_spec(text_config, "kda", dtype)
        self.block_size, self.num_blocks, self.num_slots = block_size, num_blocks, num_slots
        # Pages are never read before they are written (reads stop at each request's written length), so the
        # pool starts uninitialised; freed pages are NaN-poisoned by the manager to make that rule checkable.
        # Always normal tensors, even when built under inference_mode, so the pools can be updated in any mode.
        with torch.inference_mode(False):
            self.latent_MNBR = torch.empty(M, num_blocks, block_size, mla.latent_width, dtype=dtype, device=device)
            self.state_NkSHKV = torch.zeros(Nk, num_slots, *kda.state_shape, dtype=STATE_DTYPE, device=device)
            self.conv_Nk3SWP = torch.zeros(Nk, CONV_PROJECTIONS, num_slots, *kda.conv_shape, dtype=dtype, device=device)

    def mla_bytes_per_token(self) -> int:
        M, _, _, R = self.latent_MNBR.shape
        return M * R * self.latent_MNBR.element_size()

    def slot_bytes(self) -> int:
        """Bytes of one request's KDA state + conv tails over all KDA layers (one slot)."""
        state = self.state_NkSHKV[:, 0].numel() * self.state_NkSHKV.element_size()
        conv = self.conv_Nk3SWP[:, :, 0].numel() * self.conv_Nk3SWP.element_size()
        return state + conv

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.latent_MNBR, self.state_NkSHKV, self.conv_Nk3SWP))

    def copy_slot(self, src: int, dst: int) -> None:
        self.state_NkSHKV[:, dst] = self.state_NkSHKV[:, src]
        self.conv_Nk3SWP[:, :, dst] = self.conv_Nk3SWP[:, :, src]

    def clear_slot(self, slot: int, value: float = 0.0) -> None:
        self.state_NkSHKV[:, slot] = value
        self.conv_Nk3SWP[:, :, slot] = value

    def poison_block(self, block: int) -> None:
        self.latent_MNBR[:, block] = float("nan")


class BlockPool:
    """Reference counts of MLA pages; free pages in a queue, evictable (cached, unreferenced) pages in LRU order."""

    def __init__(self, num_blocks: int, on_evict: Callable[[int], None], on_free: Callable[[int], None]):
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self._on_evict, self._on_free = on_evict, on_free

    @property
    def num_available(self) -> int:
        return len(self.free) + len(self.evictable)

    def allocate(self) -> int:
        if self.free:
            block = self.free.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            self._on_evict(block)
        else:
            raise RuntimeError("no MLA page available (the scheduler must check num_available first)")
        assert self.ref[block] == 0
        self.ref[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self.ref[block] == 0:
            assert block in self.evictable, f"page {block} has no references and is not cached"
            del self.evictable[block]
        self.ref[block] += 1

    def decref(self, block: int, cached: bool) -> None:
        assert self.ref[block] > 0, f"page {block} released more often than taken"
        self.ref[block] -= 1
        if self.ref[block] == 0:
            if cached:
                self.evictable[block] = None  # most recently used at the end
            else:
                self._on_free(block)
                self.free.append(block)

    def evict_all(self) -> int:
        """Evict every cached, unreferenced page into the free queue (a prefix-cache reset); returns how many."""
        n = len(self.evictable)
        while self.evictable:
            block, _ = self.evictable.popitem(last=False)
            self._on_evict(block)
            self.free.append(block)
        return n

    def check(self) -> None:
        """Invariants (tests call this after every step): no page both free and referenced or cached."""
        free, evictable = set(self.free), set(self.evictable)
        assert len(free) == len(self.free) and not (free & evictable)
        for block, ref in enumerate(self.ref):
            assert ref >= 0
            assert (block in free or block in evictable) == (ref == 0), (block, ref)


class SlotPool:
    """KDA state slots 1..NS-1 (slot 0 is the dummy). Working slots and checkpoints draw from the same pool."""

    def __init__(self, num_slots: int):
        self.free: deque[int] = deque(range(1, num_slots))
        self.used: set[int] = set()

    def allocate(self) -> int | None:
        if not self.free:
            return None
        slot = self.free.popleft()
        self.used.add(slot)
        return slot

    def release(self, slot: int) -> None:
        assert slot in self.used, f"slot {slot} is not in use"
        self.used.remove(slot)
        self.free.append(slot)

"""Prefix caching for a hybrid model (docs/serving.md, "Prefix caching"): chained unit hashes, where each unit's
latents live, and the sparse table of KDA state checkpoints.

    h_i = SHA-256(h_{i-1} || extra key || image keys of unit i || token ids of unit i)   over full units only

The extra key is the engine's weight version (empty for version 0; `KVCacheManager.set_weight_version`): after a
weight update no unit computed under the old weights can match, so a stale latent or state is never served.

The image keys of a unit are the content hashes of every image whose rows fall (partly) in it, in order: two
different images behind the same placeholder ids never share an entry. A text-only unit has none, so its hash is
exactly the text hash.

An MLA latent can be reused for any prefix of a cached chain, but the KDA state exists only where a checkpoint was
taken, so a hit is bounded by the deepest checkpoint (`match`). A checkpoint records the pages that hold its chain's
latents; evicting any of those pages drops the checkpoint, so no checkpoint ever outlives its latents.

Legend: U hash unit (tokens), u unit count, B page size (tokens).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def chain_hashes(tokens: list[int], unit: int, known: list[bytes], extra_key: bytes = b"",
                 images: Sequence[tuple[int, int, bytes]] = ()) -> list[bytes]:  # fmt: skip
    """The chained hashes of every full unit of `tokens`, extending `known` (the hashes already computed).
    `images`: (start, end, content hash) of each image's token positions."""
    hashes = list(known)
    for u in range(len(hashes), len(tokens) // unit):
        prev = hashes[-1] if hashes else b""
        lo, hi = u * unit, (u + 1) * unit
        image_keys = b"".join(key for start, end, key in images if start < hi and end > lo)
        ids = torch.tensor(tokens[lo:hi], dtype=torch.int64).numpy().tobytes()
        hashes.append(hashlib.sha256(prev + extra_key + image_keys + ids).digest())
    return hashes


@dataclass
class Checkpoint:
    slot: int
    depth: int  # units
    blocks: frozenset[int]  # pages holding units 1..depth
    hits: int = 0  # admissions that restored from it


class PrefixIndex:
    def __init__(self, unit: int, block_size: int):
        self.unit, self.units_per_block = unit, block_size // unit
        self.unit_loc: dict[bytes, tuple[int, int]] = {}  # hash -> (page, unit index inside the page)
        self.block_units: dict[int, list[bytes]] = {}
        self.checkpoints: OrderedDict[bytes, Checkpoint] = OrderedDict()  # LRU order
        self.block_checkpoints: dict[int, set[bytes]] = {}

    def is_cached(self, block: int) -> bool:
        return bool(self.block_units.get(block))

    def match(self, hashes: list[bytes], cap: int) -> tuple[int, int]:
        """(units whose latents are cached, deepest usable checkpoint depth <= cap) for a chain of hashes."""
        n_units = 0
        while n_units < len(hashes) and hashes[n_units] in self.unit_loc:
            n_units += 1
        for u in range(min(n_units, cap), 0, -1):
            if hashes[u - 1] in self.checkpoints:
                return n_units, u
        return n_units, 0

    def register(self, h: bytes, block: int, index: int) -> None:
        """Record that unit `h` lives at (page, index). The first location of a hash wins."""
        if h not in self.unit_loc:
            self.unit_loc[h] = (block, index)
            self.block_units.setdefault(block, []).append(h)

    def evict_block(self, block: int) -> list[int]:
        """Forget a page's units and every checkpoint built on it; returns the checkpoint slots to release."""
        for h in self.block_units.pop(block, []):
            del self.unit_loc[h]
        slots = []
        for h in self.block_checkpoints.pop(block, set()):
            slots.append(self._drop_checkpoint(h))
        return slots

    def add_checkpoint(self, h: bytes, slot: int, depth: int, chain: list[bytes]) -> None:
        blocks = frozenset(self.unit_loc[c][0] for c in chain[:depth])
        self.checkpoints[h] = Checkpoint(slot, depth, blocks)
        for b in blocks:
            self.block_checkpoints.setdefault(b, set()).add(h)

    def touch_checkpoint(self, h: bytes) -> Checkpoint:
        self.checkpoints.move_to_end(h)
        self.checkpoints[h].hits += 1
        return self.checkpoints[h]

    def drop_checkpoint(self, h: bytes) -> int:
        """Forget checkpoint `h`; returns its slot to release."""
        return self._drop_checkpoint(h)

    def evict_oldest_checkpoint(self) -> int:
        h = next(iter(self.checkpoints))
        return self._drop_checkpoint(h)

    def _drop_checkpoint(self, h: bytes) -> int:
        ckpt = self.checkpoints.pop(h)
        for b in ckpt.blocks:
            owners = self.block_checkpoints.get(b)
            if owners is not None:
                owners.discard(h)
                if not owners:
                    del self.block_checkpoints[b]
        return ckpt.slot

    def check(self) -> None:
        """Invariants: every checkpoint's chain is fully present, every location is consistent."""
        for h, (block, _) in self.unit_loc.items():
            assert h in self.block_units.get(block, [])
        for h, ckpt in self.checkpoints.items():
            for b in ckpt.blocks:
                assert h in self.block_checkpoints.get(b, set()) and self.is_cached(b), (h.hex()[:8], b)

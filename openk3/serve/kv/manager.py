"""KVCacheManager: allocation and prefix lookup across the two kinds of cache (docs/serving.md).

Per request it owns a KDA working slot and a page table of MLA pages. Admission looks the prompt up in the prefix
index; a hit of u* units restores the checkpoint at h_u* into the working slot (a copy: checkpoints are read-only)
and maps the hit's pages into the table: a page fully covered by the hit, whose units all sit in one cached page in
order, is shared (reference count + 1); any other page of the hit (the partial last page, or units spread over
pages) is copied into a fresh page first (copy-on-write), so nobody ever writes into a shared page.

After each forward the engine calls `commit`: full units whose latents are now computed are registered (output
tokens too), and when the request stands exactly on a planned checkpoint position its working slot is copied into a
checkpoint slot. With `CheckpointPolicy.output_end`, a decoding request that reaches a unit boundary inside its
output takes a checkpoint there and drops its previous output checkpoint (unless a hit has used it), so it holds at
most one; under speculative decoding a verify step may jump over a boundary, which then gets none.

Weight versions: `set_weight_version` mixes the version into every unit hash (`chain_hashes`' extra key), so
entries computed under older weights never match again and age out through LRU; `reset_prefix_cache` drops every
unreferenced page and every checkpoint at once. With `record_routed_experts` a `RoutesPool` (kv/routes.py) rides
along the MLA pages: copy-on-write copies its rows, freed pages are poisoned to -1, `read_routes` reads a request's.

Legend: U hash unit, B page size, u units.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import torch

from openk3.serve.config import ServeConfig
from openk3.serve.kv.block_pool import BlockPool, HybridPools, SlotPool
from openk3.serve.kv.prefix import PrefixIndex, chain_hashes
from openk3.serve.kv.routes import RoutesPool, num_moe_layers
from openk3.serve.kv.views import PagedCache
from openk3.serve.request import Request

log = logging.getLogger("openk3.serve")


@dataclass
class CacheStats:
    """Prefix-cache counters: latent matches and effective (checkpoint-bounded) hits, separately."""

    queries: int = 0
    prompt_tokens: int = 0
    mla_hit_tokens: int = 0  # tokens whose latents were found (capped at len - 1)
    state_hit_tokens: int = 0  # the effective hit: tokens restored from a checkpoint and not recomputed
    checkpoints_created: int = 0
    checkpoints_evicted: int = 0
    cow_copies: int = 0
    blocks_evicted: int = 0


class KVCacheManager:
    def __init__(self, text_config, config: ServeConfig, dtype: torch.dtype, device):
        self.config = config
        self.U, self.B = config.hash_unit, config.block_size
        num_slots = 1 + config.max_num_seqs + config.max_num_checkpoints
        self.pools = HybridPools(text_config, config.num_blocks, self.B, num_slots, dtype, device)
        self.index = PrefixIndex(self.U, self.B)
        self.blocks = BlockPool(config.num_blocks, self._evict_block, self._free_block)
        self.slots = SlotPool(num_slots)
        self.stats = CacheStats()
        self._recent: deque[tuple[int, int, int]] = deque(maxlen=64)  # (prompt len, latent match, effective hit)
        self._warned: set[str] = set()
        self.routes = None
        if config.record_routed_experts:
            self.routes = RoutesPool(config.num_blocks, self.B, num_moe_layers(text_config),
                                     text_config.num_experts_per_token, device)  # fmt: skip
        self.hash_key = b""  # mixed into every unit hash: the weight version (b"" for version 0)

    # ---- pool callbacks --------------------------------------------------------------------------------------
    def _evict_block(self, block: int) -> None:
        self.stats.blocks_evicted += 1
        for slot in self.index.evict_block(block):
            self._release_checkpoint_slot(slot)
        self._free_block(block)

    def _free_block(self, block: int) -> None:
        if self.config.poison_free:
            self.pools.poison_block(block)
            if self.routes is not None:
                self.routes.poison_block(block)

    def _release_checkpoint_slot(self, slot: int) -> None:
        self.stats.checkpoints_evicted += 1
        if self.config.poison_free:
            self.pools.clear_slot(slot, float("nan"))
        self.slots.release(slot)

    # ---- capacity --------------------------------------------------------------------------------------------
    def blocks_needed(self, req: Request, upto: int) -> int:
        """Pages to add so that positions [0, upto) of `req` are covered."""
        return max(0, -(-upto // self.B) - len(req.block_ids))

    def ensure_blocks(self, req: Request, upto: int) -> bool:
        need = self.blocks_needed(req, upto)
        if need > self.blocks.num_available:
            return False
        for _ in range(need):
            req.block_ids.append(self.blocks.allocate())
        return True

    def admission_pages(self, num_tokens: int) -> int:
        """Pages a new request of `num_tokens` may need before its prefill can progress: its prompt's pages (a
        hit's shared pages count as taken) plus, with prefix caching, the transient pins of a copy-on-write."""
        spare = self.B // self.U if self.config.enable_prefix_caching else 0
        return -(-num_tokens // self.B) + spare

    def can_admit(self, num_tokens: int) -> bool:
        slot_ok = bool(self.slots.free) or bool(self.index.checkpoints)
        return slot_ok and self.admission_pages(num_tokens) <= self.blocks.num_available

    # ---- admission -------------------------------------------------------------------------------------------
    def admit(self, req: Request) -> None:
        """Give `req` a working slot and restore the longest usable prefix (when prefix caching is on)."""
        slot = self._take_slot()
        assert slot is not None, "admit() without can_admit()"
        req.slot, req.block_ids, req.num_computed = slot, [], 0
        self.pools.clear_slot(slot)  # a fresh slot is zeroed before its first read
        tokens = req.tokens
        hit_units = 0
        if self.config.enable_prefix_caching:
            known = req.unit_hashes[: len(tokens) // self.U]
            req.unit_hashes = chain_hashes(tokens, self.U, known, self.hash_key, req.image_spans)
            cap = (len(tokens) - 1) // self.U  # always recompute at least one token
            n_units, hit_units = self.index.match(req.unit_hashes, cap)
            self.stats.queries += 1
            self.stats.prompt_tokens += len(tokens)
            self.stats.mla_hit_tokens += min(n_units, cap) * self.U
            self.stats.state_hit_tokens += hit_units * self.U
            self._recent.append((len(tokens), min(n_units, cap), hit_units))
            if hit_units:
                self._map_hit(req, hit_units)
            req.planned_checkpoints = self._plan(req, hit_units, min(n_units, cap))
            self._runtime_warnings()
        req.num_cached_tokens = hit_units * self.U

    def _take_slot(self) -> int | None:
        slot = self.slots.allocate()
        if slot is None and self.index.checkpoints:
            self._release_checkpoint_slot(self.index.evict_oldest_checkpoint())
            slot = self.slots.allocate()
        return slot

    def _map_hit(self, req: Request, units: int) -> None:
        ckpt = self.index.touch_checkpoint(req.unit_hashes[units - 1])
        self.pools.copy_slot(ckpt.slot, req.slot)
        hit_len, per_block = units * self.U, self.B // self.U
        locs = [self.index.unit_loc[h] for h in req.unit_hashes[:units]]
        # Pin every source page first: allocating a fresh page may evict an unreferenced page, and it must not be
        # one this hit is about to share or copy from.
        sources = sorted({block for block, _ in locs})
        for block in sources:
            self.blocks.incref(block)
        for j in range(-(-hit_len // self.B)):
            page_locs = locs[j * per_block : (j + 1) * per_block]
            source = page_locs[0][0]
            if len(page_locs) == per_block and all(loc == (source, i) for i, loc in enumerate(page_locs)):
                self.blocks.incref(source)  # a whole page of the hit, in order: share it
                req.block_ids.append(source)
                continue
            fresh = self.blocks.allocate()
            for i, (block, k) in enumerate(page_locs):  # copy-on-write, unit by unit
                dst, src = slice(i * self.U, (i + 1) * self.U), slice(k * self.U, (k + 1) * self.U)
                self.pools.latent_MNBR[:, fresh, dst] = self.pools.latent_MNBR[:, block, src]
                if self.routes is not None:
                    self.routes.copy_unit(fresh, dst, block, src)
            self.stats.cow_copies += 1
            req.block_ids.append(fresh)
        for block in sources:
            self.blocks.decref(block, cached=True)
        req.num_computed = hit_len

    def _plan(self, req: Request, hit_units: int, matched_units: int) -> list[int]:
        """Checkpoint positions (tokens) this request will take while prefilling (`CheckpointPolicy`). The prefill feeds
        tokens [hit, n), so states exist at chunk ends in (hit, n]."""
        policy, U = self.config.checkpoint_policy, self.U
        start, n = hit_units * U, len(req.tokens)
        plan: set[int] = set()
        if policy.prompt_end:
            plan.add(((n - 1) // U) * U)  # an exact repeat resumes here (a hit always recomputes one token)
            if n % U == 0:
                plan.add(n)  # a prompt that ends on a unit boundary: its continuation (next turn) resumes here
        if policy.interval:
            plan.update(range(policy.interval, n + 1, policy.interval))
        if policy.second_sighting and matched_units > hit_units:
            plan.add(matched_units * U)
        have = self.index.checkpoints
        return sorted(p for p in plan if start < p <= n and req.unit_hashes[p // U - 1] not in have)

    # ---- after a forward -------------------------------------------------------------------------------------
    def commit(self, req: Request) -> None:
        """Register the units `req` has computed and take a planned checkpoint if it stands on one."""
        if not self.config.enable_prefix_caching:
            return
        tokens = req.tokens
        done_units = req.num_computed // self.U
        if len(req.unit_hashes) < done_units:
            req.unit_hashes = chain_hashes(tokens[: done_units * self.U], self.U, req.unit_hashes, self.hash_key,
                                           req.image_spans)  # fmt: skip
        per_block = self.B // self.U
        for u in range(done_units):
            self.index.register(req.unit_hashes[u], req.block_ids[u // per_block], u % per_block)
        while req.planned_checkpoints and req.planned_checkpoints[0] < req.num_computed:
            req.planned_checkpoints.pop(0)  # passed without stopping there (cannot happen with aligned chunks)
        if req.planned_checkpoints and req.planned_checkpoints[0] == req.num_computed:
            req.planned_checkpoints.pop(0)
            self._take_checkpoint(req, req.num_computed // self.U)
        elif (
            self.config.checkpoint_policy.output_end
            and req.num_computed % self.U == 0
            and req.num_computed > len(req.prompt_token_ids)  # the prompt end is the prompt_end policy's
        ):
            self._take_output_checkpoint(req)

    def _take_output_checkpoint(self, req: Request) -> None:
        """A checkpoint where a decoding request stands (a unit boundary); its previous output checkpoint goes,
        unless a hit has restored from it since (another request uses that point)."""
        prev = self.index.checkpoints.get(req.output_checkpoint) if req.output_checkpoint is not None else None
        if prev is not None and prev.hits == 0:
            self._release_checkpoint_slot(self.index.drop_checkpoint(req.output_checkpoint))
        req.output_checkpoint = None
        if self._take_checkpoint(req, req.num_computed // self.U):
            req.output_checkpoint = req.unit_hashes[req.num_computed // self.U - 1]

    def _take_checkpoint(self, req: Request, depth: int) -> bool:
        """Copy the working slot into a new checkpoint at `depth` units; False when none was taken."""
        h = req.unit_hashes[depth - 1]
        if h in self.index.checkpoints or self.config.max_num_checkpoints == 0:
            return False
        if len(self.index.checkpoints) >= self.config.max_num_checkpoints:
            self._release_checkpoint_slot(self.index.evict_oldest_checkpoint())
        slot = self.slots.allocate()
        if slot is None:  # every slot holds a running request; skip rather than stall
            return False
        self.pools.copy_slot(req.slot, slot)
        self.index.add_checkpoint(h, slot, depth, req.unit_hashes)
        self.stats.checkpoints_created += 1
        return True

    def read_routes(self, req: Request) -> torch.Tensor:
        """The routes [P, M, k] of every position `req` has fed, P = num_computed (at most num_tokens - 1: a
        verify step that stopped early fed drafts that are not in the output). Call before `release`."""
        assert self.routes is not None, "read_routes() without record_routed_experts"
        return self.routes.read(req.block_ids, min(req.num_computed, req.num_tokens - 1))

    # ---- weight versions -----------------------------------------------------------------------------------------
    def set_weight_version(self, version: int) -> None:
        """Mix `version` into every unit hash from now on: nothing cached under another version matches again."""
        self.hash_key = b"" if version == 0 else f"weights:{version}".encode()

    def reset_prefix_cache(self) -> int:
        """Drop every checkpoint and every unreferenced cached page (pages of running requests stay); returns the
        number of pages freed."""
        while self.index.checkpoints:
            self._release_checkpoint_slot(self.index.evict_oldest_checkpoint())
        return self.blocks.evict_all()

    def release(self, req: Request) -> None:
        """Return a finished or preempted request's slot and page references."""
        if req.slot is not None:
            if self.config.poison_free:
                self.pools.clear_slot(req.slot, float("nan"))
            self.slots.release(req.slot)
            req.slot = None
        for block in req.block_ids:
            self.blocks.decref(block, cached=self.index.is_cached(block))
        req.block_ids = []

    # ---- views, accounting -------------------------------------------------------------------------------------
    def view(self, reqs: list[Request], lengths: list[int], verify: bool = False) -> PagedCache:
        return PagedCache(
            self.pools, [r.slot for r in reqs], [r.block_ids for r in reqs], [r.num_computed for r in reqs], lengths,
            verify,
        )  # fmt: skip

    def usage(self) -> dict[str, float]:
        used_blocks = sum(1 for r in self.blocks.ref if r > 0)
        return {
            "blocks_used": used_blocks,
            "blocks_cached": len(self.blocks.evictable),
            "blocks_total": self.blocks.num_blocks,
            "slots_used": len(self.slots.used) - len(self.index.checkpoints),
            "checkpoints": len(self.index.checkpoints),
            "checkpoint_bytes": len(self.index.checkpoints) * self.pools.slot_bytes(),
        }

    def check(self) -> None:
        """Pool invariants; the stress tests call this after every step."""
        self.blocks.check()
        self.index.check()
        ckpt_slots = {c.slot for c in self.index.checkpoints.values()}
        assert ckpt_slots <= self.slots.used
        assert not (set(self.slots.free) & self.slots.used) and 0 not in self.slots.used

    def _runtime_warnings(self) -> None:
        """Rate-limited warnings that prefix caching is inert at run time, from the last 64 admissions."""
        if len(self._recent) < 8:
            return
        if all(n <= self.U for n, _, _ in self._recent) and "short" not in self._warned:
            self._warned.add("short")
            log.warning(
                "prefix caching is inert for this traffic: the last %d prompts are all shorter than the hash unit "
                "(%d tokens) + 1", len(self._recent), self.U,
            )  # fmt: skip
        if (
            any(m for _, m, _ in self._recent)
            and not any(h for _, _, h in self._recent)
            and "nohit" not in self._warned
        ):
            self._warned.add("nohit")
            log.warning(
                "prefix caching finds cached latents but no state checkpoint to resume from (0 effective hits in "
                "the last %d requests); consider the checkpoint policy or max_num_checkpoints", len(self._recent),
            )  # fmt: skip

"""Token-budget scheduling: no prefill and decode phases; every step each running request's
computed-token count chases its token count, within `max_num_batched_tokens`.

Order inside a step: running requests that are decoding (1 token, or 1 + drafts when speculating), then running
requests that are still prefilling, then waiting requests in arrival order while a working slot and pages for their
prompt are free. A prefill chunk that does not finish the prompt ends on a multiple of the hash unit, and always
at the next planned checkpoint, so the KDA state exists exactly where a checkpoint must be taken. When pages
run out the newest running request is preempted: it gives back its slot and pages and re-enters the queue with its
tokens so far; it resumes from its deepest checkpoint when prefix caching is on, else recomputes
(its KDA state can never be rebuilt from latents alone).
Scheduling runs no model: speculative drafts come from the engine (proposed within `draft_room`), and the scheduler
only cuts each to what the token budget leaves.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from openk3.serve.config import ServeConfig
from openk3.serve.kv.manager import KVCacheManager
from openk3.serve.request import Request, Status


@dataclass
class Chunk:
    req: Request
    num_tokens: int  # tokens [req.num_computed, req.num_computed + num_tokens) are fed this step


@dataclass
class StepPlan:
    chunks: list[Chunk] = field(default_factory=list)  # one plain forward: prefill chunks and plain decodes
    verify: dict[int, list[tuple[Request, list[int]]]] = field(default_factory=dict)  # drafts count -> (req, drafts)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks) + sum(
            (1 + g) * len(group) for g, group in self.verify.items()
        )  # fmt: skip


class Scheduler:
    def __init__(self, config: ServeConfig, manager: KVCacheManager):
        self.config, self.manager = config, manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.manager.release(req)
        req.status = Status.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk_len(self, req: Request, budget: int) -> int:
        start, end = req.num_computed, min(req.num_tokens, req.num_computed + budget)
        if req.planned_checkpoints and req.planned_checkpoints[0] < end:
            return req.planned_checkpoints[0] - start
        if end < req.num_tokens:
            aligned = (end // self.config.hash_unit) * self.config.hash_unit
            if aligned > start:
                end = aligned
        return end - start

    def _preempt_newest(self, plan: StepPlan, keep: Request) -> bool:
        """Preempt the newest running request other than `keep` that is not already in this step's plan."""
        planned = {id(c.req) for c in plan.chunks} | {id(r) for g in plan.verify.values() for r, _ in g}
        for victim in reversed(self.running):
            if victim is not keep and id(victim) not in planned:
                self._preempt(plan, victim)
                return True
        return False

    def _reserve(self, plan: StepPlan, req: Request, upto: int) -> bool:
        while not self.manager.ensure_blocks(req, upto):
            if not self._preempt_newest(plan, keep=req):
                return False
        return True

    def draft_room(self, req: Request) -> int:
        """How many draft tokens a decoding request may verify this step, before the token budget: at most
        `num_speculative_tokens`, and never past max_model_len or max_tokens (0 for a request still prefilling)."""
        k = self.config.speculative_config.num_speculative_tokens if self.config.speculative_config else 0
        if req.is_prefill:
            return 0
        return min(k, self.config.max_model_len - req.num_tokens, req.params.max_tokens - len(req.output_token_ids) - 1)

    def schedule(self, drafts: Mapping[int, list[int]] | None = None) -> StepPlan:
        """This step's plan. `drafts` maps id(req) to a decoding request's proposed tokens (within its
        `draft_room`); each is cut to what the token budget leaves."""
        plan, budget = StepPlan(), self.config.max_num_batched_tokens
        drafts = drafts or {}
        for req in list(self.running):
            if req.is_prefill or req not in self.running or budget < 1:
                continue
            drafts_req = drafts.get(id(req), [])[: budget - 1]
            if not self._reserve(plan, req, req.num_computed + 1 + len(drafts_req)):
                self._preempt(plan, req)
                continue
            budget -= 1 + len(drafts_req)
            if drafts_req:
                plan.verify.setdefault(len(drafts_req), []).append((req, drafts_req))
            else:
                plan.chunks.append(Chunk(req, 1))
        for req in list(self.running):
            if not req.is_prefill or req not in self.running or budget < 1:
                continue
            n = self._chunk_len(req, budget)
            if n <= 0 or not self._reserve(plan, req, req.num_computed + n):
                continue  # waits for pages; decodes were served first
            plan.chunks.append(Chunk(req, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if not self.manager.can_admit(req.num_tokens):
                break
            self.waiting.popleft()
            self.manager.admit(req)
            req.status = Status.RUNNING
            self.running.append(req)
            n = self._chunk_len(req, budget)
            if not self.manager.ensure_blocks(req, req.num_computed + n):
                break  # can_admit counted the whole prompt, so this only waits for a later step
            plan.chunks.append(Chunk(req, n))
            budget -= n
        return plan

    def _preempt(self, plan: StepPlan, req: Request) -> None:
        """Back to the head of the queue with its tokens so far; its slot and pages go back to the pool."""
        self.running.remove(req)
        self.manager.release(req)
        req.status, req.num_computed = Status.WAITING, 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        plan.preempted.append(req)

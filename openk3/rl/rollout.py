"""Rollouts, token in and token out, on the serving engine: many tool-using episodes generated at once.

    worker = RolloutWorker(engine, tokenizer, fleet, budgets)
    trajs = [worker.start(task, group=g) for g, task in ...]    # reset each episode's environment, render its prompt
    stats = worker.run(trajs, version=3, finish_fraction=0.5)   # generate until half are done (partial rollouts)
    worker.run([t for t in trajs if not t.done], version=4)     # the rest continue, tagged with the new version

Every unfinished episode is one engine request at a time (continuous batching across episodes). A turn's request is
`prompt_token_ids = trajectory.tokens`, so the engine's prefix cache (with `CheckpointPolicy.output_end`) restores
the earlier turns and the turn costs its new tokens only. When a request finishes, its sampled ids are appended
verbatim (never re-rendered from text), parsed with the XTML parser, and handed to the environment; the tool results
are appended as observation tokens (`transcript.observation_ids`) and the next turn is submitted.

Per token the trajectory records: the id, whether it is trained on (generated) or not (prompt, observations), the
behaviour log-probability (the engine's, at temperature 1 the policy's own), and the policy version that sampled it.
Routed experts: the engine's record for every fed position of the trajectory's latest request (a prefix hit's
restored positions included): the routes the cached states were computed with. After a weight update the cache is
invalidated, so a continued trajectory's routes all come from the newest version.

Partial rollouts (K3 report; Kimi k1.5): with `finish_fraction` λ < 1, `run` stops once λ of the given trajectories
are done; the in-flight requests are aborted and their tokens so far kept, tagged with this version; the next `run`
continues them mid-turn (their request's prompt is everything so far).

Legend: P fed positions, M MoE layers, k experts per token.
"""

from __future__ import annotations

import dataclasses
import math
import time
import zlib
from dataclasses import dataclass, field

import torch

from openk3.data.xtml_parse import parse_xtml
from openk3.rl.env import Budgets, ToolEnv
from openk3.rl.envs import Task, initial_messages
from openk3.rl.transcript import observation_ids, prompt_ids
from openk3.serve.engine import LLMEngine
from openk3.serve.request import SamplingParams

NOT_GENERATED = -1  # the version of prompt and observation tokens


@dataclass
class Trajectory:
    task: Task
    group: int  # GRPO group: the samples of one task in one step share it
    sample: int  # which sample of its group
    tokens: list[int] = field(default_factory=list)
    generated: list[bool] = field(default_factory=list)  # loss mask: True for sampled tokens
    logprobs: list[float] = field(default_factory=list)  # behaviour log-prob per token (0.0 where not generated)
    versions: list[int] = field(default_factory=list)  # policy version per token (NOT_GENERATED elsewhere)
    routed_experts: torch.Tensor | None = None  # [P, M, k] int16 for positions 0..P-1, P >= len(tokens) - 1 when done
    turn_start: int = 0  # where the current assistant turn's tokens begin
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    reward: float = 0.0
    done: bool = False
    reason: str | None = None  # why the episode ended ("answer", "max_turns", "max_tokens", "wall_clock", ...)
    prefill_tokens: int = 0  # tokens the engine computed for prompts (not restored from the prefix cache)
    prompt_tokens: int = 0  # prompt tokens submitted over all requests (what a cache-less engine computes)
    env: ToolEnv | None = field(default=None, repr=False)
    thinking: bool = False  # the episode is rendered with the think channel (transcript.py)
    effort: str | None = None  # its thinking-effort tag (distillation), rendered in the prompt
    prompt_len: int = 0  # tokens of the first prompt: everything after it is the episode's own
    requests: int = 0  # engine requests made for it so far (its sampling seeds count them)

    @property
    def num_generated(self) -> int:
        return sum(self.generated)

    def append(self, ids: list[int], generated: bool, version: int = NOT_GENERATED,
               logprobs: list[float] | None = None) -> None:  # fmt: skip
        self.tokens += ids
        self.generated += [generated] * len(ids)
        self.versions += [version if generated else NOT_GENERATED] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def segments(self) -> list[tuple[int, int, int]]:
        """(start, end, version) of each run of generated tokens with one version: partial rollouts make several."""
        out: list[tuple[int, int, int]] = []
        for i, (gen, v) in enumerate(zip(self.generated, self.versions)):
            if not gen:
                continue
            if out and out[-1][1] == i and out[-1][2] == v:
                out[-1] = (out[-1][0], i + 1, v)
            else:
                out.append((i, i + 1, v))
        return out


@dataclass
class RolloutStats:
    generated_tokens: int = 0
    requests: int = 0
    finished: int = 0  # trajectories that ended in this run
    aborted: int = 0  # in-flight requests stopped by the partial-rollout cut
    inference_s: float = 0.0  # engine steps
    sandbox_s: float = 0.0  # environment steps (tool calls, verification)
    wall_s: float = 0.0

    def merge(self, other: RolloutStats) -> RolloutStats:
        return RolloutStats(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


class RolloutWorker:
    def __init__(self, engine: LLMEngine, tokenizer, fleet, budgets: Budgets | None = None, *,
                 max_tokens_per_turn: int = 128, snapshots=None, seed: int = 0):  # fmt: skip
        self.engine, self.tokenizer, self.fleet = engine, tokenizer, fleet
        self.budgets = budgets or Budgets()
        self.max_tokens_per_turn = max_tokens_per_turn
        self.snapshots = snapshots
        self.seed = seed
        self.requests = 0  # requests submitted (their ids)

    # ---- episodes ----------------------------------------------------------------------------------------------
    def start(self, task: Task, group: int = 0, sample: int = 0, *, thinking: bool = False,
              effort: str | None = None) -> Trajectory:  # fmt: skip
        """A new episode: its environment reset (a sandbox forked from the task's snapshot), its prompt rendered
        (with the think channel when `thinking`, and the thinking-effort message when `effort` is given)."""
        thinking = thinking or effort is not None
        ids = prompt_ids(initial_messages(task), task.tools, self.tokenizer, thinking=thinking, effort=effort)
        env = ToolEnv(self.fleet, self.budgets, self.snapshots)
        env.reset(task)
        traj = Trajectory(task, group, sample, env=env, thinking=thinking, effort=effort)
        traj.append(ids, generated=False)
        traj.turn_start = traj.prompt_len = len(traj.tokens)
        return traj

    def run(self, trajs: list[Trajectory], version: int, finish_fraction: float = 1.0, *, temperature: float = 1.0,
            max_step_tokens: int | None = None, progress=None) -> RolloutStats:  # fmt: skip
        """Generate until every trajectory is done, or until `finish_fraction` of `trajs` is (K3's partial rollouts),
        or until `max_step_tokens` tokens were generated in this call (k1.5's per-iteration token budget); the rest
        are cut mid-turn and keep what they generated. `progress(n)` is called as episodes end."""
        if not 0 < finish_fraction <= 1:
            raise ValueError(f"finish_fraction must be in (0, 1], got {finish_fraction}")
        stats = RolloutStats()
        start = time.perf_counter()
        need = math.ceil(finish_fraction * len(trajs))
        live: dict[str, Trajectory] = {}

        def advance(traj: Trajectory) -> None:  # submit its next request, or count it as ended
            if not traj.done:
                self._submit(traj, live, temperature, stats)
            if traj.done:
                stats.finished += 1
                if progress is not None:
                    progress(1)

        # The samples of a group share their first prompt: submit one per distinct prompt now and the rest after the
        # first step, when its prefill has left a prompt-end checkpoint for them to resume from (submitted together,
        # every sample would prefill the whole prompt in the same step).
        deferred, first = [], set()
        for traj in trajs:
            if traj.done:
                continue
            key = tuple(traj.tokens) if traj.turns == 0 and traj.turn_start == len(traj.tokens) else None
            if key is not None and key in first:
                deferred.append(traj)
            else:
                first.add(key)
                advance(traj)
        engine = self.engine
        while (live or deferred) and sum(t.done for t in trajs) < need:
            if max_step_tokens is not None and self._in_flight_tokens(live) + stats.generated_tokens >= max_step_tokens:
                break
            t0 = time.perf_counter()
            outs = engine.step() if live else []
            stats.inference_s += time.perf_counter() - t0
            for traj in deferred:
                advance(traj)
            deferred = []
            for out in outs:
                if not out.finished or out.request_id not in live:
                    continue
                traj = live.pop(out.request_id)
                req = engine.requests[out.request_id][0]
                engine.release_finished(out.request_id)
                self._take(traj, req, out.outputs[0].finish_reason, version, stats)
                if not traj.done:
                    t0 = time.perf_counter()
                    self._end_turn(traj, out.outputs[0].finish_reason)
                    stats.sandbox_s += time.perf_counter() - t0
                advance(traj)
        for rid, traj in live.items():  # the partial-rollout cut: keep each in-flight turn's tokens so far
            req = engine.requests[rid][0]
            engine.abort_request(rid)
            self._take(traj, req, None, version, stats)
            stats.aborted += 1
        stats.wall_s = time.perf_counter() - start
        return stats

    def _in_flight_tokens(self, live: dict[str, Trajectory]) -> int:
        return sum(len(self.engine.requests[rid][0].output_token_ids) for rid in live)

    def close(self, trajs: list[Trajectory]) -> None:
        for traj in trajs:
            if traj.env is not None:
                traj.env.close()
                traj.env = None

    # ---- one request -------------------------------------------------------------------------------------------
    def _submit(self, traj: Trajectory, live: dict, temperature: float, stats: RolloutStats) -> None:
        budget = self.budgets.max_tokens - traj.num_generated
        room = self.engine.config.max_model_len - len(traj.tokens) - 1
        turn_room = self.max_tokens_per_turn - (len(traj.tokens) - traj.turn_start)
        max_tokens = min(budget, room, turn_room)
        if max_tokens < 1:
            self._finish(traj, 0.0, "max_tokens" if budget < 1 else "max_context")
            return
        self.requests += 1
        traj.requests += 1
        rid = f"rl-{self.requests}"
        # The seed is the trajectory's own (task, group, sample, request number): what it samples does not depend on
        # which other episodes, evaluations or resumes the worker served before.
        key = f"{self.seed}/{traj.task.task_id}/{traj.group}/{traj.sample}/{traj.requests}".encode()
        seed = zlib.crc32(key)  # not hash(): string hashes change with every interpreter
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, logprobs=0, seed=seed)
        self.engine.add_request({"prompt_token_ids": list(traj.tokens)}, params, request_id=rid)
        live[rid] = traj
        stats.requests += 1

    def _take(self, traj: Trajectory, req, finish_reason: str | None, version: int, stats: RolloutStats) -> None:
        """Append a finished or aborted request's sampled tokens, log-probs, version and routes to `traj`."""
        ids = list(req.output_token_ids)
        logprobs = [entry[tok] for tok, entry in zip(ids, req.output_logprobs)]
        traj.append(ids, generated=True, version=version, logprobs=logprobs)
        traj.prompt_tokens += len(req.prompt_token_ids)
        traj.prefill_tokens += len(req.prompt_token_ids) - req.num_cached_tokens
        stats.generated_tokens += len(ids)
        routes = getattr(req, "routed_experts", None)
        if routes is not None:
            traj.routed_experts = routes
        if finish_reason == "error":
            self._finish(traj, 0.0, "engine_error")

    def _end_turn(self, traj: Trajectory, finish_reason: str) -> None:
        """Parse the finished turn, step the environment, append the observation (or end the episode)."""
        turn = traj.tokens[traj.turn_start :]
        counter = traj.tool_calls
        # No `tools=`: a call to an undeclared tool reaches the environment, which answers it by name.
        start = "think" if traj.thinking else "response"
        parsed = parse_xtml(turn, self.tokenizer, start=start, tool_call_id=lambda i: f"call_{counter + i}")
        message = parsed.message()
        if parsed.problems:
            message["problems"] = list(parsed.problems)
        if finish_reason == "length" and not parsed.complete:
            message.setdefault("problems", []).append("the message was cut at the turn's token limit")
        traj.turns += 1
        result = traj.env.step(message, num_tokens=len(turn))
        traj.tool_calls += result.info.get("tool_calls", 0)
        traj.tool_errors += result.info.get("tool_errors", 0)
        if result.done:
            self._finish(traj, result.reward, result.info.get("reason", "answer"))
            return
        message.pop("problems", None)
        traj.append(observation_ids(message, result.observation, self.tokenizer, thinking=traj.thinking),
                    generated=False)  # fmt: skip
        traj.turn_start = len(traj.tokens)

    def _finish(self, traj: Trajectory, reward: float, reason: str) -> None:
        traj.reward, traj.reason, traj.done = float(reward), reason, True
        # An observation appended before a budget ended the episode was never fed (it has no routes) and nothing
        # follows it to train on: the trajectory ends with its last generated token.
        if any(traj.generated):
            keep = len(traj.generated) - traj.generated[::-1].index(True)
            for name in ("tokens", "generated", "logprobs", "versions"):
                setattr(traj, name, getattr(traj, name)[:keep])
        if traj.env is not None:
            traj.env.close()
            traj.env = None

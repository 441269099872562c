"""The tool environment of agentic RL: one episode of one task in its own sandbox, in the reset/step/close rhythm of
SkyRL and rLLM, and the per-task snapshots that episodes fork from.

    snapshots = TaskSnapshots(fleet)              # one snapshot per task, shared by its G episodes (a GRPO group)
    env = ToolEnv(fleet, Budgets(), snapshots)
    messages = env.reset(task)                    # [system?] + user; the episode's sandbox forked from the snapshot
    result = env.step(parsed_assistant_message, num_tokens=n)
    observation, reward, done, info = result      # tool messages to append; reward once done

A step with tool calls runs them in order (tools.py) and answers each with one tool message (its `tool_call_id`);
a step without tool calls is the final answer, scored by the task family's `verify`. Parser problems (the message's
"problems") make the whole message malformed: nothing is run, and every call (or, without calls, one message named
"error") gets an "error: malformed markup ..." observation; the episode goes on. Nothing the model writes makes
`step` raise; errors are observations starting with "error: ", counted in info["tool_errors"].

Budgets end an episode with reward 0 and info["reason"]: "max_tokens" (the turns' token counts, as the caller passes
them, sum past the budget), "wall_clock" (since reset, checked before and after the tools run), "max_turns" (the
last allowed assistant message still calls tools: there is no turn left to read the results, so they are not run).
A final answer within budget ends with reason "answer". Each tool call runs under min(tool_timeout_s, the wall
clock left); calls past `max_tool_calls` in one message are answered with an error and not run.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Self

from openk3.rl.envs import Task, get_family, initial_messages
from openk3.rl.tools import clip, execute
from openk3.sandbox import SandboxError, SnapshotRef

log = logging.getLogger(__name__)
MIN_TOOL_TIMEOUT_S = 0.1  # a tool gets at least this, even with the wall clock almost spent


@dataclass
class Budgets:
    max_turns: int = 4  # assistant messages per episode
    max_tokens: int = 512  # generated tokens per episode (the caller passes each turn's count)
    wall_clock_s: float = 60.0  # per episode
    tool_timeout_s: float = 5.0  # per tool call
    max_observation_chars: int = 400
    max_tool_calls: int = 8  # per assistant message; calls past it are answered with an error, not run


@dataclass
class StepResult:
    observation: list[dict]  # tool messages to append (role "tool"); [] when done
    reward: float
    done: bool
    info: dict = field(default_factory=dict)  # reason, tool_calls, tool_errors, sandbox_s (see the module docstring)

    def __iter__(self):
        return iter((self.observation, self.reward, self.done, self.info))


class TaskSnapshots:
    """One snapshot per task (sandbox created, task files written, snapshot taken), shared by every episode of that
    task (a GRPO group forks G episodes from one). Keyed by task_id. Bounded LRU; releases refs to the fleet on
    eviction and close() (the fleet's owner runs `fleet.gc()` to delete the layers). Thread-safe."""

    def __init__(self, fleet, max_tasks: int = 64):
        if max_tasks < 1:
            raise ValueError(f"max_tasks={max_tasks}: must be at least 1")
        self.fleet, self.max_tasks = fleet, max_tasks
        self._refs: collections.OrderedDict[str, SnapshotRef] = collections.OrderedDict()
        # Held across get + fork, so an eviction by another thread cannot release a ref between the two.
        self._lock = threading.Lock()

    def get(self, task: Task) -> SnapshotRef:
        with self._lock:
            return self._get(task)

    def fork(self, task: Task, n: int = 1) -> list:
        """`n` sandboxes starting from the task's snapshot."""
        with self._lock:
            return self.fleet.fork(self._get(task), n)

    def _get(self, task: Task) -> SnapshotRef:
        ref = self._refs.get(task.task_id)
        if ref is not None:
            self._refs.move_to_end(task.task_id)
            return ref
        sb = self.fleet.create()
        try:
            for path, text in task.files.items():
                sb.write_file(f"/workspace/{path}", text)
            ref = sb.snapshot()
        finally:
            sb.close()
        self._refs[task.task_id] = ref
        while len(self._refs) > self.max_tasks:
            self.fleet.release(self._refs.popitem(last=False)[1])
        return ref

    def __len__(self) -> int:
        return len(self._refs)

    def close(self) -> None:
        """Release every held snapshot. Idempotent."""
        with self._lock:
            for ref in self._refs.values():
                self.fleet.release(ref)
            self._refs.clear()


class ToolEnv:
    def __init__(self, fleet, budgets: Budgets | None = None, snapshots: TaskSnapshots | None = None):
        self.fleet = fleet
        self.budgets = budgets or Budgets()
        self._own_snapshots = snapshots is None
        self.snapshots = snapshots if snapshots is not None else TaskSnapshots(fleet)
        self.task: Task | None = None
        self.sandbox = None
        self.messages: list[dict] = []
        self.done = False
        self.turns = self.tokens = 0
        self._start = 0.0

    def reset(self, task: Task) -> list[dict]:
        """Start an episode of `task` (closing any previous one's sandbox); returns the initial messages."""
        self._close_sandbox()
        self.sandbox = self.snapshots.fork(task, 1)[0]
        self.task, self.done, self.turns, self.tokens = task, False, 0, 0
        self.messages = initial_messages(task)
        self._start = time.monotonic()
        return [dict(m) for m in self.messages]

    def step(self, assistant_message: dict, num_tokens: int = 0) -> StepResult:
        if self.task is None or self.done:
            raise RuntimeError("step() needs an episode: call reset() first (and not again after it is done)")
        b = self.budgets
        self.turns += 1
        self.tokens += num_tokens
        message = {k: v for k, v in assistant_message.items() if k != "problems"}
        message["role"] = "assistant"
        self.messages.append(message)
        info = {"reason": None, "tool_calls": 0, "tool_errors": 0, "sandbox_s": 0.0}
        calls = assistant_message.get("tool_calls") or []
        problems = assistant_message.get("problems") or []
        if self.tokens > b.max_tokens:
            return self._end(0.0, "max_tokens", info)
        if self._elapsed() > b.wall_clock_s:
            return self._end(0.0, "wall_clock", info)
        if not calls and not problems:
            return self._end(self._verify(message, info), "answer", info)
        if self.turns >= b.max_turns:
            return self._end(0.0, "max_turns", info)
        observation = self._answer_malformed(calls, problems, info) if problems else self._run(calls, info)
        if self._elapsed() > b.wall_clock_s:
            return self._end(0.0, "wall_clock", info)
        self.messages += observation
        return StepResult(observation, 0.0, False, info)

    def close(self) -> None:
        """Close the episode's sandbox (and the snapshots, if this env made its own). Idempotent."""
        self._close_sandbox()
        if self._own_snapshots:
            self.snapshots.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _elapsed(self) -> float:
        return time.monotonic() - self._start

    def _run(self, calls: list, info: dict) -> list[dict]:
        b = self.budgets
        names = [t["function"]["name"] for t in self.task.tools]
        out = []
        for i, call in enumerate(calls):
            call_id = call.get("id") if isinstance(call, dict) else None
            if i >= b.max_tool_calls:
                name, text = _call_name(call), f"error: more than {b.max_tool_calls} tool calls in one message; not run"
                info["tool_errors"] += 1
            else:
                timeout = max(MIN_TOOL_TIMEOUT_S, min(b.tool_timeout_s, b.wall_clock_s - self._elapsed()))
                result = execute(self.sandbox, call, names, timeout, b.max_observation_chars)
                name, text = result.name or _call_name(call), result.text
                info["tool_errors"] += result.error
                info["sandbox_s"] += result.sandbox_s
            info["tool_calls"] += 1
            out.append({"role": "tool", "tool_call_id": call_id, "name": name, "content": text})
        return out

    def _answer_malformed(self, calls: list, problems: list[str], info: dict) -> list[dict]:
        limit = self.budgets.max_observation_chars
        text = "error: malformed markup, nothing was run: " + "; ".join(map(str, problems))
        text = clip(text, limit)
        if not calls:  # no call to answer: one message stands for the broken attempt
            info["tool_errors"] += 1
            return [{"role": "tool", "tool_call_id": None, "name": "error", "content": text}]
        info["tool_calls"] += len(calls)
        info["tool_errors"] += len(calls)
        return [{"role": "tool", "tool_call_id": c.get("id") if isinstance(c, dict) else None, "name": _call_name(c),
                 "content": text} for c in calls]  # fmt: skip

    def _verify(self, message: dict, info: dict) -> float:
        start = time.monotonic()
        try:
            reward = float(get_family(self.task.family).verify(self.task, self.sandbox, message))
        except SandboxError as err:  # the sandbox broke under the episode: no reward, and say why
            log.warning("verify of %s failed: %s", self.task.task_id, err)
            info["verify_error"] = f"{type(err).__name__}: {err}"
            reward = 0.0
        info["sandbox_s"] += time.monotonic() - start
        return reward

    def _end(self, reward: float, reason: str, info: dict) -> StepResult:
        self.done = True
        info["reason"] = reason
        return StepResult([], reward, True, info)

    def _close_sandbox(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None


def _call_name(call) -> str:
    fn = call.get("function") if isinstance(call, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    return name if isinstance(name, str) else ""

"""Task families for agentic RL: what a task is, the family protocol, the registry, and the split rule they share.

Families (one file each): `calculator` (arithmetic word problems, tool python), `files` (questions about a generated
workspace, tools ls/cat/grep), `code-fix` (one planted bug in mod.py, tools cat/replace/run_tests). They are built
for a tiny policy (~7M parameters, SFT on the demonstrations, then RL): a correct episode mostly copies spans of the
prompt into tool arguments and spans of observations into the answer, and prompts and observations are tens of
tokens.

Splits are disjoint by construction: a candidate task's split is a hash of its content (family, prompt, files), and
`generate(split, index)` draws candidates from a seed of (family, split, index, attempt) until one falls in `split`.
Identical content can thus never be both a train and a test task. About a quarter of the content space is test.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

SPLITS = ("train", "test")
TEST_SHARE = 64  # of 256 hash buckets


@dataclass(frozen=True)
class Task:
    family: str  # "calculator" | "files" | "code-fix"
    task_id: str  # stable and unique, "<family>/<split>/<index>"
    prompt: str  # the user message
    files: dict[str, str]  # workspace files (path relative to /workspace -> text), in the task's snapshot
    answer: str | None  # the expected final answer; None where tests decide (code-fix)
    tools: list[dict]  # OpenAI tool schemas offered
    meta: dict = field(default_factory=dict)


class TaskFamily(Protocol):
    name: str

    def generate(self, split: str, index: int) -> Task:
        """The task (split, index): deterministic; the train and test splits never share a task."""

    def verify(self, task: Task, sandbox, final_message: dict) -> float:
        """The reward in [0, 1] of an episode ending with `final_message` (its sandbox as the episode left it)."""

    def demonstration(self, task: Task) -> list[dict]:
        """The messages after the prompt of a correct episode: assistant turns with tool calls (content ""), the tool
        messages ToolEnv returns for them, then the final assistant answer."""

    def guess(self, task: Task, rng: random.Random) -> list[dict]:
        """The messages after the prompt of a tool-free episode: one assistant answer given without looking, plausible
        in form but unchecked (right only by chance). The SFT warm start can mix these in (`--sft-guess-share`) to
        model a cold-start policy that does not always use its tools."""


def split_of(family: str, prompt: str, files: dict[str, str]) -> str:
    """The split a task's content belongs to."""
    h = hashlib.sha256(family.encode())
    for part in (prompt, *(f"{path}\0{text}" for path, text in sorted(files.items()))):
        h.update(b"\1" + part.encode())
    return "test" if h.digest()[0] < TEST_SHARE else "train"


def draw(family: str, split: str, index: int, make: Callable[[random.Random], Task]) -> Task:
    """The first candidate `make(rng)` of the seeds (family, split, index, 0, 1, ...) whose content is in `split`."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: the splits are {', '.join(SPLITS)}")
    if index < 0:
        raise ValueError(f"index={index}: must be non-negative")
    for attempt in range(1000):
        seed = hashlib.sha256(f"{family}/{split}/{index}/{attempt}".encode()).digest()
        task = make(random.Random(int.from_bytes(seed[:8], "little")))
        if split_of(family, task.prompt, task.files) == split:
            return task
    raise AssertionError(f"{family}: no {split} task in 1000 draws")  # p ~ 0.75**1000


def call(call_id: str, name: str, **arguments) -> dict:
    """An OpenAI tool call (the shape the XTML parser produces)."""
    args = json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def tool_message(call_id: str, name: str, content: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}


def assistant(content: str = "", *calls: dict) -> dict:
    return {"role": "assistant", "content": content, **({"tool_calls": list(calls)} if calls else {})}


def exact_match(task: Task, final_message: dict) -> float:
    """1.0 iff the final content, stripped, is the answer exactly. Strict on purpose: the demonstrations answer with
    the bare value, so a policy that learned the format loses nothing, and the reward cannot be gamed by listing
    several numbers."""
    return float((final_message.get("content") or "").strip() == task.answer)


def system_prompt(task: Task) -> str | None:
    """The system message of an episode: none (the tool declaration and the prompt say it all; fewer tokens)."""
    return None


def initial_messages(task: Task) -> list[dict]:
    """What an episode shows the policy first: the family's system message (if any), then the task's prompt."""
    system = system_prompt(task)
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": task.prompt}]


# The families import Task and the helpers above from this module, so they are imported after them.
from openk3.rl.envs.calculator import Calculator
from openk3.rl.envs.codefix import CodeFix
from openk3.rl.envs.files import Files

FAMILIES: dict[str, TaskFamily] = {f.name: f for f in (Calculator(), Files(), CodeFix())}


def get_family(name: str) -> TaskFamily:
    if name not in FAMILIES:
        raise ValueError(f"unknown task family {name!r}; the families are {', '.join(FAMILIES)}")
    return FAMILIES[name]

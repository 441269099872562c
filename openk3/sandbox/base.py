"""The sandbox protocol: what an agent environment offers, whatever isolates it.

Modelled on E2B's call shapes (exec, files, pause/resume), AgentENV's state machine and snapshot chains, and the
reset/step/close rhythm of SkyRL and rLLM that `rl` builds on top. Every call has a deadline and ends in a result or
a typed `SandboxError`, never a hang.

States (AgentENV's, without the transient ones a caller never observes):

    RUNNING --pause()--> PAUSED --resume()--> RUNNING
    RUNNING/PAUSED --close()--> CLOSED            (any call on a CLOSED sandbox: SandboxClosed)
    snapshot(), restore(), fork() run from RUNNING and leave it RUNNING

A snapshot is a `SnapshotRef`: an immutable, ordered chain of file-tree layers (bottom first) on one node. What a
snapshot holds depends on the backend: the namespace backend keeps files only, never process memory
(`snapshot(memory=True)` raises `Unsupported`).

This package knows nothing of models and imports nothing else of openk3 (tests/test_layering.py checks it).
"""

from __future__ import annotations

import abc
import asyncio
import enum
from dataclasses import dataclass, field
from typing import Self

DEFAULT_TIMEOUT_S = 30.0  # an exec's default time limit
CALL_DEADLINE_S = 60.0  # any other call's: past it, SandboxTimeout (the sandbox is then broken and closed)


class SandboxError(Exception):
    """Base of every sandbox error."""


class SandboxClosed(SandboxError):
    """The sandbox was closed (by the caller, the fleet, or because its supervisor died)."""


class SandboxTimeout(SandboxError):
    """A call (not an exec's own command, whose timeout is reported in ExecResult.timed_out) missed its deadline."""


class SandboxBusy(SandboxError):
    """The operation needs the sandbox quiet: processes still run (pass stop_processes=True to stop them)."""


class Unsupported(SandboxError):
    """The backend cannot do this (e.g. a memory snapshot on the namespace backend)."""


class SandboxUnavailable(SandboxError):
    """This host cannot run the backend (no user/mount namespaces, no overlayfs, ...): the reason says which."""


class CapacityError(SandboxError):
    """The fleet (or node) holds as many sandboxes as it may."""


class State(enum.Enum):
    RUNNING = "running"
    PAUSED = "paused"
    CLOSED = "closed"


@dataclass(frozen=True)
class ExecResult:
    exit_code: int  # the command's exit status; 128 + N when killed by signal N (timeouts and limits included)
    stdout: str  # decoded UTF-8 (invalid bytes replaced), at most the output cap
    stderr: str
    timed_out: bool  # killed at its timeout
    duration: float  # seconds, wall clock, from start to exit
    limit: str | None = None  # the limit it hit, if any: "timeout", "memory", "pids", "disk", "output", "cpu"
    truncated: bool = False  # stdout or stderr went past the output cap and was cut


@dataclass(frozen=True)
class DirEntry:
    name: str
    kind: str  # "file", "dir", "symlink" or "other"
    size: int
    mode: int  # permission bits


@dataclass(frozen=True)
class SnapshotRef:
    id: str
    layers: tuple[str, ...]  # layer ids, bottom first (the base image not included)
    node: str  # where the layers live: a fork or restore of this ref runs there
    created: float = field(default=0.0, compare=False)  # time.time() at creation


class Sandbox(abc.ABC):
    """One isolated environment. Paths are inside the sandbox (its root is `/`, its home and default working folder
    `/workspace`). Use as a context manager to close it."""

    id: str
    state: State

    @abc.abstractmethod
    def exec(self, cmd: str | list[str], timeout: float = DEFAULT_TIMEOUT_S, stdin: str | bytes | None = None,
             env: dict[str, str] | None = None, cwd: str = "/workspace") -> ExecResult:  # fmt: skip
        """Run `cmd` (an argv list, or a string run by `/bin/sh -c`) and wait for it, at most `timeout` seconds."""

    @abc.abstractmethod
    def write_file(self, path: str, data: str | bytes, mode: int = 0o644) -> None:
        """Create or replace a file (parent folders are created), as the sandbox's user."""

    @abc.abstractmethod
    def read_file(self, path: str) -> bytes:
        """A file's bytes, read as the sandbox's user (FileNotFoundError / PermissionError as the sandbox sees it)."""

    @abc.abstractmethod
    def list_dir(self, path: str = "/workspace") -> list[DirEntry]:
        """A folder's entries, sorted by name."""

    @abc.abstractmethod
    def snapshot(self, *, stop_processes: bool = False, memory: bool = False) -> SnapshotRef:
        """Freeze the sandbox's files as a new snapshot; the sandbox goes on from it. Processes still running are a
        SandboxBusy unless `stop_processes`, which stops them first."""

    @abc.abstractmethod
    def restore(self, ref: SnapshotRef) -> None:
        """Make the sandbox's files exactly those of `ref` (every process in it is stopped)."""

    @abc.abstractmethod
    def fork(self, ref: SnapshotRef | None = None, n: int = 1) -> list[Sandbox]:
        """`n` new sandboxes, each starting from `ref` (default: a snapshot of this one taken now), each with its
        own writable layer: none sees another's writes."""

    @abc.abstractmethod
    def pause(self) -> None:
        """Freeze every process in the sandbox (no CPU used) until `resume`."""

    @abc.abstractmethod
    def resume(self) -> None: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Stop every process and release everything the sandbox holds. Idempotent."""

    @abc.abstractmethod
    def stats(self) -> dict:
        """What the sandbox uses now: {"memory_bytes", "disk_bytes", "pids"} (and the limits it runs under)."""

    # The asyncio form of every call: the blocking call in a worker thread, so an event loop can drive many sandboxes
    # at once (the agent loop of an RL rollout).
    async def aexec(self, *args, **kwargs) -> ExecResult:
        return await asyncio.to_thread(self.exec, *args, **kwargs)

    async def awrite_file(self, *args, **kwargs) -> None:
        return await asyncio.to_thread(self.write_file, *args, **kwargs)

    async def aread_file(self, path: str) -> bytes:
        return await asyncio.to_thread(self.read_file, path)

    async def alist_dir(self, path: str = "/workspace") -> list[DirEntry]:
        return await asyncio.to_thread(self.list_dir, path)

    async def asnapshot(self, **kwargs) -> SnapshotRef:
        return await asyncio.to_thread(self.snapshot, **kwargs)

    async def arestore(self, ref: SnapshotRef) -> None:
        return await asyncio.to_thread(self.restore, ref)

    async def afork(self, ref: SnapshotRef | None = None, n: int = 1) -> list[Sandbox]:
        return await asyncio.to_thread(self.fork, ref, n)

    async def apause(self) -> None:
        return await asyncio.to_thread(self.pause)

    async def aresume(self) -> None:
        return await asyncio.to_thread(self.resume)

    async def aclose(self) -> None:
        return await asyncio.to_thread(self.close)

    async def astats(self) -> dict:
        return await asyncio.to_thread(self.stats)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

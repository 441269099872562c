"""Checkpoint chat templates rendered where a runaway one can be stopped: a separate worker process.

A Hugging Face-style template is a program shipped inside a checkpoint. Jinja's sandbox stops it from touching
Python internals, but not from looping for hours (`{% for a in range(99999) %}{% for b in range(99999) %}`) or
building a gigabyte string (`"x" * 10**9`), and a thread running such a loop cannot be stopped. So templates render
in one long-lived child process (`python -I` this file: it imports only Jinja) under a memory limit; the parent
waits at most `timeout_s` for an answer and kills the child past it (a fresh one starts on the next render), and the
output is cut off at `max_chars` while it is generated.

Inside, the environment is Hugging Face's: sandboxed and immutable, `trim_blocks`/`lstrip_blocks`, the
`loopcontrols` extension, and the globals `raise_exception(msg)` (a template's way to reject a conversation) and
`strftime_now(fmt)`. One render is one JSON line each way over the child's stdin/stdout.

Errors: `TemplateRejected` when the template called raise_exception (the conversation is the problem: a 400),
`TemplateFailed` for everything else (a template bug, a sandbox violation, a timeout, too much output or memory).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MAX_CHARS = 32 * 2**20
WORKER_MEMORY_BYTES = 2 * 2**30


class TemplateError(ValueError):
    """A chat template could not be rendered."""


class TemplateRejected(TemplateError):
    """The template refused the conversation (it called raise_exception)."""


class TemplateFailed(TemplateError):
    """The template itself failed: an error, a sandbox violation, the time limit or the output limit."""


def compile_check(source: str) -> None:
    """Raise TemplateError naming the line of a syntax error (compiling runs none of the template)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        _environment(ImmutableSandboxedEnvironment).parse(source)
    except jinja2.TemplateSyntaxError as err:
        raise TemplateError(f"chat template syntax error at line {err.lineno}: {err.message}") from err


def _environment(cls):
    return cls(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])


class SandboxedRenderer:
    """Renders templates in the worker process; thread-safe (one render at a time)."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, max_chars: int = DEFAULT_MAX_CHARS,
                 memory_bytes: int = WORKER_MEMORY_BYTES):  # fmt: skip
        self.timeout_s, self.max_chars, self.memory_bytes = timeout_s, max_chars, memory_bytes
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def render(self, source: str, context: dict) -> str:
        request = json.dumps({"source": source, "context": context, "max_chars": self.max_chars}) + "\n"
        with self._lock:
            proc = self._worker()
            deadline = time.monotonic() + self.timeout_s
            try:
                proc.stdin.write(request.encode("utf-8"))
                proc.stdin.flush()
                line = self._read_line(proc, deadline)
            except TemplateFailed:
                self._kill()
                raise
            except (BrokenPipeError, OSError) as err:
                self._kill()
                raise TemplateFailed(f"the chat template worker died ({err})") from err
        reply = json.loads(line)
        if reply["kind"] == "ok":
            return reply["text"]
        error = TemplateRejected if reply["kind"] == "rejected" else TemplateFailed
        raise error(reply["message"])

    def _worker(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            env = {"PATH": os.environ.get("PATH", ""), "OPENK3_TEMPLATE_MEMORY": str(self.memory_bytes)}
            self._proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, env=env)  # fmt: skip
        return self._proc

    def _read_line(self, proc: subprocess.Popen, deadline: float) -> str:
        fd, parts = proc.stdout.fileno(), []
        # poll, not select(): select() refuses descriptors past FD_SETSIZE (1024), which a busy server passes
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                raise TemplateFailed(f"the chat template did not finish within {self.timeout_s:g} s")
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise TemplateFailed("the chat template worker died while rendering (out of memory?)")
            parts.append(chunk)
            if chunk.endswith(b"\n"):
                return b"".join(parts).decode("utf-8")

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                pipe.close()
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._kill()

    def __del__(self) -> None:
        try:
            self._kill()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown: nothing left to report to
            pass


# ---- the worker process (this file run as a script) ------------------------------------------------------------
def _worker_main() -> None:
    import datetime
    import resource

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    limit = int(os.environ.get("OPENK3_TEMPLATE_MEMORY", WORKER_MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    class Rejected(Exception):
        pass

    def raise_exception(message):
        raise Rejected(str(message))

    env = _environment(ImmutableSandboxedEnvironment)
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))  # fmt: skip
    compiled: dict[str, jinja2.Template] = {}
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        request = json.loads(line)
        try:
            source = request["source"]
            if source not in compiled:
                compiled.clear()  # one server serves one template; never grow
                compiled[source] = env.from_string(source)
            parts, size = [], 0
            for piece in compiled[source].generate(**request["context"]):
                size += len(piece)
                if size > request["max_chars"]:
                    raise MemoryError(f"the chat template wrote more than {request['max_chars']} characters")
                parts.append(piece)
            reply = {"kind": "ok", "text": "".join(parts)}
        except Rejected as err:
            reply = {"kind": "rejected", "message": f"the chat template rejected the conversation: {err}"}
        except SecurityError as err:
            reply = {"kind": "failed", "message": f"the chat template broke the sandbox rules: {err}"}
        except MemoryError as err:
            reply = {"kind": "failed", "message": f"the chat template ran out of room: {err}" if str(err) else
                     f"the chat template ran out of memory (the worker's limit is {limit / 2**30:g} GiB)"}  # fmt: skip
        except Exception as err:  # noqa: BLE001 - any template bug is reported, never fatal to the worker
            reply = {"kind": "failed", "message": f"the chat template failed: {type(err).__name__}: {err}"}
        parts = []  # drop this render's pieces before waiting for the next one
        out.write((json.dumps(reply) + "\n").encode("utf-8"))
        out.flush()


if __name__ == "__main__":
    _worker_main()

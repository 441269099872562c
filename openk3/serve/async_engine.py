"""AsyncLLM: the engine behind an asyncio server. One background thread runs `LLMEngine.step()` in a loop;
asyncio callers add requests and read each request's outputs from its own queue.

The engine is not thread-safe, so every call into it (add, abort, step) holds one lock; adds and aborts run in a
worker thread (`run_in_executor`) so the event loop never waits for a step, and text prompts are tokenized before
the lock is taken. The waiting queue is bounded in sequences (a request counts `n`): admission is decided and
reserved on the event loop in one synchronous piece, so simultaneous arrivals cannot all slip past the check; past
`max_waiting` queued sequences `submit` raises `QueueFull` (the server answers 429). A caller that stops reading
(a client that disconnected) aborts its request, which frees its slot and pages at once.

The loop never dies of one request: the engine fails the requests of a step that raised (finish_reason "error");
an error outside that containment fails every open request and the loop goes on. `health()` reports the loop's
state: "ok", "degraded" (steps failed in the last minute) or "dead" (the thread is gone, or shut down).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator

from openk3.serve.engine import LLMEngine
from openk3.serve.metrics import ServerMetrics
from openk3.serve.request import RequestOutput, SamplingParams

log = logging.getLogger("openk3.serve")


class QueueFull(Exception):
    """More requests are waiting than the server admits; retry later."""


class EngineDead(Exception):
    """The engine loop stopped on an internal error."""


class AsyncLLM:
    DEGRADED_WINDOW_S = 60.0

    def __init__(self, engine: LLMEngine, max_waiting: int = 256):
        self.engine, self.max_waiting = engine, max_waiting
        self.metrics = ServerMetrics(engine)
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._reserved = 0  # sequences admitted on the event loop but not yet in the scheduler's waiting queue
        self.error: BaseException | None = None  # the last error the loop contained (counted by the engine)
        self._thread = threading.Thread(target=self._loop, name="openk3-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def health(self) -> dict:
        """{"status": "ok" | "degraded" | "dead", ...}: degraded while a step failed in the last minute."""
        if not self.alive:
            return {"status": "dead", "error": "the engine loop is not running" + (
                f" (last error: {self.error!r})" if self.error is not None else "")}  # fmt: skip
        engine = self.engine
        body = {"status": "ok", "failed_steps": engine.failed_steps}
        if time.monotonic() - engine.last_failure < self.DEGRADED_WINDOW_S:
            body.update(status="degraded", last_error=engine.last_error)
        return body

    def stop(self) -> None:
        """Stop the loop without waiting for it: every open stream ends with EngineDead at once (the server sends
        its error event, or a 503), and no new request is admitted."""
        self._stop.set()
        self._wakeup.set()
        for loop, queue in list(self._streams.values()):
            _put(loop, queue, EngineDead("the server is shutting down"))

    def shutdown(self, timeout: float = 10.0) -> None:
        """`stop()`, then wait for the engine thread to finish its step."""
        self.stop()
        self._thread.join(timeout=timeout)

    def num_waiting(self) -> int:
        """Queued sequences: the scheduler's waiting queue plus admissions still on their way to it."""
        return len(self.engine.scheduler.waiting) + self._reserved

    def admit(self, n: int) -> None:
        """Reserve room for `n` sequences or raise QueueFull / EngineDead. Synchronous on the event loop, so the
        check and the reservation are one step; `submit(..., reserved=True)` or `release(n)` gives it back."""
        if not self.alive:
            raise EngineDead("the engine loop is not running")
        waiting = self.num_waiting()
        if waiting + n > self.max_waiting:
            raise QueueFull(
                f"{waiting} sequences are already waiting (limit {self.max_waiting}; this request adds {n})"
            )
        self._reserved += n

    def release(self, n: int) -> None:
        self._reserved -= n

    async def submit(
        self, prompt: str | dict | list[int], params: SamplingParams, request_id: str, reserved: bool = False
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request now (so a bad prompt or a full queue is known before any response starts) and return
        an iterator over its outputs, the last one with `finished` set. Raises ValueError for a bad prompt,
        QueueFull when the queue is full, EngineDead if the engine loop is not running. `reserved`: the caller
        already holds an `admit(params.n)` reservation, which this call consumes."""
        if not reserved:
            self.admit(params.n)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, queue)
        self.metrics.on_arrival(request_id)
        try:
            await loop.run_in_executor(None, self._add, prompt, params, request_id)
        except BaseException:
            self._streams.pop(request_id, None)
            self.metrics.on_abort(request_id)
            raise
        finally:
            self.release(params.n)
        return self._outputs(request_id, queue)

    async def _outputs(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the reader went away (client disconnect, cancellation): free the request now
                self.metrics.on_abort(request_id)
                self.abort(request_id)  # synchronous: a cancelled task must not skip it; waits at most one step

    def _add(self, prompt, params, request_id) -> None:
        if isinstance(prompt, str):  # tokenize outside the engine lock: a long prompt must not stall the steps
            prompt = {"prompt": prompt, "prompt_token_ids": self.engine.encode_prompt(prompt)}
        with self._lock:
            self.engine.add_request(prompt, params, request_id)
        self._wakeup.set()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self.engine.abort_request(request_id)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                with self._lock:
                    outputs = self.engine.step() if self.engine.has_unfinished() else None
                    if outputs:
                        for out in outputs:
                            if out.finished:
                                self.engine.release_finished(out.request_id)
            except Exception as err:
                log.exception("engine loop error; failing every open request")
                self.error = err
                with self._lock:
                    outputs = self.engine.fail_all(f"the engine failed: {type(err).__name__}: {err}")
                    for out in outputs:
                        self.engine.release_finished(out.request_id)
            if outputs is None:
                self._wakeup.wait(timeout=0.05)
                self._wakeup.clear()
                continue
            now = time.perf_counter()
            for out in outputs:
                self.metrics.on_output(out, now)
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    _put(*stream, out)


def _put(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, item) -> None:
    try:
        loop.call_soon_threadsafe(queue.put_nowait, item)
    except RuntimeError:  # that event loop is closed: nobody is reading
        pass

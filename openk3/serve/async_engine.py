"""AsyncLLM: the engine behind an asyncio server. One background thread runs `LLMEngine.step()` in a loop;
asyncio callers add requests and read each request's outputs from its own queue.

The engine is not thread-safe, so every call into it (add, abort, step) holds one lock; adds and aborts run in a
worker thread (`run_in_executor`) so the event loop never waits for a step. The waiting queue is bounded: past
`max_waiting` queued requests `generate` raises `QueueFull` (the server answers 429). A caller that stops reading
(a client that disconnected) aborts its request, which frees its slot and pages at once.
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
    def __init__(self, engine: LLMEngine, max_waiting: int = 256):
        self.engine, self.max_waiting = engine, max_waiting
        self.metrics = ServerMetrics(engine)
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="openk3-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def shutdown(self) -> None:
        self._stop.set()
        self._wakeup.set()
        self._thread.join(timeout=10)

    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting)

    async def submit(
        self, prompt: str | dict | list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request now (so a bad prompt or a full queue is known before any response starts) and return
        an iterator over its outputs, the last one with `finished` set. Raises ValueError for a bad prompt,
        QueueFull when the queue is full, EngineDead if the engine loop died."""
        if not self.alive:
            raise EngineDead(f"the engine loop stopped: {self.error!r}")
        if self.num_waiting() >= self.max_waiting:
            raise QueueFull(f"{self.num_waiting()} requests are already waiting")
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
        return self._outputs(request_id, queue)

    async def _outputs(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineDead(f"the engine loop stopped: {item!r}") from item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the reader went away (client disconnect, cancellation): free the request now
                self.metrics.on_abort(request_id)
                self.abort(request_id)  # synchronous: a cancelled task must not skip it; waits at most one step

    def _add(self, prompt, params, request_id) -> None:
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
            except BaseException as err:  # an engine bug: fail every open stream instead of hanging it
                log.exception("engine step failed")
                self.error = err
                for loop, queue in list(self._streams.values()):
                    loop.call_soon_threadsafe(queue.put_nowait, err)
                return
            if outputs is None:
                self._wakeup.wait(timeout=0.05)
                self._wakeup.clear()
                continue
            now = time.perf_counter()
            for out in outputs:
                self.metrics.on_output(out, now)
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream[0].call_soon_threadsafe(stream[1].put_nowait, out)

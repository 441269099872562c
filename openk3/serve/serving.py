"""What every OpenAI endpoint shares: errors, admission, off-loop preprocessing, waiting for a request's last output,
and Server-Sent Events (the shape of vLLM's `serving_engine.py`).

The endpoint handlers (serving_completion.py, serving_chat.py, serving_models.py, serving_health.py) take a parsed
request and return a response body (a dict) or an async iterator of SSE lines; they raise `APIError` for an error
response. None of them touches HTTP, so each can be called directly; server.py only wires them to routes.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import TYPE_CHECKING

from openk3.serve.async_engine import AsyncLLM, EngineDead, QueueFull
from openk3.serve.config import DEFAULT_PREPROCESS_TIMEOUT_S
from openk3.serve.protocol import error_body, now
from openk3.serve.request import RequestOutput

if TYPE_CHECKING:
    from openk3.serve.serving_models import OpenAIServingModels

log = logging.getLogger("openk3.serve")
DISCONNECT_POLL_S = 0.1  # how often a non-streamed request checks that its client is still there
PREPROCESS_THREADS = 2

# `is_disconnected()` of the HTTP request (starlette's Request.is_disconnected); None: a caller that never leaves.
Disconnected = Callable[[], Awaitable[bool]] | None


class APIError(Exception):
    """An error response: HTTP `status`, OpenAI's error `kind` and `param`, extra `headers` (Retry-After)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.kind, self.param, self.headers = status, kind, param, headers


def json_text(content, **options) -> str:
    """JSON text that always encodes as UTF-8: text holding a lone surrogate is written with \\u escapes instead."""
    text = json.dumps(content, ensure_ascii=False, **options)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(content, ensure_ascii=True, **options)
    return text


def sse_event(body: dict) -> str:
    return f"data: {json_text(body)}\n\n"


def raise_if_failed(out: RequestOutput) -> None:
    """A request one of whose samples ended in error (non-finite logits, a failed step) is a 500 of its own."""
    failed = next((o for o in out.outputs if o.finish_reason == "error"), None)
    if failed is not None:
        raise APIError(500, failed.error or "the request failed in the engine", "server_error")


class OpenAIServing:
    """The base of the generating endpoints (completions, chat): one `AsyncLLM`, the served model's name, and the
    preprocessing threads where tokenizing and template rendering run, each under `preprocess_timeout_s`."""

    def __init__(self, llm: AsyncLLM, models: OpenAIServingModels, preprocess: Executor | None = None,
                 preprocess_timeout_s: float = DEFAULT_PREPROCESS_TIMEOUT_S):  # fmt: skip
        self.llm, self.engine, self.models = llm, llm.engine, models
        self.preprocess = preprocess or ThreadPoolExecutor(PREPROCESS_THREADS, thread_name_prefix="openk3-preprocess")
        self.preprocess_timeout_s = preprocess_timeout_s

    @property
    def model_name(self) -> str:
        return self.models.model_name

    @property
    def max_model_len(self) -> int:
        return self.models.max_model_len

    def decode(self, ids: list[int]) -> str:
        return self.engine.tokenizer.decode(ids)

    async def off_loop(self, fn):
        """Run CPU work (tokenizing, rendering) in the preprocessing threads under the time limit."""
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(self.preprocess, fn), self.preprocess_timeout_s)
        except TimeoutError as err:
            raise APIError(500, f"preparing the prompt took longer than {self.preprocess_timeout_s:g} s",
                           "server_error") from err  # fmt: skip

    async def start(self, prepare, params, rid: str) -> AsyncIterator[RequestOutput]:
        """Admit (reserving room for params.n sequences), prepare the prompt off the loop, queue it."""
        try:
            self.llm.admit(params.n)
        except QueueFull as err:
            raise APIError(429, f"server busy: {err}", "rate_limit_error", headers={"Retry-After": "1"}) from err
        except EngineDead as err:
            raise APIError(503, str(err), "server_error") from err
        try:
            prompt = await self.off_loop(prepare)
        except BaseException:
            self.llm.release(params.n)
            raise
        try:
            return await self.llm.submit(prompt, params, rid, reserved=True)
        except EngineDead as err:
            raise APIError(503, str(err), "server_error") from err
        except ValueError as err:
            raise APIError(400, str(err), param="prompt") from err

    async def final_output(self, outputs: AsyncIterator[RequestOutput], is_disconnected: Disconnected) -> RequestOutput:
        """The last output of a non-streamed request; a client that disconnects meanwhile aborts it."""

        async def last() -> RequestOutput:
            final = None
            async for final in outputs:
                pass
            return final

        task = asyncio.ensure_future(last())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    break
                if is_disconnected is not None and await is_disconnected():
                    task.cancel()  # the generator's cleanup aborts the request in the engine
                    await asyncio.gather(task, return_exceptions=True)
                    raise APIError(499, "the client disconnected", "client_closed_request")
        except asyncio.CancelledError:
            task.cancel()
            raise
        try:
            out = task.result()
        except EngineDead as err:
            raise APIError(503, str(err), "server_error") from err
        raise_if_failed(out)
        return out

    async def sse(self, outputs, stream_of, usage_of, include_usage: bool, rid: str, kind: str) -> AsyncIterator[str]:
        """Server-sent events: each sample's chunks (`stream_of(index)` makes a sample's stream, which turns its
        latest output into chunks), the usage when asked for, then [DONE]. A failure (a sample that ended in error,
        an engine shut down) is an OpenAI error event before [DONE]."""
        streams: dict[int, object] = {}
        finished_choices: set[int] = set()
        final = None
        try:
            async for out in outputs:
                final = out
                raise_if_failed(out)
                for body in self._chunks(out, stream_of, streams, finished_choices):
                    yield sse_event(body)
        except APIError as err:
            yield sse_event(error_body(str(err), err.kind, err.param, err.status))
        except EngineDead as err:
            yield sse_event(error_body(str(err), "server_error", None, 503))
        except Exception as err:  # a stream must always end with an error event and [DONE]
            log.error("stream failed", exc_info=err)
            yield sse_event(error_body(f"internal error: {type(err).__name__}: {err}", "server_error", None, 500))
        else:
            if include_usage and final is not None:
                body = {"id": rid, "object": kind, "created": now(), "model": self.model_name, "choices": [],
                        "usage": usage_of(final)}  # fmt: skip
                yield sse_event(body)
        finally:
            await outputs.aclose()  # a disconnect (the response cancelled) aborts the request right here
        yield "data: [DONE]\n\n"

    @staticmethod
    def _chunks(out: RequestOutput, stream_of, streams: dict, finished_choices: set[int]) -> Iterator[dict]:
        """The chunk bodies one output adds, sample by sample; a sample's stream stops at its finish."""
        for o in out.outputs:
            if o.index in finished_choices:
                continue
            if o.index not in streams:
                streams[o.index] = stream_of(o.index)
            yield from streams[o.index](o)
            if o.finish_reason is not None:
                finished_choices.add(o.index)

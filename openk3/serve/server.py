"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) on top of `AsyncLLM`.

    GET  /v1/models            the served model
    POST /v1/completions       text completion (prompt: text or token ids), streaming or not
    POST /v1/chat/completions  chat through the checkpoint's chat format: tool calls and reasoning with K3's XTML
    GET  /v1/chat/template     the chat template in use (name and source)
    GET  /health               200 {"status": "ok" | "degraded", ...} while the engine loop runs, 503 when it does not
    GET  /metrics              Prometheus text (serve/metrics.py)

Streaming is Server-Sent Events in OpenAI's chunk format ending with `data: [DONE]`. Every error, 500s included,
uses OpenAI's error JSON (text that cannot be encoded is escaped): 400 for invalid requests (naming the field) and
prompts longer than the model or cache allow, 404 for an unknown model, 413 for a body over `max_body_bytes`, 429
with Retry-After when the waiting queue is full, 500 when a request failed inside the engine or its chat template
failed, 503 if the engine loop is not running. A streamed request that fails after its first chunk gets an error
event, then `[DONE]`.

Chat in K3's XTML format (`template.supports_tools`) renders the messages as OpenAI dicts (tool role, tool_calls,
reasoning_content) with `tools`, `tool_choice`, `response_format`, `reasoning_effort` and `chat_template_kwargs`
(protocol.py says how each maps), and parses each sample's output ids, not its text (which skips the markers), into
`reasoning_content`, `content` and `tool_calls` (`finish_reason` "tool_calls" when a sample ended with calls;
`usage.completion_tokens_details.reasoning_tokens`); what the parser finds malformed is logged and its text kept in
`content`. A stream sends separate chunks for reasoning, content and each tool call's name/id and argument pieces.
User stop strings end a sample where they appear (markers skipped) and cut `reasoning_content` and `content` at
their first occurrence. A plain or Jinja format refuses what needs XTML with a 400 naming the field.

Images (a vision checkpoint, K3's XTML format): user content parts `image_url` / `image` holding a data URL
(`data:image/png;base64,...`). The server fetches nothing: any other URL is a 400 saying that only data URLs are
accepted. Broken base64, data that is not an image, an image over `max_image_pixels` (read from its header, before
any decoding) and more than `max_images_per_request` images are 400s naming the part
(`messages.0.content.1.image_url`); a text-only model or a plain/Jinja chat format refuses images with a 400.
Decoding and the processor run in the preprocessing threads; the engine encodes each image once when it queues
the request.

Work per request is bounded: the body size; tokenization and template rendering run off the event loop (at most
`PREPROCESS_THREADS` at once) under `preprocess_timeout_s`, templates in a worker process that is killed past its
limit. A client that disconnects, streaming or not, aborts its request, which frees its slot and pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from openk3.data.jinja_sandbox import TemplateFailed, TemplateRejected
from openk3.data.vision import image_prompt
from openk3.serve.async_engine import AsyncLLM, EngineDead, QueueFull
from openk3.serve.config import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES_PER_REQUEST,
    DEFAULT_PREPROCESS_TIMEOUT_S,
)  # fmt: skip
from openk3.serve.chat_answer import ChatAnswer
from openk3.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    FieldError,
    ImagePart,
    chat_logprobs,
    completion_logprobs,
    error_body,
    new_id,
    now,
    usage,
    validation_message,
)  # fmt: skip
from openk3.serve.request import RequestOutput
from openk3.serve.streaming import TextDelta

log = logging.getLogger("openk3.serve")
DISCONNECT_POLL_S = 0.1  # how often a non-streamed request checks that its client is still there
PREPROCESS_THREADS = 2


def _json(content, **options) -> str:
    """JSON text that always encodes as UTF-8: text holding a lone surrogate is written with \\u escapes instead."""
    text = json.dumps(content, ensure_ascii=False, **options)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(content, ensure_ascii=True, **options)
    return text


class SafeJSONResponse(JSONResponse):
    """A JSONResponse that never fails to encode (see `_json`)."""

    def render(self, content) -> bytes:
        return _json(content, allow_nan=False, separators=(",", ":")).encode("utf-8")


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is a 413. With a Content-Length it is decided before
    anything is read; a chunked body is read (at most max_bytes of it) before the app sees it."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) > self.max_bytes:
                return await self._too_large(send)
            return await self.app(scope, receive, send)
        body, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            body.append(message.get("body", b""))
            more = message.get("more_body", False)
            if sum(map(len, body)) > self.max_bytes:
                return await self._too_large(send)
        replay = [{"type": "http.request", "body": b"".join(body), "more_body": False}]

        async def replayed():
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)

    async def _too_large(self, send) -> None:
        body = SafeJSONResponse(error_body(f"the request body exceeds the limit of {self.max_bytes} bytes",
                                           "invalid_request_error", None, 413), status_code=413)  # fmt: skip
        await send({"type": "http.response.start", "status": 413, "headers": body.raw_headers})
        await send({"type": "http.response.body", "body": body.body})


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.kind, self.param, self.headers = status, kind, param, headers


def _error(status: int, message: str, kind: str = "invalid_request_error", param=None, headers=None) -> JSONResponse:
    return SafeJSONResponse(error_body(message, kind, param, status), status_code=status, headers=headers)


def build_app(llm: AsyncLLM, model_name: str, template, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              preprocess_timeout_s: float = DEFAULT_PREPROCESS_TIMEOUT_S,
              max_images_per_request: int = DEFAULT_MAX_IMAGES_PER_REQUEST,
              max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> FastAPI:  # fmt: skip
    preprocess = ThreadPoolExecutor(PREPROCESS_THREADS, thread_name_prefix="openk3-preprocess")

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        preprocess.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="openk3", docs_url=None, redoc_url=None, default_response_class=SafeJSONResponse,
                  lifespan=lifespan)  # fmt: skip
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    engine = llm.engine
    tokenizer = engine.tokenizer
    max_model_len = engine.config.max_model_len

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        return _error(400, message, param=param)

    @app.exception_handler(Exception)
    async def _internal(_request: Request, exc: Exception) -> JSONResponse:
        log.error("request failed", exc_info=exc)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(
            exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        )

    @app.exception_handler(APIError)
    async def _api(_request: Request, exc: APIError) -> JSONResponse:
        return _error(exc.status, str(exc), exc.kind, exc.param, exc.headers)

    @app.get("/health")
    async def health() -> Response:
        body = llm.health()
        if body["status"] == "dead":
            return _error(503, body["error"], "server_error")
        return SafeJSONResponse(body)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(llm.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": now(), "owned_by": "openk3",
                "max_model_len": max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/v1/chat/template")
    async def chat_template() -> dict:
        return {"name": template.name, "source": template.source}

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{model_name}`",
                           "not_found_error", "model")  # fmt: skip

    async def off_loop(fn):
        """Run CPU work (tokenizing, rendering) in the preprocessing threads under the time limit."""
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(preprocess, fn), preprocess_timeout_s)
        except asyncio.TimeoutError as err:
            raise APIError(500, f"preparing the prompt took longer than {preprocess_timeout_s:g} s",
                           "server_error") from err  # fmt: skip

    async def start(prepare, params, rid: str) -> AsyncIterator[RequestOutput]:
        """Admit (reserving room for params.n sequences), prepare the prompt off the loop, queue it."""
        try:
            llm.admit(params.n)
        except QueueFull as err:
            raise APIError(429, f"server busy: {err}", "rate_limit_error", headers={"Retry-After": "1"}) from err
        except EngineDead as err:
            raise APIError(503, str(err), "server_error") from err
        try:
            prompt = await off_loop(prepare)
        except BaseException:
            llm.release(params.n)
            raise
        try:
            return await llm.submit(prompt, params, rid, reserved=True)
        except EngineDead as err:
            raise APIError(503, str(err), "server_error") from err
        except ValueError as err:
            raise APIError(400, str(err), param="prompt") from err

    async def final_output(request: Request, outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
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
                if await request.is_disconnected():
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
        _raise_if_failed(out)
        return out

    def prepare_completion(prompt):
        if not isinstance(prompt, str):
            return {"prompt_token_ids": prompt}
        try:
            return {"prompt": prompt, "prompt_token_ids": engine.encode_prompt(prompt)}
        except ValueError as err:  # text that cannot be tokenized
            raise APIError(400, str(err), param="prompt") from err

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        try:
            params = req.sampling(req.max_tokens or max_model_len, req.logprobs, [])
        except ValueError as err:
            raise APIError(400, str(err)) from err
        rid = new_id("cmpl")
        outputs = await start(lambda: prepare_completion(req.prompt), params, rid)
        top = req.logprobs or 0
        if not req.stream:
            out = await final_output(request, outputs)
            choices = [{"index": o.index, "text": o.text, "finish_reason": o.finish_reason,
                        "logprobs": completion_logprobs(o, 0, len(o.token_ids), top, decode)} for o in out.outputs]  # fmt: skip
            return {"id": rid, "object": "text_completion", "created": now(), "model": model_name, "choices": choices,
                    "usage": usage(len(out.prompt_token_ids), out.outputs, out.num_cached_tokens)}  # fmt: skip

        def chunk(o, text: str, start: int, end: int, finish) -> dict:
            choice = {"index": o.index, "text": text, "finish_reason": finish,
                      "logprobs": completion_logprobs(o, start, end, top, decode)}  # fmt: skip
            return {"id": rid, "object": "text_completion", "created": now(), "model": model_name, "choices": [choice]}

        def usage_of(out: RequestOutput) -> dict:
            return usage(len(out.prompt_token_ids), out.outputs, out.num_cached_tokens)

        events = sse(outputs, lambda _index: _TextStream(params.stop, chunk), usage_of, req.include_usage, rid,
                     "text_completion")  # fmt: skip
        return StreamingResponse(events, media_type="text/event-stream")

    def check_images(images: list[ImagePart]) -> None:
        """What can be refused before any decoding: a text-only model, too many images, a URL that is not data."""
        if not images:
            return
        if engine.vision_model is None:
            raise APIError(400, f"{images[0].path}: this model is text-only; image inputs need a vision checkpoint",
                           param=images[0].path)  # fmt: skip
        if len(images) > max_images_per_request:
            raise APIError(400, f"messages: {len(images)} images exceed the limit of {max_images_per_request} per "
                                f"request", param="messages")  # fmt: skip
        for part in images:
            try:
                part.check_url()
            except FieldError as err:
                raise APIError(400, str(err), param=err.param) from err

    def prepare_chat(encode, images: list[ImagePart] = ()):
        try:
            if images:
                pil = [part.open(max_image_pixels) for part in images]
                try:
                    inputs = engine.process_images(pil, max_image_pixels)
                except ValueError as err:
                    raise APIError(400, f"messages: {err}", param="messages") from err
                ids = encode([image_prompt(im) for im in pil])
                return {"prompt_token_ids": ids, "multi_modal_data": {"image": inputs}}
            return {"prompt_token_ids": encode(None)}
        except FieldError as err:  # an image part that cannot be opened: the 400 names the part
            raise APIError(400, str(err), param=err.param) from err
        except TemplateRejected as err:
            raise APIError(400, str(err), param="messages") from err
        except TemplateFailed as err:
            raise APIError(500, str(err), "server_error") from err
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from err

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        check_model(req.model)
        try:
            req.check_format(template)
            images = req.image_parts()
        except FieldError as err:
            raise APIError(400, str(err), param=err.param) from err
        check_images(images)
        try:
            top = req.top_logprobs or 0
            params = req.sampling(req.requested_max_tokens or max_model_len, top if req.logprobs else None,
                                  template.stop)  # fmt: skip
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from err
        rid = new_id("chatcmpl")
        outputs = await start(lambda: prepare_chat(lambda prompts: req.encode(template, prompts), images), params, rid)
        xtml = template.supports_tools
        answers: dict[int, ChatAnswer] = {}

        def answer_of(index: int) -> ChatAnswer:
            if index not in answers:
                answers[index] = req.answer(template, params.stop)
            return answers[index]

        def usage_of(out: RequestOutput) -> dict:
            reasoning = sum(a.result.reasoning_tokens for a in answers.values()) if xtml else None
            return usage(len(out.prompt_token_ids), out.outputs, out.num_cached_tokens, reasoning)

        def body(choices: list[dict], kind: str = "chat.completion.chunk") -> dict:
            return {"id": rid, "object": kind, "created": now(), "model": model_name, "choices": choices}

        def chunk(o, delta: dict, start: int, end: int, finish) -> dict:
            return body([{"index": o.index, "delta": delta, "finish_reason": finish,
                          "logprobs": chat_logprobs(o, start, end, top, decode) if end > start else None}])  # fmt: skip

        if not req.stream:
            out = await final_output(request, outputs)
            choices = []
            for o in out.outputs:
                choice = {"index": o.index, "message": {"role": "assistant", "content": o.text},
                          "logprobs": chat_logprobs(o, 0, len(o.token_ids), top, decode),
                          "finish_reason": o.finish_reason}  # fmt: skip
                if xtml:
                    answer = answer_of(o.index)
                    answer.update(o.token_ids, finished=True)
                    answer.report(f"{rid} choice {o.index}", o)
                    choice.update(message=answer.message(), finish_reason=answer.finish_reason(o.finish_reason))
                choices.append(choice)
            return {**body(choices, "chat.completion"), "usage": usage_of(out)}

        def stream_of(index: int):
            opening = body([{"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                             "logprobs": None}])  # fmt: skip
            if xtml:
                return _XTMLStream(rid, answer_of(index), chunk, opening)

            def text_chunk(o, text: str, start: int, end: int, finish) -> dict:
                return chunk(o, {"content": text} if text or finish is None else {}, start, end, finish)

            return _TextStream(params.stop, text_chunk, opening)

        return StreamingResponse(sse(outputs, stream_of, usage_of, req.include_usage, rid, "chat.completion.chunk"),
                                 media_type="text/event-stream")  # fmt: skip

    async def sse(outputs, stream_of, usage_of, include_usage: bool, rid: str, kind: str) -> AsyncIterator[str]:
        """Server-sent events: each sample's chunks (`stream_of(index)` makes a sample's stream, which turns its
        latest output into chunks), the usage when asked for, then [DONE]. A failure (a sample that ended in error,
        an engine shut down) is an OpenAI error event before [DONE]."""
        streams: dict[int, object] = {}
        finished_choices: set[int] = set()
        final = None
        try:
            async for out in outputs:
                final = out
                _raise_if_failed(out)
                for o in out.outputs:
                    if o.index in finished_choices:
                        continue
                    if o.index not in streams:
                        streams[o.index] = stream_of(o.index)
                    for body in streams[o.index](o):
                        yield _event(body)
                    if o.finish_reason is not None:
                        finished_choices.add(o.index)
        except APIError as err:
            yield _event(error_body(str(err), err.kind, err.param, err.status))
        except EngineDead as err:
            yield _event(error_body(str(err), "server_error", None, 503))
        except Exception as err:  # noqa: BLE001 - a stream must always end with an error event and [DONE]
            log.error("stream failed", exc_info=err)
            yield _event(error_body(f"internal error: {type(err).__name__}: {err}", "server_error", None, 500))
        else:
            if include_usage and final is not None:
                body = {"id": rid, "object": kind, "created": now(), "model": model_name, "choices": [],
                        "usage": usage_of(final)}  # fmt: skip
                yield _event(body)
        finally:
            await outputs.aclose()  # a disconnect (the response cancelled) aborts the request right here
        yield "data: [DONE]\n\n"

    return app


class _TextStream:
    """One sample's text chunks (completions, and chat in a plain or Jinja format): the text that no stop string can
    take back, with the log-probs of the tokens since the last chunk; the last chunk carries the finish reason."""

    def __init__(self, stop: list[str], chunk, opening: dict | None = None):
        self.delta, self.chunk, self.sent = TextDelta(stop), chunk, 0
        self.pending = [opening] if opening is not None else []

    def __call__(self, o) -> list[dict]:
        bodies, self.pending = self.pending, []
        done = o.finish_reason is not None
        text = self.delta.update(o.text, done)
        if text or done:
            bodies.append(self.chunk(o, text, self.sent, len(o.token_ids), o.finish_reason if done else None))
            self.sent = len(o.token_ids)
        return bodies


class _XTMLStream:
    """One sample's chat chunks in K3's format: one per parsed delta (`reasoning_content`, `content`, or a piece of
    a tool call), then an empty delta with the finish reason ("tool_calls" when the sample ended with calls)."""

    def __init__(self, rid: str, answer: ChatAnswer, chunk, opening: dict):
        self.rid, self.answer, self.chunk, self.sent, self.pending = rid, answer, chunk, 0, [opening]

    def __call__(self, o) -> list[dict]:
        bodies, self.pending = self.pending, []
        done, end = o.finish_reason is not None, len(o.token_ids)
        for delta in self.answer.update(o.token_ids, done):
            bodies.append(self.chunk(o, delta, self.sent, end, None))
            self.sent = end
        if done:
            self.answer.report(f"{self.rid} choice {o.index}", o)
            bodies.append(self.chunk(o, {}, self.sent, end, self.answer.finish_reason(o.finish_reason)))
        return bodies


def _event(body: dict) -> str:
    return f"data: {_json(body)}\n\n"


def _raise_if_failed(out: RequestOutput) -> None:
    """A request one of whose samples ended in error (non-finite logits, a failed step) is a 500 of its own."""
    failed = next((o for o in out.outputs if o.finish_reason == "error"), None)
    if failed is not None:
        raise APIError(500, failed.error or "the request failed in the engine", "server_error")

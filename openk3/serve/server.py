"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) on top of `AsyncLLM`. `build_app` wires each route to its
handler (serving_completion.py, serving_chat.py, serving_models.py, serving_health.py), which does the work without
HTTP; this module adds the body limit and OpenAI's error JSON.

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
`usage.completion_tokens_details.reasoning_tokens`; `reasoning_content` absent when there is none); what the parser
finds malformed is logged and its text kept in `content`. A stream sends separate chunks for reasoning, content and
each tool call's name/id and argument pieces. User stop strings end a sample where they appear (markers skipped) and
cut `reasoning_content` and `content` at their first occurrence. A plain or Jinja format refuses what needs XTML
with a 400 naming the field.

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

import contextlib
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from openk3.serve.async_engine import AsyncLLM
from openk3.serve.config import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES_PER_REQUEST,
    DEFAULT_PREPROCESS_TIMEOUT_S,
)  # fmt: skip
from openk3.serve.protocol import ChatCompletionRequest, CompletionRequest, error_body, validation_message
from openk3.serve.serving import DISCONNECT_POLL_S, PREPROCESS_THREADS, APIError, json_text, log
from openk3.serve.serving_chat import OpenAIServingChat
from openk3.serve.serving_completion import OpenAIServingCompletion
from openk3.serve.serving_health import OpenAIServingHealth
from openk3.serve.serving_models import OpenAIServingModels

# DISCONNECT_POLL_S and PREPROCESS_THREADS are defined in serving.py; exported here too, where they used to be.
__all__ = ["DISCONNECT_POLL_S", "PREPROCESS_THREADS", "APIError", "BodyLimit", "SafeJSONResponse", "build_app"]


class SafeJSONResponse(JSONResponse):
    """A JSONResponse that never fails to encode (text holding a lone surrogate is written with \\u escapes)."""

    def render(self, content) -> bytes:
        return json_text(content, allow_nan=False, separators=(",", ":")).encode("utf-8")


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


def _error(status: int, message: str, kind: str = "invalid_request_error", param=None, headers=None) -> JSONResponse:
    return SafeJSONResponse(error_body(message, kind, param, status), status_code=status, headers=headers)


def _respond(result) -> dict | StreamingResponse:
    """A handler's result as the response: a body as JSON, Server-Sent Events as a stream."""
    return result if isinstance(result, dict) else StreamingResponse(result, media_type="text/event-stream")


def build_app(llm: AsyncLLM, model_name: str, template, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              preprocess_timeout_s: float = DEFAULT_PREPROCESS_TIMEOUT_S,
              max_images_per_request: int = DEFAULT_MAX_IMAGES_PER_REQUEST,
              max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> FastAPI:  # fmt: skip
    """The FastAPI app: each route calls its handler (serving_*.py); errors become OpenAI's error JSON."""
    preprocess = ThreadPoolExecutor(PREPROCESS_THREADS, thread_name_prefix="openk3-preprocess")

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        preprocess.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="openk3", docs_url=None, redoc_url=None, default_response_class=SafeJSONResponse,
                  lifespan=lifespan)  # fmt: skip
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    _add_error_handlers(app)
    models = OpenAIServingModels(model_name, llm.engine.config.max_model_len)
    health = OpenAIServingHealth(llm)
    completion = OpenAIServingCompletion(llm, models, preprocess, preprocess_timeout_s=preprocess_timeout_s)
    chat = OpenAIServingChat(llm, models, template, preprocess, max_images_per_request, max_image_pixels,
                             preprocess_timeout_s=preprocess_timeout_s)  # fmt: skip

    # Every route is async: the handlers run on the event loop, where AsyncLLM lives.
    @app.get("/health")
    async def health_check() -> Response:
        return SafeJSONResponse(health.health())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(health.metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return models.show_available_models()

    @app.get("/v1/chat/template")
    async def chat_template() -> dict:
        return chat.chat_template()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return _respond(await completion.create_completion(req, request.is_disconnected))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return _respond(await chat.create_chat_completion(req, request.is_disconnected))

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's JSON: invalid bodies 400 naming the field, APIError as raised, anything else 500."""

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

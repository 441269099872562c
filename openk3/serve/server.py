"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) on top of `AsyncLLM`.

    GET  /v1/models            the served model
    POST /v1/completions       text completion (prompt: text or token ids), streaming or not
    POST /v1/chat/completions  chat (system / user / assistant messages) through the checkpoint's chat template
    GET  /v1/chat/template     the chat template in use (name and source)
    GET  /health               200 while the engine loop runs, 503 otherwise
    GET  /metrics              Prometheus text (serve/metrics.py)

Streaming is Server-Sent Events in OpenAI's chunk format ending with `data: [DONE]`. Every error uses OpenAI's
error JSON: 400 for invalid requests (naming the field) and prompts longer than the model or cache allow, 404 for
an unknown model, 429 with Retry-After when the waiting queue is full, 503 if the engine loop died. A client that
disconnects mid-stream aborts its request, which frees its slot and pages.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from openk3.data.chat import Message
from openk3.serve.async_engine import AsyncLLM, EngineDead, QueueFull
from openk3.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    completion_logprobs,
    error_body,
    new_id,
    now,
    usage,
)  # fmt: skip
from openk3.serve.request import RequestOutput
from openk3.serve.streaming import TextDelta


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.kind, self.param, self.headers = status, kind, param, headers


def _error(status: int, message: str, kind: str = "invalid_request_error", param=None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, status), status_code=status, headers=headers)


def build_app(llm: AsyncLLM, model_name: str, template) -> FastAPI:
    app = FastAPI(title="openk3", docs_url=None, redoc_url=None)
    engine = llm.engine
    tokenizer = engine.tokenizer
    max_model_len = engine.config.max_model_len

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return _error(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where)

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
        if not llm.alive:
            return _error(503, f"the engine loop stopped: {llm.error!r}", "server_error")
        return JSONResponse({"status": "ok"})

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

    async def start(prompt, params, rid: str) -> AsyncIterator[RequestOutput]:
        try:
            return await llm.submit(prompt, params, rid)
        except QueueFull as err:
            raise APIError(429, f"server busy: {err}", "rate_limit_error", headers={"Retry-After": "1"}) from err
        except EngineDead as err:
            raise APIError(503, str(err), "server_error") from err
        except ValueError as err:
            raise APIError(400, str(err), param="prompt") from err

    async def last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
        final = None
        async for final in outputs:
            pass
        return final

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        check_model(req.model)
        try:
            params = req.sampling(req.max_tokens or max_model_len, req.logprobs, [])
        except ValueError as err:
            raise APIError(400, str(err)) from err
        prompt = req.prompt if isinstance(req.prompt, str) else {"prompt_token_ids": req.prompt}
        rid = new_id("cmpl")
        outputs = await start(prompt, params, rid)
        top = req.logprobs or 0
        if not req.stream:
            out = await last(outputs)
            choices = [{"index": o.index, "text": o.text, "finish_reason": o.finish_reason,
                        "logprobs": completion_logprobs(o, 0, len(o.token_ids), top, decode)} for o in out.outputs]  # fmt: skip
            return {"id": rid, "object": "text_completion", "created": now(), "model": model_name, "choices": choices,
                    "usage": usage(len(out.prompt_token_ids), out.outputs, out.num_cached_tokens)}  # fmt: skip

        def chunk(o, text: str, start: int, end: int, finish) -> dict:
            choice = {"index": o.index, "text": text, "finish_reason": finish,
                      "logprobs": completion_logprobs(o, start, end, top, decode)}  # fmt: skip
            return {"id": rid, "object": "text_completion", "created": now(), "model": model_name, "choices": [choice]}

        return StreamingResponse(sse(outputs, params.stop, chunk, None, req.include_usage, rid, "text_completion"),
                                 media_type="text/event-stream")  # fmt: skip

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest):
        check_model(req.model)
        try:
            messages = [Message("system" if m.role == "developer" else m.role, m.text()) for m in req.messages]
            prompt_ids = template.encode(messages, add_generation_prompt=True)
            top = req.top_logprobs or 0
            params = req.sampling(req.requested_max_tokens or max_model_len, top if req.logprobs else None,
                                  template.stop)  # fmt: skip
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from err
        rid = new_id("chatcmpl")
        outputs = await start({"prompt_token_ids": prompt_ids}, params, rid)
        if not req.stream:
            out = await last(outputs)
            choices = [{"index": o.index, "message": {"role": "assistant", "content": o.text},
                        "logprobs": chat_logprobs(o, 0, len(o.token_ids), top, decode),
                        "finish_reason": o.finish_reason} for o in out.outputs]  # fmt: skip
            return {"id": rid, "object": "chat.completion", "created": now(), "model": model_name, "choices": choices,
                    "usage": usage(len(out.prompt_token_ids), out.outputs, out.num_cached_tokens)}  # fmt: skip

        def chunk(o, text: str, start: int, end: int, finish) -> dict:
            delta = {"content": text} if text or finish is None else {}
            choice = {"index": o.index, "delta": delta, "finish_reason": finish,
                      "logprobs": chat_logprobs(o, start, end, top, decode) if end > start else None}  # fmt: skip
            return {"id": rid, "object": "chat.completion.chunk", "created": now(), "model": model_name,
                    "choices": [choice]}  # fmt: skip

        def opening(index: int) -> dict:
            choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                      "logprobs": None}  # fmt: skip
            return {"id": rid, "object": "chat.completion.chunk", "created": now(), "model": model_name,
                    "choices": [choice]}  # fmt: skip

        return StreamingResponse(sse(outputs, params.stop, chunk, opening, req.include_usage, rid,
                                     "chat.completion.chunk"), media_type="text/event-stream")  # fmt: skip

    async def sse(outputs, stop, chunk, opening, include_usage: bool, rid: str, kind: str) -> AsyncIterator[str]:
        """Server-sent events: text deltas per sample (never text a stop string will take back), then [DONE]."""
        deltas: dict[int, TextDelta] = {}
        sent_tokens: dict[int, int] = {}
        finished_choices: set[int] = set()
        final = None
        async for out in outputs:
            final = out
            for o in out.outputs:
                if o.index in finished_choices:
                    continue
                if o.index not in deltas:
                    deltas[o.index], sent_tokens[o.index] = TextDelta(stop), 0
                    if opening is not None:
                        yield f"data: {json.dumps(opening(o.index))}\n\n"
                done = o.finish_reason is not None
                text = deltas[o.index].update(o.text, done)
                start, end = sent_tokens[o.index], len(o.token_ids)
                if text or done:
                    sent_tokens[o.index] = end
                    yield f"data: {json.dumps(chunk(o, text, start, end, o.finish_reason if done else None))}\n\n"
                if done:
                    finished_choices.add(o.index)
        if include_usage and final is not None:
            body = {"id": rid, "object": kind, "created": now(), "model": model_name, "choices": [],
                    "usage": usage(len(final.prompt_token_ids), final.outputs, final.num_cached_tokens)}  # fmt: skip
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"

    return app

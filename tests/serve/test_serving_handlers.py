"""The server's endpoint handlers called directly, without HTTP: models, health and metrics, completions and chat
(plain format; K3's format is in test_tools.py), streamed and not. Each gives what test_server.py asserts over HTTP:
the same bodies, chunks that concatenate to the non-streamed text, OpenAI's error statuses as APIError."""

from __future__ import annotations

import asyncio
import json

import pytest
from serve_helpers import bpe_tokenizer, make_engine, tiny_model

from openk3.data.chat import PlainChatTemplate
from openk3.serve.async_engine import AsyncLLM
from openk3.serve.protocol import ChatCompletionRequest, CompletionRequest
from openk3.serve.serving import APIError
from openk3.serve.serving_chat import OpenAIServingChat
from openk3.serve.serving_completion import OpenAIServingCompletion
from openk3.serve.serving_health import OpenAIServingHealth
from openk3.serve.serving_models import OpenAIServingModels

MODEL = tiny_model(0)
_TEXT = MODEL.text_config
TOKENIZER = bpe_tokenizer(_TEXT.vocab_size, _TEXT.bos_token_id, _TEXT.eos_token_id, _TEXT.pad_token_id)
OPTIONS = {"hash_unit": 16, "block_size": 32, "max_model_len": 384, "max_num_seqs": 8}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a slot?"}]


def _llm(max_waiting: int = 16) -> AsyncLLM:
    engine = make_engine(MODEL, **OPTIONS)
    engine.tokenizer = TOKENIZER
    return AsyncLLM(engine, max_waiting=max_waiting)


@pytest.fixture(scope="module")
def handlers():
    llm = _llm()
    models = OpenAIServingModels("tiny", llm.engine.config.max_model_len)
    yield (models, OpenAIServingHealth(llm), OpenAIServingCompletion(llm, models),
           OpenAIServingChat(llm, models, PlainChatTemplate(TOKENIZER)))  # fmt: skip
    llm.shutdown()


def _run(coro):
    return asyncio.run(coro)


def _stream(create, req) -> list[dict | str]:
    """The events of a streamed request (`create(req)` made and read on one event loop, where its outputs arrive):
    each chunk's JSON, and the closing "[DONE]"."""

    async def read():
        return [line async for line in await create(req)]

    out = []
    for line in _run(read()):
        assert line.startswith("data: ") and line.endswith("\n\n")
        data = line[len("data: ") : -2]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _counts(usage: dict) -> tuple[int, int]:
    """The token counts of a usage (the cached count differs: the second request hits the prefix cache)."""
    return usage["prompt_tokens"], usage["completion_tokens"]


def test_models_lists_the_served_model_and_refuses_others(handlers):
    models = handlers[0]
    body = models.show_available_models()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["tiny"]
    assert body["data"][0]["max_model_len"] == OPTIONS["max_model_len"]
    models.check_model("tiny")
    models.check_model(None)
    with pytest.raises(APIError, match="gpt-9") as err:
        models.check_model("gpt-9")
    assert (err.value.status, err.value.kind, err.value.param) == (404, "not_found_error", "model")


def test_health_and_metrics():
    llm = _llm()
    health = OpenAIServingHealth(llm)
    assert health.health() == {"status": "ok", "failed_steps": 0}
    metrics = health.metrics().decode()
    for name in ("openk3_time_to_first_token_seconds", "openk3_time_per_output_token_seconds",
                 "openk3_num_requests_waiting", "openk3_cache_blocks_used", "openk3_prefix_cache_mla_hit_rate",
                 "openk3_prefix_cache_state_hit_rate", "openk3_spec_decode_acceptance_rate"):  # fmt: skip
        assert name in metrics
    llm.shutdown()
    with pytest.raises(APIError, match="not running") as err:
        health.health()
    assert (err.value.status, err.value.kind) == (503, "server_error")


def test_completion_streamed_and_not(handlers):
    completion = handlers[2]
    req = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 8, "temperature": 0}
    body = _run(completion.create_completion(CompletionRequest(**req)))
    assert body["object"] == "text_completion" and body["model"] == "tiny" and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 8
    assert body["usage"]["prompt_tokens"] == len(TOKENIZER.encode("def f(x):", add_bos=True))
    events = _stream(
        completion.create_completion, CompletionRequest(**req, stream=True, stream_options={"include_usage": True})
    )
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    assert _counts(events[-2]["usage"]) == _counts(body["usage"])
    chunks = [e["choices"][0] for e in events[:-2]]
    assert "".join(c["text"] for c in chunks) == choice["text"] and chunks[-1]["finish_reason"] == "length"


def test_completion_errors_are_api_errors(handlers):
    completion = handlers[2]
    with pytest.raises(APIError, match="max_model_len") as err:
        _run(completion.create_completion(CompletionRequest(prompt=list(range(10, 410)), max_tokens=4)))
    assert err.value.status == 400
    with pytest.raises(APIError, match="token ids"):
        _run(completion.create_completion(CompletionRequest(prompt=[5000])))
    with pytest.raises(APIError, match="gpt-9"):
        _run(completion.create_completion(CompletionRequest(model="gpt-9", prompt="x")))
    llm = _llm(max_waiting=0)
    try:
        full = OpenAIServingCompletion(llm, OpenAIServingModels("tiny", OPTIONS["max_model_len"]))
        with pytest.raises(APIError) as err:
            _run(full.create_completion(CompletionRequest(prompt="x", max_tokens=2)))
        assert (err.value.status, err.value.kind, err.value.headers) == (429, "rate_limit_error", {"Retry-After": "1"})
    finally:
        llm.shutdown()


def test_chat_streamed_and_not(handlers):
    chat = handlers[3]
    assert chat.chat_template()["name"] == "openk3-plain"
    req = {"model": "tiny", "messages": MESSAGES, "max_tokens": 12, "temperature": 0, "logprobs": True,
           "top_logprobs": 3}  # fmt: skip
    body = _run(chat.create_chat_completion(ChatCompletionRequest(**req)))
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and "reasoning_content" not in choice["message"]
    tokens = choice["logprobs"]["content"]
    assert body["usage"]["completion_tokens"] == len(tokens) and all(len(t["top_logprobs"]) == 3 for t in tokens)
    events = _stream(
        chat.create_chat_completion, ChatCompletionRequest(**req, stream=True, stream_options={"include_usage": True})
    )
    assert events[-1] == "[DONE]" and _counts(events[-2]["usage"]) == _counts(body["usage"])
    deltas = [e["choices"][0] for e in events[:-2]]
    assert deltas[0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(d["delta"].get("content", "") for d in deltas) == choice["message"]["content"]
    assert deltas[-1]["finish_reason"] == choice["finish_reason"]
    with pytest.raises(APIError, match="tools") as err:  # a plain format has no tool calls
        _run(chat.create_chat_completion(ChatCompletionRequest(messages=MESSAGES, tools=[
            {"type": "function", "function": {"name": "f"}}])))  # fmt: skip
    assert (err.value.status, err.value.param) == (400, "tools")

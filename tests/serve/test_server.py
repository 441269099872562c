"""The OpenAI-compatible server, tested through the official `openai` client against a server started on loopback:
models, completions, chat, streaming, logprobs, stop sequences; 32 concurrent streams; disconnects that free their
resources; errors in OpenAI's JSON shape (400, 404, 429); fuzzed request bodies never give a 5xx; API outputs equal
the offline engine's for the same seed."""

from __future__ import annotations

import asyncio
import json
import time

import httpx2
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_helpers import bpe_tokenizer, make_engine, run_to_end, serve_on_loopback, slow_steps, tiny_model
from starlette.testclient import TestClient

from openk3.data.chat import Message, PlainChatTemplate
from openk3.serve.async_engine import AsyncLLM
from openk3.serve.request import SamplingParams
from openk3.serve.server import build_app

MODEL = tiny_model(0)
OPTIONS = {"hash_unit": 16, "block_size": 32, "max_model_len": 384, "max_num_seqs": 8}


_TEXT = MODEL.text_config
TOKENIZER = bpe_tokenizer(_TEXT.vocab_size, _TEXT.bos_token_id, _TEXT.eos_token_id, _TEXT.pad_token_id)


def _engine(**extra):
    engine = make_engine(MODEL, **{**OPTIONS, **extra})
    engine.tokenizer = TOKENIZER
    return engine


@pytest.fixture(scope="module")
def served():
    engine = _engine()
    llm = AsyncLLM(engine, max_waiting=64)
    with serve_on_loopback(build_app(llm, "tiny", PlainChatTemplate(TOKENIZER))) as base:
        yield base, llm
    llm.shutdown()


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def _idle(llm: AsyncLLM, timeout: float = 10.0) -> dict:
    """Wait until the engine holds no request; return its cache usage."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        usage = llm.engine.manager.usage()
        if not llm.engine.has_unfinished() and usage["blocks_used"] == 0 and usage["slots_used"] == 0:
            return usage
        time.sleep(0.02)
    return llm.engine.manager.usage()


def test_openai_client_models_completion_chat_streaming_logprobs_stop(served):
    base, llm = served
    client = _client(base)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    comp = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=8, temperature=0)
    assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 8
    assert comp.usage.prompt_tokens == len(TOKENIZER.encode("def f(x):", add_bos=True))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a slot?"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                          logprobs=True, top_logprobs=3)  # fmt: skip
    choice = chat.choices[0]
    assert choice.message.role == "assistant" and chat.usage.completion_tokens == len(choice.logprobs.content)
    assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
    assert all(t.logprob == t.top_logprobs[0].logprob for t in choice.logprobs.content)  # greedy: the top token
    # Streaming gives the same text, delta by delta, and ends with a finish reason.
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})  # fmt: skip
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(parts) == choice.message.content and finish == choice.finish_reason
    assert usage.completion_tokens == chat.usage.completion_tokens
    # A stop sequence cuts the text before it, in both modes.
    text = choice.message.content
    stop = next((text[i : i + 2] for i in range(1, len(text) - 2) if text[i : i + 2].strip()), None)
    assert stop is not None, f"greedy text too short for a stop test: {text!r}"
    cut = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == text[: text.index(stop)]
    streamed = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                              stop=[stop], stream=True)  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text[: text.index(stop)]
    assert _idle(llm)["blocks_used"] == 0


def test_api_equals_offline_engine_for_the_same_seed(served):
    base, _ = served
    client = _client(base)
    ids = TOKENIZER.encode("import json\n", add_bos=True)
    api = client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0.8, top_p=0.9, seed=11, n=2)
    offline = _engine()
    offline.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=11,
                                                                  n=2), request_id="x")  # fmt: skip
    while offline.has_unfinished():
        outs = {o.request_id: o for o in offline.step()}
        final = outs.get("x", None) or locals().get("final")
    assert [c.text for c in sorted(api.choices, key=lambda c: c.index)] == [o.text for o in final.outputs]
    chat_ids = PlainChatTemplate(TOKENIZER).encode([Message("user", "hello")])
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}], seed=5,
                                          max_tokens=8, temperature=1.0)  # fmt: skip
    offline.add_request({"prompt_token_ids": chat_ids}, SamplingParams(max_tokens=8, temperature=1.0, seed=5,
                        stop=PlainChatTemplate(TOKENIZER).stop), request_id="c")  # fmt: skip
    done = {}
    while offline.has_unfinished():
        done.update({o.request_id: o for o in offline.step() if o.finished})
    assert chat.choices[0].message.content == done["c"].outputs[0].text


def test_32_concurrent_streams_complete_and_free_everything(served):
    base, llm = served
    client = _client(base)
    prompts = [f"Question {i}: why are caches hard?" for i in range(32)]
    want = [client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}], max_tokens=16,
                                           temperature=0).choices[0].message.content for p in prompts[:4]]  # fmt: skip

    async def stream_all():
        aclient = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)

        async def one(p):
            s = await aclient.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}],
                                                      max_tokens=16, temperature=0, stream=True)  # fmt: skip
            text, finish = "", None
            async for chunk in s:
                for c in chunk.choices:
                    text += c.delta.content or ""
                    finish = c.finish_reason or finish
            return text, finish

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        await aclient.close()
        return results, time.perf_counter() - start

    results, seconds = asyncio.run(stream_all())
    assert all(finish in ("stop", "length") for _, finish in results)
    assert [text for text, _ in results[:4]] == want  # concurrent batching did not change anyone's answer
    print(f"32 concurrent streams in {seconds:.2f} s")
    usage = _idle(llm)
    assert usage["blocks_used"] == 0 and usage["slots_used"] == 0
    assert not any(r for r in llm.engine.manager.blocks.ref)  # every page reference returned (cached pages may stay)


def test_disconnect_mid_stream_aborts_and_frees(served, monkeypatch):
    base, llm = served
    before = llm.metrics.requests.labels(outcome="abort")._value.get()
    slow_steps(monkeypatch, llm.engine, 0.01)  # 300 tokens take >= 3 s: the disconnect lands mid-generation
    body = {"model": "tiny", "messages": [{"role": "user", "content": "tell me everything"}], "max_tokens": 300,
            "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip
    with httpx2.Client(timeout=30) as http, http.stream("POST", f"{base}/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert any(line.startswith("data: ") for line in got)
    usage = _idle(llm)
    assert usage["blocks_used"] == 0 and usage["slots_used"] == 0
    assert llm.metrics.requests.labels(outcome="abort")._value.get() == before + 1


def test_errors_use_openai_shape_and_4xx(served):
    base, _ = served
    http = httpx2.Client(base_url=base, timeout=30)
    long_prompt = list(range(10, 10 + 400))
    for path, body, status, needle in (
        ("/v1/completions", {"prompt": long_prompt, "max_tokens": 4}, 400, "max_model_len"),
        ("/v1/completions", {"prompt": "x", "temperature": 7}, 400, "temperature"),
        ("/v1/completions", {"prompt": [5000]}, 400, "token ids"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "gpt-9"),
    ):
        r = http.post(path, json=body)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert needle in err["message"] and err["type"] and err["code"] == status
    r = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    assert http.get("/v1/nowhere").status_code == 404
    assert http.get("/health").json() == {"status": "ok", "failed_steps": 0}
    assert http.get("/v1/chat/template").json()["name"] == "openk3-plain"
    metrics = http.get("/metrics").text
    for name in ("openk3_time_to_first_token_seconds", "openk3_time_per_output_token_seconds",
                 "openk3_num_requests_waiting", "openk3_cache_blocks_used", "openk3_prefix_cache_mla_hit_rate",
                 "openk3_prefix_cache_state_hit_rate", "openk3_spec_decode_acceptance_rate"):  # fmt: skip
        assert name in metrics


def test_full_queue_answers_429_with_retry_after():
    llm = AsyncLLM(_engine(), max_waiting=0)
    try:
        with TestClient(build_app(llm, "tiny", PlainChatTemplate(TOKENIZER))) as client:
            r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
    finally:
        llm.shutdown()


def test_ignore_eos_generates_past_the_end_of_sequence_token():
    engine = _engine()
    # Make the token greedy decoding picks first the end-of-sequence token: a plain request then stops at once.
    engine.add_request({"prompt_token_ids": [5] * 8}, SamplingParams(max_tokens=1, temperature=0), "probe")
    engine.eos_token_id = run_to_end(engine)["probe"][0]
    llm = AsyncLLM(engine, max_waiting=8)
    try:
        with TestClient(build_app(llm, "tiny", PlainChatTemplate(TOKENIZER))) as client:
            body = {"prompt": [5] * 8, "max_tokens": 6, "temperature": 0}
            plain = client.post("/v1/completions", json=body).json()
            assert plain["choices"][0]["finish_reason"] == "stop" and plain["usage"]["completion_tokens"] <= 1
            full = client.post("/v1/completions", json={**body, "ignore_eos": True}).json()
            assert full["choices"][0]["finish_reason"] == "length" and full["usage"]["completion_tokens"] == 6
            bad = client.post("/v1/completions", json={**body, "ignore_eos": 1})
            assert bad.status_code == 400 and "ignore_eos" in bad.text
    finally:
        llm.shutdown()


FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
          "seed", "stop", "stream", "logprobs", "top_logprobs", "stream_options", "user"]  # fmt: skip
values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 2**64) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.sampled_from(["role", "content", "type",
                                                                                        "text"]), children, max_size=3),
    max_leaves=6,
)  # fmt: skip
bodies = st.dictionaries(st.sampled_from(FIELDS), values, max_size=6)


@pytest.fixture(scope="module")
def fuzz_client():
    llm = AsyncLLM(_engine(max_model_len=48, max_num_seqs=4), max_waiting=64)
    with TestClient(build_app(llm, "tiny", PlainChatTemplate(TOKENIZER)), raise_server_exceptions=False) as client:
        yield client
    llm.shutdown()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])  # fmt: skip
@given(body=bodies, chat=st.booleans())
def test_fuzzed_bodies_never_give_5xx(fuzz_client, body, chat):
    if chat and "messages" not in body:
        body["messages"] = [{"role": "user", "content": "hi"}]
    if not chat and "prompt" not in body:
        body["prompt"] = "hi"
    content = json.dumps(body).encode()  # Python's json writes NaN/Infinity, which a strict client would refuse
    r = fuzz_client.post("/v1/chat/completions" if chat else "/v1/completions", content=content,
                         headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert "error" in r.json()

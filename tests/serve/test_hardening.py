"""One hostile request never stops the server: extreme sampling settings, non-finite logits and failing
steps end only their own request; lone surrogates, huge bodies, hostile chat templates, disconnects, simultaneous
floods and unsupported fields each get a JSON answer of their own while the engine keeps serving. Everything runs on
127.0.0.1 with bounded loops."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_helpers import (
    bpe_tokenizer,
    make_engine,
    random_prompt,
    run_outputs,
    run_to_end,
    serve_on_loopback,
    slow_steps,
    tiny_model,
)  # fmt: skip

from openk3.data.chat import JinjaChatTemplate, Message, PlainChatTemplate, load_chat_template
from openk3.data.jinja_sandbox import SandboxedRenderer, TemplateError
from openk3.serve.async_engine import AsyncLLM
from openk3.serve.request import SamplingParams
from openk3.serve.server import build_app

MODEL = tiny_model(0)
TEXT = MODEL.text_config
TOKENIZER = bpe_tokenizer(TEXT.vocab_size, TEXT.bos_token_id, TEXT.eos_token_id, TEXT.pad_token_id)
OPTIONS = {"hash_unit": 16, "block_size": 32, "max_model_len": 256, "max_num_seqs": 8}


def _engine(model=MODEL, **extra):
    engine = make_engine(model, **{**OPTIONS, **extra})
    engine.tokenizer = TOKENIZER
    return engine


class _Served:
    """An AsyncLLM + app on loopback; `.http` is an httpx client on it."""

    def __init__(self, engine=None, template=None, max_waiting=64, **app_options):
        self.llm = AsyncLLM(engine or _engine(), max_waiting=max_waiting)
        self.app = build_app(self.llm, "tiny", template or PlainChatTemplate(TOKENIZER), **app_options)

    def __enter__(self):
        self._ctx = serve_on_loopback(self.app)
        self.base = self._ctx.__enter__()
        self.http = httpx2.Client(base_url=self.base, timeout=60)
        return self

    def __exit__(self, *exc):
        self.http.close()
        self._ctx.__exit__(*exc)
        self.llm.shutdown()


@pytest.fixture(scope="module")
def served():
    with _Served() as s:
        yield s


def _post_raw(http, path: str, raw: str):
    return http.post(path, content=raw.encode("utf-8"), headers={"content-type": "application/json"})


def _is_openai_error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["type"] and err["message"]
    return err


def _alive(s: _Served) -> None:
    """The engine still serves: /health is ok and a plain request completes."""
    assert s.http.get("/health").json()["status"] in ("ok", "degraded")
    r = s.http.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


# ---- 1. sampling that cannot be sampled --------------------------------------------------------------------------
@pytest.mark.parametrize("settings_", [{"temperature": 1e-300}, {"temperature": 1e-39}, {"top_p": 1e-300},
                                       {"top_p": 5e-324}, {"temperature": 1e-300, "top_p": 5e-324}])  # fmt: skip
def test_extreme_sampling_settings_are_served_and_the_engine_survives(served, settings_):
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):  # fmt: skip
        for stream in (False, True):
            r = served.http.post(path, json={**body, **settings_, "max_tokens": 4, "stream": stream, "seed": 1})
            assert r.status_code == 200, r.text
            if stream:
                assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
            else:
                assert r.json()["usage"]["completion_tokens"] == 4
    _alive(served)


def test_tiny_temperature_and_top_p_are_greedy_limits():
    """temperature below 1e-5 is greedy (the T -> 0 limit); top_p below fp32's range keeps the top token."""
    prompt = random_prompt(12, seed=3)
    results = []
    for params in (SamplingParams(max_tokens=6), SamplingParams(max_tokens=6, temperature=1e-300, seed=1),
                   SamplingParams(max_tokens=6, temperature=1.0, top_p=5e-324, seed=1)):  # fmt: skip
        engine = make_engine(MODEL, **OPTIONS)
        engine.add_request({"prompt_token_ids": prompt}, params, request_id="x")
        results.append(run_to_end(engine)["x"])
    assert results[0] == results[1] == results[2]


def _nan_model():
    model = tiny_model(0)
    with torch.no_grad():
        model.lm_head.weight[3, 0] = float("nan")  # every logit row gets a NaN in column 3
    return model


def test_non_finite_logits_fail_only_that_request_and_free_it():
    engine = make_engine(_nan_model(), **OPTIONS)
    for temperature in (0.0, 0.8):
        engine.add_request({"prompt_token_ids": random_prompt(10, seed=1)},
                           SamplingParams(max_tokens=4, temperature=temperature, n=2), request_id=f"t{temperature}")  # fmt: skip
    finals = run_outputs(engine)
    assert len(finals) == 2
    for out in finals.values():
        assert all(o.finish_reason == "error" and "non-finite" in o.error for o in out.outputs)
    usage = engine.manager.usage()
    assert usage["blocks_used"] == 0 and usage["slots_used"] == 0


def test_non_finite_verify_logits_fail_the_speculating_requests_and_free_them():
    """The speculative path: NaN logits in a verify pass end those requests (n = 2: both samples), fold nothing,
    free every slot; a plain request afterwards is served normally."""
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": MODEL}  # drafts at every decode step
    engine = make_engine(MODEL, speculative_config=spec, **OPTIONS)
    run = engine.runner.run

    def nan_verify(reqs, ids, rows, verify=False):
        logits, records = run(reqs, ids, rows, verify)
        return (torch.full_like(logits, float("nan")) if verify else logits), records

    engine.runner.run = nan_verify
    params = SamplingParams(max_tokens=12, n=2, temperature=0.5, seed=0)
    engine.add_request({"prompt_token_ids": random_prompt(20, seed=2)}, params, request_id="spec")
    finals = run_outputs(engine)
    assert engine.spec_stats.steps > 0
    assert [o.finish_reason for o in finals["spec"].outputs] == ["error", "error"]
    engine.runner.run = run
    engine.add_request({"prompt_token_ids": random_prompt(10, seed=5)}, SamplingParams(max_tokens=4), request_id="ok")
    assert len(run_to_end(engine)["ok"]) == 4
    usage = engine.manager.usage()
    assert usage["blocks_used"] == 0 and usage["slots_used"] == 0


def test_nan_checkpoint_gives_json_500_and_stream_error_event_then_done():
    with _Served(_engine(_nan_model())) as s:
        for path, body in (("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):  # fmt: skip
            r = s.http.post(path, json={**body, "max_tokens": 4, "temperature": 0.7})
            assert "non-finite" in _is_openai_error(r, 500)["message"]
            r = s.http.post(path, json={**body, "max_tokens": 4, "stream": True})
            assert r.status_code == 200
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 500
        assert s.http.get("/health").json()["status"] == "ok"  # a bad request is not a bad engine


def _fail_once(obj, method: str, message: str) -> None:
    """Make `obj.method` raise RuntimeError(message) on its next call only."""
    real, calls = getattr(obj, method), []

    def broken_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError(message)
        return real(*args, **kwargs)

    setattr(obj, method, broken_once)


def test_a_step_that_raises_fails_its_requests_and_the_engine_keeps_stepping():
    with _Served() as s:
        _fail_once(s.llm.engine.runner, "run", "injected kernel failure")
        r = s.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert "injected kernel failure" in _is_openai_error(r, 500)["message"]
        health = s.http.get("/health").json()
        assert health["status"] == "degraded" and health["failed_steps"] == 1
        _alive(s)
        usage = s.llm.engine.manager.usage()
        assert usage["blocks_used"] == 0 and usage["slots_used"] == 0


def test_an_error_outside_a_step_fails_open_requests_not_the_loop():
    with _Served() as s:
        _fail_once(s.llm.engine.scheduler, "schedule", "injected scheduler failure")
        r = s.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True})
        assert "injected scheduler failure" in r.text and r.text.rstrip().endswith("[DONE]")
        assert s.llm.alive
        _alive(s)


# ---- 2. text that is not Unicode ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("path", "raw"), [
    ("/v1/completions", '{"model": "\\ud800", "prompt": "hi", "max_tokens": 2}'),
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}'),
    ("/v1/completions", '{"prompt": "hi", "stop": ["\\udc80"], "max_tokens": 2}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\udfffb"}], "max_tokens": 2}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}'),
])  # fmt: skip
def test_lone_surrogates_are_a_json_400(served, path, raw):
    err = _is_openai_error(_post_raw(served.http, path, raw), 400)
    assert "Unicode" in err["message"] or "surrogate" in err["message"]


def test_the_offline_engine_refuses_surrogates_with_a_value_error():
    engine = _engine()
    with pytest.raises(ValueError, match="surrogate"):
        engine.add_request("a\ud800b", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"messages\[0\].content"):
        PlainChatTemplate(TOKENIZER).encode([Message("user", "a\udfffb")])


# ---- 3. large requests ---------------------------------------------------------------------------------------------
def test_a_20mb_body_is_a_413_at_once_while_health_stays_fast(served):
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (20 * 2**20)}]}).encode()

    def post_big():
        start = time.perf_counter()
        r = httpx2.post(f"{served.base}/v1/chat/completions", content=big, timeout=60,
                        headers={"content-type": "application/json"})  # fmt: skip
        return r, time.perf_counter() - start

    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(post_big)
        health = []
        while not fut.done():
            start = time.perf_counter()
            assert served.http.get("/health").status_code == 200
            health.append(time.perf_counter() - start)
            time.sleep(0.05)
        r, seconds = fut.result()
    assert "exceeds the limit" in _is_openai_error(r, 413)["message"]
    assert seconds < 10 and max(health, default=0) < 1.0, (seconds, health)


def test_a_body_without_content_length_is_limited_as_it_streams():
    with _Served(max_body_bytes=4096) as s:

        def chunks():
            for _ in range(64):
                yield b" " * 1024

        r = s.http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        _is_openai_error(r, 413)
        _alive(s)


def test_tokenizing_a_long_prompt_does_not_block_the_event_loop(served):
    """A 3 MB chat message (under the body limit) is tokenized off the loop: /health answers meanwhile; the
    request itself is a 400 (longer than max_model_len)."""
    body = {"messages": [{"role": "user", "content": "def f(x): return x\n" * 150_000}], "max_tokens": 2}

    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(served.http.post, "/v1/chat/completions", json=body)
        worst = 0.0
        while not fut.done():
            start = time.perf_counter()
            served.http.get("/health")
            worst = max(worst, time.perf_counter() - start)
            time.sleep(0.02)
        r = fut.result()
    assert "max_model_len" in _is_openai_error(r, 400)["message"]
    assert worst < 1.0


# ---- 4. chat templates ---------------------------------------------------------------------------------------------
ATTACKS = {
    "nested_loop": (
        "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
        500,
        "did not finish",
    ),
    "huge_range": ("{% for i in range(10**9) %}x{% endfor %}", 500, "Range too big"),
    "sandbox": ("{{ messages.__class__.__mro__ }}", 500, "unsafe"),
    "huge_string": ("{{ 'x' * 10**10 }}", 500, "memory"),
    "huge_output": ("{% for a in range(100000) %}{{ 'y' * 100000 }}{% endfor %}", 500, "more than"),
    "raise_exception": ("{{ raise_exception('Conversation roles must alternate') }}", 400, "must alternate"),
}


@pytest.fixture(scope="module")
def renderer():
    r = SandboxedRenderer(timeout_s=1.0, max_chars=1 << 20)
    yield r
    r.close()


def test_a_template_renders_when_the_worker_pipe_lies_past_fd_setsize(past_fd_setsize):
    """A server with over a thousand open descriptors (connections) gives the template worker's pipe a number past
    select()'s FD_SETSIZE (1024); waiting on it with select() raised "filedescriptor out of range"."""
    r = SandboxedRenderer(timeout_s=5.0, max_chars=1 << 20)
    try:
        assert r.render("{{ a }}-{{ b }}", {"a": 1, "b": "x"}) == "1-x"
        assert r._proc.stdout.fileno() > 1024
    finally:
        r.close()


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_each_template_attack_is_a_json_error_within_its_limit_while_others_are_served(renderer, attack):
    source, status, needle = ATTACKS[attack]
    with _Served(template=JinjaChatTemplate(TOKENIZER, source, renderer)) as s:
        with ThreadPoolExecutor(2) as pool:
            start = time.perf_counter()
            chat = pool.submit(s.http.post, "/v1/chat/completions",
                               json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})  # fmt: skip
            other = pool.submit(s.http.post, "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert other.result().status_code == 200
            r = chat.result()
            seconds = time.perf_counter() - start
        assert needle in _is_openai_error(r, status)["message"]
        assert seconds < 5, seconds
        _alive(s)


def test_template_globals_and_list_form_templates(tmp_path, renderer):
    source = "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}" \
             "{% if add_generation_prompt %}<assistant>{% endif %}|{{ eos_token }}"  # fmt: skip
    config = {"chat_template": [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": source}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = load_chat_template(tmp_path, TOKENIZER, renderer)
    text = template.render([Message("user", "hi")])
    bos, eos = (TOKENIZER.decode([i], skip_special_tokens=False) for i in (TEXT.bos_token_id, TEXT.eos_token_id))
    assert bos and eos and text == f"{bos}<user>hi<assistant>|{eos}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "x", "template": "y"}]}))
    with pytest.raises(ValueError, match="tokenizer_config.json.*default"):
        load_chat_template(tmp_path, TOKENIZER, renderer)


def test_a_template_syntax_error_is_one_line_naming_file_and_line(tmp_path, capsys):
    from openk3.cli import main

    MODEL.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("hello\n{% for m in messages %}{{ m.content }")
    with pytest.raises(TemplateError, match=r"chat_template.jinja: chat template syntax error at line 2"):
        load_chat_template(tmp_path, TOKENIZER)
    assert main(["serve", "--ckpt", str(tmp_path), "--port", "1"]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("k3 serve: threads:")]
    assert len(err) == 1 and "chat_template.jinja" in err[0] and "line 2" in err[0]


# ---- 5. disconnects ------------------------------------------------------------------------------------------------
def test_a_dropped_non_streaming_request_is_aborted(served, monkeypatch):
    aborts = served.llm.metrics.requests.labels(outcome="abort")
    before = aborts._value.get()
    # 200 tokens take >= 4 s, so the client's 0.5 s timeout always drops the request mid-generation (unslowed, a
    # fast CI machine finished all 200 within 0.5 s).
    slow_steps(monkeypatch, served.llm.engine, 0.02)
    body = {"prompt": "tell me everything", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx2.TimeoutException):
        httpx2.post(f"{served.base}/v1/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 10
    while served.llm.engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not served.llm.engine.has_unfinished(), "the dropped request kept running"
    assert aborts._value.get() == before + 1
    usage = served.llm.engine.manager.usage()
    assert usage["blocks_used"] == 0 and usage["slots_used"] == 0


# ---- 9. admission control ------------------------------------------------------------------------------------------
def test_100_simultaneous_requests_with_max_waiting_8_get_429s():
    with _Served(_engine(max_num_seqs=2), max_waiting=8) as s:

        async def flood():
            async with httpx2.AsyncClient(base_url=s.base, timeout=120,
                                          limits=httpx2.Limits(max_connections=100)) as client:  # fmt: skip
                return await asyncio.gather(*(client.post("/v1/completions", json={"prompt": f"q{i}", "max_tokens": 2})
                                              for i in range(100)))  # fmt: skip

        results = asyncio.run(flood())
        codes = [r.status_code for r in results]
        assert set(codes) <= {200, 429}, set(codes)
        # 8 waiting sequences at most: the queue fills (>= 8 served) and the flood is refused (finished requests may
        # make room for a few latecomers; measured here: exactly 8 x 200, 92 x 429).
        assert codes.count(200) >= 8 and codes.count(429) >= 50, (codes.count(200), codes.count(429))
        assert all(r.headers["retry-after"] == "1" for r in results if r.status_code == 429)
        assert s.llm.num_waiting() == 0


def test_admission_counts_n_sequences():
    with _Served(max_waiting=4) as s:
        r = s.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 5})
        assert "this request adds 5" in _is_openai_error(r, 429)["message"]
        assert s.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 4}).status_code == 200


# ---- 10. the minor ones --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("raw", "needle", "param"), [
    ('{"prompt": "hi", ', "not valid JSON", None),
    ('{"prompt": [true]}', "prompt.0", "prompt"),
    ('{"prompt": "hi", "max_tokens": true}', "max_tokens", "max_tokens"),
    ('{"prompt": "hi", "temperature": "0.5"}', "temperature", "temperature"),
    ('{"prompt": "hi", "temperature": NaN}', "temperature", "temperature"),
    ('{"prompt": "hi", "logit_bias": {"5": 10}}', "logit_bias", "logit_bias"),
    ('{"prompt": "hi", "response_format": {"type": "json_object"}}', "response_format", "response_format"),
    ('{"prompt": "hi", "echo": true}', "echo", "echo"),
    ('{"prompt": "hi", "presence_penalty": 0.5}', "presence_penalty", "presence_penalty"),
])  # fmt: skip
def test_bad_and_unsupported_fields_are_400s_naming_the_field(served, raw, needle, param):
    err = _is_openai_error(_post_raw(served.http, "/v1/completions", raw), 400)
    assert needle in err["message"] and err["param"] == param


@pytest.mark.parametrize("field", ["tools", "tool_choice"])
def test_tool_fields_are_400s_with_a_plain_chat_format(served, field):
    # This server's template is the plain format, which has no tool calls (K3's XTML format: tests/serve/test_tools.py).
    value = [{"type": "function", "function": {"name": "f"}}] if field == "tools" else "required"
    body = {"messages": [{"role": "user", "content": "hi"}], field: value}
    err = _is_openai_error(served.http.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == field
    # The values that mean "off" are accepted, as OpenAI clients send them.
    off = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": None, "logit_bias": None,
           "presence_penalty": 0, "frequency_penalty": 0.0, "response_format": {"type": "text"}}  # fmt: skip
    assert served.http.post("/v1/chat/completions", json=off).status_code == 200


# ---- fuzz over loopback ----------------------------------------------------------------------------------------------
FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop", "stream",
          "logprobs", "top_logprobs", "stream_options", "logit_bias", "tools", "echo", "user"]  # fmt: skip
_numbers = st.sampled_from([0, 1, -1, 2, 1e-300, 5e-324, 1e-39, 1e308, float("nan"), float("inf"), 2**63, 0.5])
_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 2**64) | _numbers | st.text(max_size=10)
    | st.sampled_from(["\ud800", "a\udfffb", "{{", "<|eos|>"]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(
        st.sampled_from(["role", "content", "type", "text", "include_usage"]), children, max_size=3),
    max_leaves=6,
)  # fmt: skip


@pytest.fixture(scope="module")
def fuzz_served():
    with _Served(_engine(max_model_len=48, max_num_seqs=4)) as s:
        yield s


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.dictionaries(st.sampled_from(FIELDS), _values, max_size=6), chat=st.booleans())
def test_fuzzed_bodies_over_loopback_give_json_errors_and_a_live_engine(fuzz_served, body, chat):
    body.setdefault("messages" if chat else "prompt", [{"role": "user", "content": "hi"}] if chat else "hi")
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = min(abs(body["max_tokens"]) or 1, 4)  # bounded work per example
    else:
        body["max_tokens"] = 2
    raw = json.dumps(body).encode("utf-8", "surrogatepass")  # invalid UTF-8 bytes on purpose, where surrogates are
    r = fuzz_served.http.post("/v1/chat/completions" if chat else "/v1/completions", content=raw,
                              headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code < 500 or "error" in r.json(), (body, r.status_code, r.text)
    if r.status_code >= 400:
        assert "error" in r.json()
    assert r.status_code != 500, (body, r.text)  # nothing in these bodies should reach an internal error
    assert fuzz_served.llm.alive


def test_fuzz_left_the_engine_serving(fuzz_served):
    _alive(fuzz_served)


# ---- SIGTERM -------------------------------------------------------------------------------------------------------
def test_sigterm_stops_the_server_within_seconds_failing_running_streams(tmp_path):
    MODEL.save_pretrained(tmp_path / "ckpt")
    port_probe = __import__("socket").socket()
    port_probe.bind(("127.0.0.1", 0))
    port = port_probe.getsockname()[1]
    port_probe.close()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "openk3.cli", "serve", "--ckpt", str(tmp_path / "ckpt"),
                             "--port", str(port), "--shutdown-timeout", "1", "--max-model-len", "4096"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx2.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx2.TransportError:
                time.sleep(0.2)
        else:
            pytest.fail("server did not start: " + proc.stderr.read1().decode(errors="replace"))
        # ignore_eos: a greedy stream that meets EOS before the signal lands would end "stop", not "shutting down".
        body = {"prompt": [5] * 8, "max_tokens": 4000, "stream": True, "temperature": 0, "ignore_eos": True}
        with httpx2.Client(timeout=30) as http, http.stream("POST", f"{base}/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            start = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        # uvicorn re-raises the captured SIGTERM once it has shut down, so the exit status is -SIGTERM.
        assert proc.wait(timeout=15) in (0, -signal.SIGTERM)
        seconds = time.monotonic() - start
        print(f"stopped {seconds:.2f} s after SIGTERM; the stream's last events: {rest[-2:]}")
        assert seconds < 10
        assert rest[-1] == "data: [DONE]" and "shutting down" in rest[-2]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

"""Tool calling and reasoning through the OpenAI surface with K3's XTML chat format (docs/serving.md).

A tiny random model is forced to write scripted XTML answers (`ScriptedSampler` replaces the engine's sampling: the
next id of the script registered for the request's prompt ids), so every test knows the exact output ids. Through the
official `openai` client on loopback: a tool call and its result round-trip; streamed chunks assemble to the
non-streamed message; the prompt ids the server builds equal `template.encode` of the same conversation and options;
tool_choice, parallel_tool_calls, stop strings, thinking off and response_format behave as documented; bad fields are
400s naming the field; a plain-template server refuses tool fields; `LLM.chat` parses as the server does.
"""

from __future__ import annotations

import json

import httpx2
import openai
import pytest
from serve_helpers import ScriptedSampler, bpe_tokenizer, make_engine, serve_on_loopback, tiny_model, xtml_answer_ids

import openk3.serve.engine as engine_module
from openk3.data.chat import PlainChatTemplate, XTMLChatTemplate
from openk3.serve.async_engine import AsyncLLM
from openk3.serve.engine import LLM
from openk3.serve.request import SamplingParams
from openk3.serve.server import build_app

MODEL = tiny_model(0)
TEXT = MODEL.text_config
TOKENIZER = bpe_tokenizer(TEXT.vocab_size, TEXT.bos_token_id, TEXT.eos_token_id, TEXT.pad_token_id)
TEMPLATE = XTMLChatTemplate(TOKENIZER)
OPTIONS = {"hash_unit": 16, "block_size": 32, "max_model_len": 1024, "max_num_seqs": 4}
EOS = TEXT.eos_token_id  # <|end_of_msg|>

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]
CONVERSATION = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Weather in Paris?"}]


def _call(name: str, arguments: dict, call_id: str = "c1") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


CALLING = {"role": "assistant", "reasoning_content": "Ask the weather tool.", "content": "",
           "tool_calls": [_call("get_weather", {"city": "Paris", "days": 3})]}  # fmt: skip
ANSWER = {"role": "assistant", "reasoning_content": "It said sun.", "content": "Sunny in Paris. Bye."}
SAMPLER = ScriptedSampler(default=TOKENIZER.encode("Unscripted.") + [EOS])


def _script(conversation: list[dict], answer: dict, **options) -> list[int]:
    """Register the answer the model writes to `conversation` rendered with `options`; returns those prompt ids."""
    prompt = TEMPLATE.encode(conversation, **options)
    SAMPLER.add(prompt, xtml_answer_ids(TEMPLATE, answer, options.get("thinking", True)))
    return prompt


@pytest.fixture(scope="module")
def scripted():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_module, "_sample", SAMPLER)
        yield SAMPLER


@pytest.fixture(scope="module")
def served(scripted):
    engine = make_engine(MODEL, **OPTIONS)
    engine.tokenizer = TOKENIZER
    llm = AsyncLLM(engine, max_waiting=16)
    with serve_on_loopback(build_app(llm, "tiny", TEMPLATE)) as base:
        yield base, llm
    llm.shutdown()


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def _chat(base: str, messages: list[dict], **fields):
    return _client(base).chat.completions.create(model="tiny", messages=messages, max_tokens=300, temperature=0,
                                                 **fields)  # fmt: skip


def _message(m) -> dict:
    """A response message as (reasoning, content, calls by index), call ids aside (each response draws new ones)."""
    calls = {i: {"name": c.function.name, "arguments": c.function.arguments} for i, c in enumerate(m.tool_calls or [])}
    return {"reasoning_content": m.model_extra.get("reasoning_content") or "", "content": m.content or "",
            "tool_calls": calls}  # fmt: skip


def _assemble(stream) -> tuple[dict[int, dict], dict[int, str], dict[int, list[str]], object]:
    """Streamed chunks per choice, assembled as a client does: text concatenated, each call's id and name from its
    first delta and its arguments concatenated; also each choice's finish reason, call ids, and the usage."""
    messages: dict[int, dict] = {}
    finish: dict[int, str] = {}
    ids: dict[int, list[str]] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            d = c.delta
            m = messages.setdefault(c.index, {"reasoning_content": "", "content": "", "tool_calls": {}})
            reasoning = (d.model_extra or {}).get("reasoning_content")
            channels = [x for x in (reasoning, d.content, d.tool_calls) if x]
            assert len(channels) <= 1, "reasoning, content and tool calls come in separate chunks"
            m["reasoning_content"] += reasoning or ""
            m["content"] += d.content or ""
            for call in d.tool_calls or []:
                entry = m["tool_calls"].setdefault(call.index, {"name": "", "arguments": ""})
                if call.id:
                    ids.setdefault(c.index, []).append(call.id)
                    entry["name"] = call.function.name
                entry["arguments"] += call.function.arguments or ""
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return messages, finish, ids, usage


def test_tool_call_round_trip_through_the_openai_client(served):
    base, _ = served
    first_prompt = _script(CONVERSATION, CALLING, tools=TOOLS)
    r = _chat(base, CONVERSATION, tools=TOOLS)
    assert SAMPLER.prompts[-1] == first_prompt  # the server rendered exactly what the template renders
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    assert choice.message.content is None and choice.message.model_extra["reasoning_content"] == "Ask the weather tool."
    reasoning_tokens = r.usage.completion_tokens_details.reasoning_tokens
    assert 0 < reasoning_tokens < r.usage.completion_tokens

    # The client sends back the assistant turn (with its tool_calls and reasoning) and the tool's result.
    assistant = {"role": "assistant", "content": None, "reasoning_content": "Ask the weather tool.",
                 "tool_calls": [call.model_dump(exclude_none=True)]}  # fmt: skip
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'}
    conversation = [*CONVERSATION, assistant, result]
    second_prompt = _script(conversation, ANSWER, tools=TOOLS)
    r = _chat(base, conversation, tools=TOOLS)
    assert SAMPLER.prompts[-1] == second_prompt
    assert second_prompt[: len(first_prompt)] == first_prompt  # the history renders as it was: a prefix-cache hit
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == "Sunny in Paris. Bye."
    assert choice.message.tool_calls is None and choice.message.model_extra["reasoning_content"] == "It said sun."


def test_streamed_chunks_assemble_to_the_non_streamed_message(served):
    base, _ = served
    _script(CONVERSATION, CALLING, tools=TOOLS)
    whole = _chat(base, CONVERSATION, tools=TOOLS)
    stream = _chat(base, CONVERSATION, tools=TOOLS, n=2, stream=True, stream_options={"include_usage": True})
    messages, finish, ids, usage = _assemble(stream)
    assert messages == {0: _message(whole.choices[0].message), 1: _message(whole.choices[0].message)}
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    assert all(len(v) == 1 and v[0].startswith("call_") for v in ids.values()) and ids[0] != ids[1]
    want = whole.usage.completion_tokens_details.reasoning_tokens
    assert usage.completion_tokens_details.reasoning_tokens == 2 * want


def test_stop_strings_cut_content_and_streams_never_send_what_they_take_back(served):
    base, _ = served
    _script(CONVERSATION, ANSWER)
    whole = _chat(base, CONVERSATION, stop=["Paris", "zzzzzzzz"])
    assert whole.choices[0].message.content == "Sunny in " and whole.choices[0].finish_reason == "stop"
    messages, finish, _, _ = _assemble(_chat(base, CONVERSATION, stop=["Paris", "zzzzzzzz"], stream=True))
    assert messages[0] == _message(whole.choices[0].message) and finish == {0: "stop"}


def test_chat_handler_without_http_answers_as_the_server_does(served):
    """OpenAIServingChat called directly (no HTTP) gives the message and finish reason the server sends, call ids
    aside; a stream's chunks concatenate to it."""
    import asyncio

    from openk3.serve.protocol import ChatCompletionRequest
    from openk3.serve.serving_chat import OpenAIServingChat
    from openk3.serve.serving_models import OpenAIServingModels

    base, llm = served
    _script(CONVERSATION, CALLING, tools=TOOLS)
    over_http = _chat(base, CONVERSATION, tools=TOOLS).choices[0]
    chat = OpenAIServingChat(llm, OpenAIServingModels("tiny", OPTIONS["max_model_len"]), TEMPLATE)
    req = {"model": "tiny", "messages": CONVERSATION, "tools": TOOLS, "max_tokens": 300, "temperature": 0}
    body = asyncio.run(chat.create_chat_completion(ChatCompletionRequest(**req)))
    choice = body["choices"][0]
    assert choice["finish_reason"] == over_http.finish_reason == "tool_calls"
    message = choice["message"]
    assert {"reasoning_content": message["reasoning_content"], "content": message["content"] or "",
            "tool_calls": {i: c["function"] for i, c in enumerate(message["tool_calls"])}} == _message(
        over_http.message)  # fmt: skip

    async def streamed() -> list[dict]:
        events = await chat.create_chat_completion(ChatCompletionRequest(**req, stream=True))
        return [json.loads(line[6:]) async for line in events if line.startswith("data: {")]

    deltas = [c["choices"][0]["delta"] for c in asyncio.run(streamed())]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d["function"]["arguments"] for d in deltas for d in d.get("tool_calls", [])) == (
        message["tool_calls"][0]["function"]["arguments"])  # fmt: skip


def test_thinking_effort_thinking_off_and_response_format_reach_the_renderer(served):
    base, _ = served
    prompt = _script(CONVERSATION, ANSWER, thinking_effort="low")
    assert _chat(base, CONVERSATION, reasoning_effort="low").choices[0].message.content == "Sunny in Paris. Bye."
    assert SAMPLER.prompts[-1] == prompt

    schema = {"type": "object", "properties": {"sky": {"type": "string"}}}
    response_format = {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema}}
    json_answer = {"role": "assistant", "content": '{"sky": "sunny"}'}
    prompt = _script(CONVERSATION, json_answer, thinking=False, response_format=response_format)
    r = _chat(base, CONVERSATION, response_format=response_format, extra_body={"chat_template_kwargs": {
        "thinking": False}})  # fmt: skip
    assert SAMPLER.prompts[-1] == prompt
    # No reasoning: the field is absent (not null) from the message, and from every streamed chunk.
    assert r.choices[0].message.content == '{"sky": "sunny"}'
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    raw = httpx2.post(f"{base}/v1/chat/completions", json={"model": "tiny", "messages": CONVERSATION,
                      "max_tokens": 300, "temperature": 0, "response_format": response_format,
                      "chat_template_kwargs": {"thinking": False}}, timeout=60).json()  # fmt: skip
    assert raw["choices"][0]["message"] == {"role": "assistant", "content": '{"sky": "sunny"}'}
    with httpx2.stream("POST", f"{base}/v1/chat/completions", json={"model": "tiny", "messages": CONVERSATION,
                       "max_tokens": 300, "temperature": 0, "stream": True, "response_format": response_format,
                       "chat_template_kwargs": {"thinking": False}}, timeout=60) as stream:  # fmt: skip
        chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert all("reasoning_content" not in d for d in deltas)
    assert "".join(d.get("content", "") for d in deltas) == '{"sky": "sunny"}'


@pytest.mark.parametrize(("tool_choice", "rendered", "accepted"), [
    ("none", "none", False),  # the model is told not to call; a call it makes anyway stays text
    ({"type": "function", "function": {"name": "get_time"}}, "required", False),  # only get_time is accepted
    ({"type": "function", "function": {"name": "get_weather"}}, "required", True),
    ("required", "required", True),
])  # fmt: skip
def test_tool_choice_decides_which_calls_are_accepted(served, tool_choice, rendered, accepted):
    base, _ = served
    prompt = _script(CONVERSATION, CALLING, tools=TOOLS, tool_choice=rendered)
    r = _chat(base, CONVERSATION, tools=TOOLS, tool_choice=tool_choice)
    assert SAMPLER.prompts[-1] == prompt  # a named choice renders as "required" with every tool still declared
    message = r.choices[0].message
    if accepted:
        assert r.choices[0].finish_reason == "tool_calls" and message.tool_calls[0].function.name == "get_weather"
    else:  # the rejected call's raw XTML lands in content, never an empty tool_calls list
        assert r.choices[0].finish_reason == "stop" and message.tool_calls is None
        assert 'call tool="get_weather"' in message.content and '"days": 3' not in message.content


def test_parallel_tool_calls_false_keeps_the_first_call(served):
    base, _ = served
    two = {**CALLING, "tool_calls": [_call("get_weather", {"city": "Paris"}), _call("get_time", {}, "c2")]}
    _script(CONVERSATION, two, tools=TOOLS)
    assert len(_chat(base, CONVERSATION, tools=TOOLS).choices[0].message.tool_calls) == 2
    r = _chat(base, CONVERSATION, tools=TOOLS, parallel_tool_calls=False)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    messages, finish, _, _ = _assemble(_chat(base, CONVERSATION, tools=TOOLS, parallel_tool_calls=False, stream=True))
    assert messages[0] == _message(r.choices[0].message) and finish == {0: "tool_calls"}


USER = [{"role": "user", "content": "hi"}]


def _tool(**function) -> list[dict]:
    return [{"type": "function", "function": function}]


@pytest.mark.parametrize(("fields", "needle", "param"), [
    ({"tools": _tool(description="no name")}, "tools.0.function.name: Field required", "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type", "tools"),
    ({"tools": _tool(name="bad name")}, "tools.0.function.name: String should match pattern", "tools"),
    ({"tools": _tool(name="f", parameters="object")}, "tools.0.function.parameters", "tools"),
    ({"tools": _tool(name="f", parameters={"type": "array"})}, "tools.0.function.parameters: a function's", "tools"),
    ({"tools": _tool(name="f"), "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice: names the function 'g', which is not among tools (f)", "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice: a required or named tool_choice needs tools", "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice: must be", "tool_choice"),
    ({"reasoning_effort": "medium"}, "reasoning_effort: Input should be 'low', 'high' or 'max'", "reasoning_effort"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs: unknown key 'enable_thinking'",
     "chat_template_kwargs"),
    ({"reasoning_effort": "low", "chat_template_kwargs": {"thinking_effort": "max"}}, "reasoning_effort: 'low'",
     "reasoning_effort"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema: Field required", "response_format"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [_call("f", {})]}]}, "messages.0: tool_calls",
     "messages"),
    ({"functions": [{"name": "f"}]}, "functions is not supported", "functions"),
])  # fmt: skip
def test_bad_tool_fields_are_400s_naming_the_field(served, fields, needle, param):
    base, _ = served
    r = httpx2.post(f"{base}/v1/chat/completions", json={"messages": USER, **fields}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["param"] == param, err


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": TOOLS}, "tools"),
    ({"messages": [*USER, {"role": "tool", "tool_call_id": "c1", "content": "42"}]}, "messages"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [_call("f", {})]}]}, "messages"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"chat_template_kwargs": {"thinking": False}}, "chat_template_kwargs"),
])  # fmt: skip
def test_a_plain_template_server_refuses_tool_and_thinking_fields(served, fields, param):
    _, llm = served
    with serve_on_loopback(build_app(llm, "tiny", PlainChatTemplate(TOKENIZER))) as base:
        r = httpx2.post(f"{base}/v1/chat/completions", json={"messages": USER, **fields}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "chat format (openk3-plain) has no" in err["message"], err
        # What a plain format can do still works, with the "off" values OpenAI clients send.
        off = {"messages": USER, "max_tokens": 20, "tools": [], "tool_choice": "auto", "parallel_tool_calls": True,
               "response_format": {"type": "text"}, "chat_template_kwargs": {}}  # fmt: skip
        r = httpx2.post(f"{base}/v1/chat/completions", json=off, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Unscripted."


def test_llm_chat_parses_as_the_server_does(served):
    base, _ = served
    _script(CONVERSATION, CALLING, tools=TOOLS)
    want = _message(_chat(base, CONVERSATION, tools=TOOLS).choices[0].message)
    llm = LLM(MODEL, TOKENIZER, **OPTIONS)
    assert isinstance(llm.chat_template, XTMLChatTemplate)
    outs = llm.chat([CONVERSATION, CONVERSATION], SamplingParams(max_tokens=300), tools=TOOLS)
    for out in outs:
        message = out.outputs[0].message
        calls = {i: c["function"] for i, c in enumerate(message["tool_calls"])}
        assert {"reasoning_content": message["reasoning_content"], "content": message["content"] or "",
                "tool_calls": calls} == want  # fmt: skip
        assert out.outputs[0].finish_reason == "stop"
    with pytest.raises(ValueError, match="tool_choice"):
        llm.chat(CONVERSATION, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})


def test_k3_chat_prints_reasoning_content_and_tool_calls(scripted, monkeypatch, capsys):
    import io

    from openk3.serve.chat_repl import chat_loop

    engine = make_engine(MODEL, **OPTIONS)
    engine.tokenizer = TOKENIZER
    first = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Weather in Paris?"}]
    _script(first, {**CALLING, "tool_calls": [_call("get_weather", {"city": "Paris"})]})
    calling = {"role": "assistant", "content": None, "reasoning_content": "Ask the weather tool.",
               "tool_calls": [_call("get_weather", {"city": "Paris"})]}  # fmt: skip
    # The second turn's prompt holds the first answer as parsed (its call id aside, which the renderer never shows).
    _script([*first, calling, {"role": "user", "content": "And?"}], ANSWER)
    monkeypatch.setattr("sys.stdin", io.StringIO("Weather in Paris?\nAnd?\n/exit\n"))
    assert chat_loop(engine, TEMPLATE, system="Be terse.", max_new_tokens=300, temperature=0.0, top_p=1.0) == 0
    out = capsys.readouterr().out
    assert "k3> [thinking] Ask the weather tool.\n" in out
    assert '[tool call] get_weather({"city": "Paris"})' in out
    assert "k3> [thinking] It said sun.\nSunny in Paris. Bye.\n" in out


def test_k3_chat_without_thinking_and_a_clear_message_when_thinking_is_cut(scripted, monkeypatch, capsys):
    """`k3 chat --no-thinking` renders each turn with the think channel off (the prompt the server renders for
    chat_template_kwargs thinking false) and reads the answer from the response channel; with thinking on, an answer
    that reaches --max-new-tokens inside its reasoning is said plainly, naming both ways out."""
    import io

    from openk3.cli import main
    from openk3.serve.chat_repl import chat_loop

    engine = make_engine(MODEL, **OPTIONS)
    engine.tokenizer = TOKENIZER
    user = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = _script(user, {"role": "assistant", "content": "Sunny."}, thinking=False)
    monkeypatch.setattr("sys.stdin", io.StringIO("Weather in Paris?\n"))
    assert chat_loop(engine, TEMPLATE, max_new_tokens=300, temperature=0.0, thinking=False) == 0
    assert SAMPLER.prompts[-1] == prompt
    out, err = capsys.readouterr()
    assert "k3> Sunny.\n" in out and "[thinking]" not in out and "malformed" not in err

    _script(user, {"role": "assistant", "reasoning_content": "A long thought " * 20, "content": "Sunny."})
    monkeypatch.setattr("sys.stdin", io.StringIO("Weather in Paris?\n"))
    assert chat_loop(engine, TEMPLATE, max_new_tokens=5, temperature=0.0) == 0
    out, err = capsys.readouterr()
    assert "k3> [thinking] " in out
    assert "reached --max-new-tokens (5) while still thinking" in err and "--no-thinking" in err
    assert "malformed" not in err
    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    assert "--no-thinking" in capsys.readouterr().out


def test_llm_chat_with_a_plain_format(scripted):
    from openk3.data.tokenizer import ByteTokenizer

    llm = LLM(MODEL, ByteTokenizer(TEXT.vocab_size), **OPTIONS)  # no XTML markers: the plain format
    assert isinstance(llm.chat_template, PlainChatTemplate)
    out = llm.chat(USER, SamplingParams(max_tokens=4))[0].outputs[0]
    assert out.message == {"role": "assistant", "content": out.text}
    with pytest.raises(ValueError, match=r"tools: this checkpoint's chat format \(openk3-plain\) has no tool calls"):
        llm.chat(USER, tools=TOOLS)

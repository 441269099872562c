"""The XTML output parser: render -> ids -> parse gives back the message (every argument type, a json block, thinking
on and off, our BPE and a byte-level tiktoken that splits characters); the streamed deltas concatenate to the
non-streaming result for every split point; malformed and truncated output and random ids give the defined result
and never raise; parse_xtml_text agrees with parse_xtml on rendered text."""

from __future__ import annotations

import functools
import inspect
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openk3.data.tokenizer import K3_SPECIAL_NAMES, ByteTokenizer, TikTokenTokenizer, train_bpe
from openk3.data.xtml import MARKERS, encode_xtml, render_xtml
from openk3.data.xtml_parse import XTMLParser, parse_xtml, parse_xtml_text

VOCAB = 1024


@functools.cache
def _bpe():
    return train_bpe([inspect.getsource(json)] * 2, VOCAB, {"bos": 768, "eos": 770, "pad": 1023})


@functools.cache
def _tiktoken():
    """Bytes and a few merges, so multi-byte characters are split across tokens; K3's specials on top."""
    ranks = {bytes([b]): b for b in range(256)}
    for word in (b"ar", b"gu", b"me", b"nt", b"ca", b"ll", b"\xc3\xa9", b"\xe4\xbd"):
        ranks.setdefault(word, len(ranks))
    base = len(ranks)
    names = {base + i: K3_SPECIAL_NAMES.get(i, f"<|reserved_token_{base + i}|>") for i in range(256)}
    return TikTokenTokenizer(ranks, names, r"\S+|\s+", base, base + 2, base + 255, "test")


TOKENIZERS = {"bpe": _bpe, "tiktoken": _tiktoken}
ARGS = {
    "city": 'Paris "centre" & café\n\ttab ✓ 你好 🎉 \\u00e9', "days": 3, "ratio": -1.25e-3, "big": 10**20,
    "ok": True, "no": False, "none": None, "nested": {"a": [1, {"b": None}], "c": "d\"e"}, "list": [1, "two", [3.5]],
    "empty": "", 'odd "key" & <x>': "v",
}  # fmt: skip
MESSAGES = {
    "text": {"role": "assistant", "reasoning_content": "Think… 思考 step 1.\n\nstep 2", "content": "Answer: 42."},
    "markup in content": {"role": "assistant", "reasoning_content": "x <|close|>think<|sep|> y",
                          "content": "<|open|>tools<|sep|><|open|>call tool=\"f\"<|sep|> is plain text",
                          "tool_calls": [{"type": "function", "function": {
                              "name": "f", "arguments": {"s": "<|close|>argument<|sep|><|close|>call<|sep|>"}}}]},
    "calls": {"role": "assistant", "reasoning_content": "I will call tools.", "content": "Calling.",
              "tool_calls": [{"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}},
                             {"id": "b", "type": "function", "function": {"name": "raw", "arguments": "not json{ é"}},
                             {"id": "c", "type": "function", "function": {"name": "noargs", "arguments": "{}"}},
                             {"id": "d", "type": "function", "function": {"name": "one", "arguments": {"q": "x"}}}]},
    "calls only": {"role": "assistant", "reasoning_content": "r", "content": "",
                   "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"n": 1.0}'}}]},
}  # fmt: skip
JSON_BLOCK_PROBLEM = "the arguments of call 1 (raw) are not a JSON object: kept as written"


def _ids_of(i: int) -> str:
    return f"id{i}"


def _output(tok, message: dict, thinking: bool) -> list[int]:
    """What the model writes for `message`: its rendered ids after the generation prompt."""
    ids = encode_xtml(render_xtml([message], add_generation_prompt=False, thinking=thinking), tok)
    prompt = encode_xtml(render_xtml([], thinking=thinking), tok)
    assert ids[: len(prompt)] == prompt
    return ids[len(prompt) :]


def _stream(tok, chunks: list[list[int]], **options) -> tuple[list[dict], object]:
    parser = XTMLParser(tok, tool_call_id=_ids_of, **options)
    deltas = [d for chunk in chunks for d in parser.feed(chunk)] + parser.finish()
    return deltas, parser.result()


def _concat(deltas: list[dict]) -> tuple[str, str, list[dict]]:
    """content, reasoning and tool_calls rebuilt from deltas, checking each delta's shape on the way."""
    content, reasoning, calls = "", "", []
    for d in deltas:
        assert len(d) == 1 and all(v for v in d.values())
        if "content" in d:
            content += d["content"]
        elif "reasoning_content" in d:
            reasoning += d["reasoning_content"]
        else:
            (call,) = d["tool_calls"]
            if "id" in call:  # a call's first delta: all of it but the arguments
                assert call["index"] == len(calls) and call["type"] == "function"
                assert call["function"]["arguments"] == ""
                calls.append({"id": call["id"], "type": "function", "function": dict(call["function"])})
            else:
                assert call["index"] == len(calls) - 1 and call["function"]["arguments"]
                calls[-1]["function"]["arguments"] += call["function"]["arguments"]
    return content, reasoning, calls


def _check_stream(tok, ids: list[int], cuts: list[int], **options):
    """Feed ids cut at `cuts`: the deltas concatenate to the result, and the result is the non-streaming one."""
    bounds = [0, *sorted(cuts), len(ids)]
    deltas, result = _stream(tok, [ids[a:b] for a, b in zip(bounds, bounds[1:])], **options)
    assert _concat(deltas) == (result.content, result.reasoning_content, result.tool_calls)
    assert result == parse_xtml(ids, tok, tool_call_id=_ids_of, **options)
    return result


def _expected_calls(message: dict) -> list[tuple[str, object]]:
    out = []
    for call in message.get("tool_calls", []):
        args = call["function"]["arguments"]
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass  # rendered as a json block: comes back as the same string
        out.append((call["function"]["name"], args))
    return out


def _parsed_calls(result) -> list[tuple[str, object]]:
    out = []
    for call in result.tool_calls:
        args = call["function"]["arguments"]
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
        out.append((call["function"]["name"], args))
    return out


@pytest.mark.parametrize("tok_name", sorted(TOKENIZERS))
@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_round_trip(tok_name, thinking, name):
    tok, message = TOKENIZERS[tok_name](), MESSAGES[name]
    ids = _output(tok, message, thinking)
    r = parse_xtml(ids, tok, start="think" if thinking else "response", tool_call_id=_ids_of)
    assert r.content == message["content"]
    assert r.reasoning_content == (message["reasoning_content"] if thinking else "")
    assert _parsed_calls(r) == _expected_calls(message)
    assert [c["id"] for c in r.tool_calls] == [f"id{i}" for i in range(len(r.tool_calls))]
    assert r.problems == ([JSON_BLOCK_PROBLEM] if name == "calls" else [])
    assert r.complete
    assert 0 < r.reasoning_tokens < len(ids) if thinking else r.reasoning_tokens == 0
    assert r.message()["content"] == (None if name == "calls only" else message["content"])
    assert ("tool_calls" in r.message()) == ("tool_calls" in message)
    # The same message parsed with the message's own open tag in front, or after it, with start="message".
    full = encode_xtml(render_xtml([message], add_generation_prompt=False, thinking=thinking), tok)
    for start_ids in (full, full[full.index(tok.special_ids["<|sep|>"]) + 1 :]):
        assert parse_xtml(start_ids, tok, start="message", tool_call_id=_ids_of) == r
    # Rendered text with its markers spelled gives the same (the markup test needs ids to tell content from markup).
    if name != "markup in content":
        text = "".join(s.text for s in render_xtml([message], add_generation_prompt=False, thinking=thinking))
        t = parse_xtml_text(text, start="message", tool_call_id=_ids_of)
        assert (t.content, t.reasoning_content, t.tool_calls, t.problems) == (
            r.content, r.reasoning_content, r.tool_calls, r.problems)  # fmt: skip


def test_default_call_ids_and_arguments_text():
    tok = _bpe()
    r = parse_xtml(_output(tok, MESSAGES["calls"], True), tok)
    ids = [c["id"] for c in r.tool_calls]
    assert len(set(ids)) == 4 and all(i.startswith("call_") and len(i) == 29 for i in ids)
    # json.dumps spacing, insertion order, non-ASCII kept
    assert r.tool_calls[0]["function"]["arguments"] == json.dumps(ARGS, ensure_ascii=False)
    assert [c["function"]["arguments"] for c in r.tool_calls[1:]] == ["not json{ é", "{}", '{"q": "x"}']


@pytest.mark.parametrize("tok_name", sorted(TOKENIZERS))
def test_every_single_split_point(tok_name):
    tok = TOKENIZERS[tok_name]()
    ids = _output(tok, MESSAGES["calls"], True)
    whole = parse_xtml(ids, tok, tool_call_id=_ids_of)
    for k in range(len(ids) + 1):
        assert _check_stream(tok, ids, [k]) == whole
    # Token by token, no delta ever shows a partial character.
    deltas, _ = _stream(tok, [[t] for t in ids])
    assert "\ufffd" not in json.dumps(deltas, ensure_ascii=False)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_multi_splits(data):
    tok = TOKENIZERS[data.draw(st.sampled_from(sorted(TOKENIZERS)))]()
    ids = _output(tok, MESSAGES[data.draw(st.sampled_from(sorted(MESSAGES)))], True)
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=12))
    _check_stream(tok, ids, cuts)


def _invariants(result, n_ids: int) -> None:
    """What holds for any output: every call's arguments is JSON, unless a problem says it is not; the OpenAI message
    builds; reasoning tokens are output tokens."""
    bad = [c for c in result.tool_calls if not _is_json(c["function"]["arguments"])]
    assert len(bad) <= sum("not a JSON object" in p for p in result.problems)
    m = result.message()
    assert m["content"] is not None or result.tool_calls
    assert 0 <= result.reasoning_tokens <= n_ids


def _is_json(s: str) -> bool:
    try:
        return isinstance(json.loads(s), dict)
    except json.JSONDecodeError:
        return False


@pytest.mark.parametrize("tok_name", sorted(TOKENIZERS))
def test_truncated_at_every_token(tok_name):
    tok = TOKENIZERS[tok_name]()
    message = MESSAGES["calls"]
    ids = _output(tok, message, True)
    end = len(ids) - 1  # ids[:end] holds all but <|end_of_msg|>: the message is closed
    for k in range(len(ids) + 1):
        r = _check_stream(tok, ids[:k], [k // 2])
        _invariants(r, k)
        assert r.complete == (k >= end)
        if k < end:
            assert any(p.startswith(("output truncated", "unfinished tag")) for p in r.problems)
        else:
            assert r.problems == [JSON_BLOCK_PROBLEM]
        assert message["reasoning_content"].startswith(r.reasoning_content.rstrip("\ufffd"))
        # Every call but a json block's is valid JSON, holding a prefix of the rendered arguments.
        for (name, got), (want_name, want) in zip(_parsed_calls(r), _expected_calls(message)):
            assert name == want_name
            if isinstance(want, dict):
                assert isinstance(got, dict) and list(got) == list(want)[: len(got)]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_garbage_ids_never_raise(data):
    tok = TOKENIZERS[data.draw(st.sampled_from(sorted(TOKENIZERS)))]()
    specials = sorted(tok.special_ids.values())
    markers = [tok.special_ids[m] for m in MARKERS]
    words = tok.encode('call tool="f" index="1" argument key="k" type="number" think response tools json message ')
    token = st.one_of(st.sampled_from(markers), st.sampled_from(words), st.sampled_from(specials[:30]),
                      st.integers(0, tok.vocab_size - 1))  # fmt: skip
    ids = data.draw(st.lists(token, max_size=80))
    if data.draw(st.booleans()):  # a real output with random edits: deep structure, then broken
        ids = _output(tok, MESSAGES[data.draw(st.sampled_from(sorted(MESSAGES)))], True)
        edit = st.tuples(st.integers(0, len(ids)), st.integers(0, 5), st.lists(token, max_size=3))
        for at, n, new in data.draw(st.lists(edit, max_size=6)):
            ids[at : at + n] = new  # replace n ids by up to 3 others
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=6))
    options = data.draw(st.sampled_from([{}, {"start": "message"}, {"start": "response", "tools": ["f"]}]))
    _invariants(_check_stream(tok, ids, cuts, **options), len(ids))


def _parse(text: str, **options):
    """Parse model output written with its markers spelled (encoded as marker ids, the rest as text)."""
    tok = _bpe()
    ids = tok.encode_special(text)
    return _check_stream(tok, ids, [len(ids) // 3], **options)


O, C, S, E = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"


def _el(tag: str, body: str = "", attrs: str = "") -> str:
    return f"{O}{tag}{attrs}{S}{body}{C}{tag}{S}"


def _call(name: str, body: str, index: int = 1) -> str:
    return _el("call", body, f' tool="{name}" index="{index}"')


def _arg(key: str, kind: str, value: str) -> str:
    return _el("argument", value, f' key="{key}" type="{kind}"')


END = f"{C}message{S}{E}"
MALFORMED = [
    # (output after the generation prompt's think channel, content, reasoning, calls, problems)
    (f"plan{O}response{S}answer{C}response{S}" + END,
     "answer", "plan", [], ["<think> not closed before <response>"]),
    (f"r{C}think{S}{O}response{S}a{O}b{S}bold{C}b{S}c{C}response{S}" + END,
     f"a{O}b{S}bold{C}b{S}c", "r", [], ["unexpected <b> in <response>: kept in content"]),
    (f"r{C}think{S}{O}foo{S}x{C}message{S}{E}", f"{O}foo{S}x", "r", [],
     ["unexpected <foo> in <message>: kept in content", "<foo> not closed before </message>"]),
    (f"{C}think{S} \n {O}response{S}{C}response{S}\n {O}tools{S}" + _call("rm", _arg("p", "string", "/")) +
     _call("f", _arg("n", "number", "2"), 2) + f"{C}tools{S}" + END,
     f'{O}call tool="rm" index="1"{S}{O}argument key="p" type="string"{S}/{C}argument{S}{C}call{S}', "",
     [("f", '{"n": 2}')], ["a call to the undeclared tool 'rm': kept in content"]),
    (f"{C}think{S}{O}tools{S}" + _call("f", _arg("n", "number", "three") + _arg("b", "bool", "yes") +
                                       _arg("n", "null", " null ")) + f"{C}tools{S}" + END,
     "", "", [("f", '{"n": "three", "b": "yes", "n": null}')],
     ["argument 'n' of call 0 (f) is not a valid number: kept as a string",
      "argument 'b' of call 0 (f) has type 'bool': taken as a string",
      "argument 'n' given twice in call 0 (f): both kept in arguments"]),
    (f"{C}think{S}{O}tools{S}" + _call("f", _el("argument", "v", ' type="string"') + _arg("k", "string", "w") +
                                       _el("json", "{}")) +
     _call("g", _el("json", '{"a": 1}') + _arg("k", "string", "v"), 2) + f"{C}tools{S}" + END,
     (f'{O}argument type="string"{S}v{C}argument{S}{O}json{S}{{}}{C}json{S}'
     f'{O}argument key="k" type="string"{S}v{C}argument{S}'), "",
     [("f", '{"k": "w"}'), ("g", '{"a": 1}')],
     ["an argument without a key in call 0 (f): kept in content",
      "a second json block or one after arguments in call 0 (f): kept in content",
      "an argument after a json block in call 1 (g): kept in content"]),
    (f"{C}think{S}{O}response{S}hi{C}response{S}" + _call("f", "") + END,
     'hi' + _call("f", ""), "", [], ["unexpected <call> in <message>: kept in content"]),
    (f"{C}think{S}{O}tools{S}{O}call tool=\"f\" index=\"3\"{S}{O}argument key=\"s\" type=\"string\"{S}ab" + END,
     "", "", [("f", '{"s": "ab"}')],
     ["call 'f' has index '3', expected 1", "<argument> not closed before </message>"]),
    (f"r{C}think{S}  stray  {S}{C}response{S}{O}bad tag{S}{O}response{S}x{O}resp{C}response{S}{C}message{S}{E}z",
     f"stray{S}{C}response{S}{O}bad tag{S}x{O}respz", "r", [],
     ["text outside a channel, in <message>: kept in content", "a <|sep|> outside a tag: kept in content",
      "unexpected </response> in <message>: kept in content", "malformed tag '<|open|>bad tag<|sep|>': kept in content",
      "unfinished tag '<|open|>resp' before <|close|>: kept in content",
      "text outside a channel, after the message: kept in content"]),
    (f"r{C}think{S}{O}response{S}x{E}{E}", f"x{E}", "r", [],
     ["<response> not closed before <|end_of_msg|>", "output after <|end_of_msg|>: kept in content"]),
    (f'{C}think{S}{O}tools{S}{O}call tool="a&amp;&quot;b" index="1"{S}' + _arg("k&quot;", "array", "[1,"),
     "", "", [('a&"b', '{"k\\"": "[1,"}')],
     ["argument 'k\"' of call 0 (a&\"b) is not a valid array: kept as a string", "output truncated in <call>"]),
]  # fmt: skip


@pytest.mark.parametrize("case", range(len(MALFORMED)))
def test_malformed(case):
    text, content, reasoning, calls, problems = MALFORMED[case]
    r = _parse(text, tools=["f", "g", 'a&"b'])
    assert (r.content, r.reasoning_content) == (content, reasoning)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in r.tool_calls] == calls
    assert r.problems == problems
    assert r.complete == (E in text)


def test_starts_and_tokenizers():
    tok = _bpe()
    r = parse_xtml(tok.encode_special(f"hi{C}response{S}{END}"), tok, start="response")
    assert (r.content, r.reasoning_content, r.problems, r.complete) == ("hi", "", [], True)
    r = parse_xtml([], tok)
    assert (r.content, r.problems, r.complete) == ("", ["output truncated in <think>"], False)
    assert parse_xtml([], tok).message() == {"role": "assistant", "content": "", "reasoning_content": None}
    # A character split across tokens at the end of a truncated output becomes U+FFFD, as a full decode gives.
    tik = _tiktoken()
    ids = tik.encode("é你")
    assert parse_xtml(ids[:-1], tik).reasoning_content == tik.decode(ids[:-1]) == "é\ufffd"
    with pytest.raises(ValueError, match="<\\|open\\|>"):
        XTMLParser(ByteTokenizer(VOCAB))
    with pytest.raises(ValueError, match="start"):
        XTMLParser(tok, start="tools")


def test_decoding_is_incremental():
    """A long output costs decode work in proportion to its length: no step re-decodes what came before."""
    tok = _bpe()

    class Counting:
        special_ids, decoded = tok.special_ids, 0

        def decode(self, ids, skip_special_tokens=True):
            Counting.decoded += len(ids)
            return tok.decode(ids, skip_special_tokens)

    message = dict(MESSAGES["calls"], reasoning_content="Long thought, 长的思考. " * 400, content="Answer. " * 300)
    ids = _output(tok, message, True)
    r = parse_xtml(ids, Counting(), tool_call_id=_ids_of)
    assert r == parse_xtml(ids, tok, tool_call_id=_ids_of) and len(ids) > 5000
    assert Counting.decoded < 4 * len(ids)

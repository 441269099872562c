"""K3's output parser: the XTML assistant message the model writes -> OpenAI fields, streamed as chat-chunk deltas.

The generation prompt (data/xtml.py) opens the assistant message and its `think` channel (`response` with thinking
off); the model writes the rest. Grammar, as the released renderer writes it (markers are special ids, tag names and
attributes ordinary text, attribute values escaped `&amp;` `&quot;`):

    message  := [text <|close|>think<|sep|>] <|open|>response<|sep|> text <|close|>response<|sep|>
                [<|open|>tools<|sep|> call* <|close|>tools<|sep|>] <|close|>message<|sep|> <|end_of_msg|>
    call     := <|open|>call tool="NAME" index="N"<|sep|> (argument* | json) <|close|>call<|sep|>
    argument := <|open|>argument key="K" type="T"<|sep|> value <|close|>argument<|sep|>
                (T: string = the raw text; number, boolean, null, object, array = JSON text)
    json     := <|open|>json type="object"<|sep|> raw arguments text <|close|>json<|sep|>

Output: think -> `reasoning_content`, response -> `content`, each call -> `{"id", "type": "function", "function":
{"name", "arguments"}}` with `arguments` = `{"K": value, ...}` (json.dumps spacing, ensure_ascii=False) rebuilt from
the arguments, or a json block's text as it is (what a client sent as a non-JSON arguments string).

One streaming state machine does all of it: `parse_xtml` is `feed(all ids)` + `finish()`, and each decision is made
when its token arrives and never revised, so for any split of the ids into `feed` calls the deltas concatenate to the
non-streaming result. Text between markers is decoded incrementally (data/detokenizer.py); a partial UTF-8 character
is held back until a later token completes it or a marker ends its run. Only the ids decide markup: text that spells
`<|open|>` is content; other special ids (bos, media, reserved) decode to nothing, as `decode` skips them.

Malformed output never raises; each case adds one line to `problems` and nothing is dropped silently (a malformed tools
block's raw text goes to `content`). "Spelled" text is the raw XTML with markers as their names.
- An element where it cannot be (unknown tag, `call` outside `tools`, `argument` in `think`, ...), a call without a
  tool name or to a tool not in `tools` (decided at its open tag), an argument without a key, a json block mixed with
  arguments: the whole element, spelled, goes to `content` and nothing of it to `tool_calls`.
- An element that an enclosing one accepts (`<response>` while `think` is open, `</message>` inside a call): the open
  elements in between are closed as if their close tags had come. `<|end_of_msg|>` closes everything.
- A close tag of no open element, a stray `<|sep|>`, a malformed or unfinished tag, non-whitespace text between
  channels or after the message: spelled into `content` (text stripped of surrounding whitespace; whitespace alone
  between channels is ignored, as the renderer writes none).
- A typed value that does not parse as its type, or an unknown type: kept as a JSON string. A key given twice: both
  stay in `arguments` (a JSON reader keeps the last). A json block that is not a JSON object: kept as it is.
- Truncation (`finish` with something open): open arguments and calls are closed so `arguments` is valid JSON
  (except a json block's own text), `complete` stays False.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

from openk3.data.detokenizer import IncrementalDetokenizer
from openk3.data.xtml import CLOSE, END_OF_MSG, MARKERS, OPEN, SEP, require_markers

# The elements each element may hold; text channels and values hold none.
_CHILDREN = {"message": ("think", "response", "tools"), "tools": ("call",), "call": ("argument", "json")}
_TYPES = ("string", "number", "boolean", "null", "object", "array")
_HEADER = re.compile(r'\s*([A-Za-z_][\w.-]*)((?:\s+[\w.-]+="[^"]*")*)\s*')
_ATTR = re.compile(r'([\w.-]+)="([^"]*)"')
_ENTITY, _ENTITIES = re.compile(r"&(amp|quot);"), {"amp": "&", "quot": '"'}  # one pass: "&amp;quot;" is '&quot;'
_MARKER_SPLIT = re.compile("(" + "|".join(map(re.escape, MARKERS)) + ")")


@dataclass
class ParsedMessage:
    content: str  # the response channel, plus the spelled text of anything malformed
    reasoning_content: str  # the think channel
    tool_calls: list[dict]  # {"id", "type": "function", "function": {"name", "arguments": JSON string}}
    problems: list[str]  # one readable line per malformed thing; empty when the output was clean
    reasoning_tokens: int  # text tokens inside the think channel
    complete: bool  # the message was closed (`<|close|>message<|sep|>` or `<|end_of_msg|>` seen)

    def message(self) -> dict:
        return assistant_message(self.content, self.reasoning_content, self.tool_calls)


def assistant_message(content: str, reasoning_content: str, tool_calls: list[dict]) -> dict:
    """The OpenAI assistant message: content None only when empty beside tool calls, reasoning_content None when
    empty, no empty tool_calls."""
    out = {"role": "assistant", "content": content or (None if tool_calls else ""),
           "reasoning_content": reasoning_content or None}  # fmt: skip
    if tool_calls:
        out["tool_calls"] = tool_calls
    return out


def _typed(kind: str, text: str) -> str | None:
    """`text` as a JSON value of XTML type `kind`, re-serialised; None when it is not one (NaN and infinities are
    not JSON, so they are not one either)."""
    try:
        value = json.loads(text)
        out = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):
        return None
    ok = {"number": isinstance(value, (int, float)) and not isinstance(value, bool), "boolean": isinstance(value, bool),
          "null": value is None, "object": isinstance(value, dict), "array": isinstance(value, list)}  # fmt: skip
    return out if ok[kind] else None


class _Arguments:
    """One call's `arguments` string, built while the call streams. The first child fixes the form: arguments give
    `{"K": value, ...}` (a string value streams as escaped text, a typed one is written at its close), a json block
    gives its own text. Each method returns the text to append to `arguments`."""

    def __init__(self):
        self.form: str | None = None  # "object" | "json"
        self.keys: set[str] = set()
        self.key, self.kind = "", "string"  # the open argument
        self.buffer: list[str] = []  # a typed value's text, or the json block's

    def open_argument(self, key: str, kind: str) -> str:
        start = "{" if self.form is None else ", "
        self.form, self.key, self.kind, self.buffer = "object", key, kind, []
        self.keys.add(key)
        return start + json.dumps(key, ensure_ascii=False) + ": " + ('"' if kind == "string" else "")

    def open_json(self) -> None:
        self.form, self.buffer = "json", []

    def text(self, s: str) -> str:
        if self.form == "object" and self.kind == "string":
            return json.dumps(s, ensure_ascii=False)[1:-1]  # JSON escaping is per character, so chunks concatenate
        self.buffer.append(s)
        return s if self.form == "json" else ""

    def close_argument(self) -> tuple[str, bool]:
        """(text, whether the value had its declared type)."""
        if self.kind == "string":
            return '"', True
        text = "".join(self.buffer)
        value = _typed(self.kind, text)
        return (json.dumps(text, ensure_ascii=False), False) if value is None else (value, True)

    def close(self) -> tuple[str, bool]:
        """(text, whether `arguments` is a JSON object) at the call's close."""
        if self.form != "json":
            return ("{}" if self.form is None else "}"), True
        try:
            return "", isinstance(json.loads("".join(self.buffer)), dict)
        except (ValueError, RecursionError):
            return "", False


def _random_call_id(i: int) -> str:
    return "call_" + secrets.token_hex(12)


class XTMLParser:
    """Feed output ids as they come (`feed` returns OpenAI chat-chunk deltas), then `finish`; `result` is the parsed
    message. `start`: the channel the generation prompt opened ("think", "response", or "message" for none; the
    output may then also begin with `<|open|>message role="assistant"<|sep|>`, as a whole rendered message does);
    `tools`: the declared tool names (None accepts any); `tool_call_id(i)`: the id of the i-th call (0-based)."""

    def __init__(
        self, tokenizer, *, start: str = "think", tools: Iterable[str] | None = None,
        tool_call_id: Callable[[int], str] | None = None,
    ):  # fmt: skip
        if start not in ("think", "response", "message"):
            raise ValueError(f"start must be 'think', 'response' or 'message', got {start!r}")
        require_markers(tokenizer)
        self.tokenizer = tokenizer
        self.markers = {tokenizer.special_ids[m]: m for m in MARKERS}
        self.tools = None if tools is None else set(tools)
        self.tool_call_id = tool_call_id or _random_call_id
        self.stack = ["message"] if start == "message" else ["message", start]  # the open elements
        self.header: list[int] | None = None  # a tag's ids after <|open|>/<|close|>, until <|sep|>
        self.header_marker = OPEN
        self.raw: list[str] | None = None  # inside a rejected element: the tags open within it
        self.run = IncrementalDetokenizer(tokenizer)  # the text since the last marker
        self.stray_seen, self.stray_held = False, ""  # this run outside a channel: non-space seen; trailing space
        self.args: _Arguments | None = None  # the open call's
        self.num_call_tags = 0
        self.content, self.reasoning = [], []  # pieces of each
        self.calls: list[tuple[str, str, list[str]]] = []  # (id, name, arguments pieces)
        self.problems: list[str] = []
        self.reasoning_tokens = 0
        self.complete = self.ended = self.finished = False
        self.began = start != "message"  # a tag or stray text came
        self.out: list[dict] = []  # deltas since the last feed

    def feed(self, ids: Iterable[int]) -> list[dict]:
        """New output ids -> deltas: {"reasoning_content": s} | {"content": s} | a call's first {"tool_calls":
        [{"index", "id", "type", "function": {"name", "arguments": ""}}]} | {"tool_calls": [{"index", "function":
        {"arguments": s}}]}."""
        assert not self.finished, "feed() after finish()"
        for t in ids:
            marker = self.markers.get(t)
            if self.header is not None:
                if marker is None:
                    self.header.append(t)
                    continue
                if marker == SEP:
                    self._tag()
                    continue
                self._unfinished_tag(f"before {marker}")
            if marker is None:
                if self.raw is None and self.stack[-1:] == ["think"]:
                    self.reasoning_tokens += 1
                self.run.append(t)
                self._text(self.run.take())
            else:
                self._end_run()
                if marker in (OPEN, CLOSE):
                    self.header, self.header_marker = [], marker
                elif marker == SEP:
                    self._stray(SEP, "a <|sep|> outside a tag")
                else:
                    self._end_of_msg()
        return self._take()

    def finish(self) -> list[dict]:
        """The end of the output, maybe truncated: flush held text and close whatever is open."""
        if self.finished:
            return []
        if self.header is not None:
            self._unfinished_tag("at the end of the output")
        self._end_run()
        if self.raw is not None or self.stack:
            self.problems.append(f"output truncated in <{self.raw[-1] if self.raw else self.stack[-1]}>")
            self.raw = None
            self._pop_to(0)
        self.finished = True
        return self._take()

    def result(self) -> ParsedMessage:
        """The message parsed so far (the final one after `finish`)."""
        calls = [{"id": id_, "type": "function", "function": {"name": name, "arguments": "".join(parts)}}
                 for id_, name, parts in self.calls]  # fmt: skip
        return ParsedMessage("".join(self.content), "".join(self.reasoning), calls, list(self.problems),
                             self.reasoning_tokens, self.complete)  # fmt: skip

    def _take(self) -> list[dict]:
        out, self.out = self.out, []
        return out

    def _emit(self, key: str, s: str) -> None:
        if not s:
            return
        (self.content if key == "content" else self.reasoning).append(s)
        if self.out and list(self.out[-1]) == [key]:
            self.out[-1][key] += s
        else:
            self.out.append({key: s})

    def _arguments(self, s: str) -> None:
        if not s:
            return
        i = len(self.calls) - 1
        self.calls[i][2].append(s)
        last = self.out[-1]["tool_calls"][0] if self.out and "tool_calls" in self.out[-1] else None
        if last is not None and last["index"] == i and "id" not in last:
            last["function"]["arguments"] += s
        else:
            self.out.append({"tool_calls": [{"index": i, "function": {"arguments": s}}]})

    def _where(self) -> str:
        return f"in <{self.stack[-1]}>" if self.stack else "after the message"

    def _text(self, s: str) -> None:
        top = self.stack[-1] if self.stack else None
        if not s:
            return
        if self.raw is not None or top == "response":
            self._emit("content", s)
        elif top == "think":
            self._emit("reasoning_content", s)
        elif top in ("argument", "json"):
            self._arguments(self.args.text(s))
        else:  # between channels: whitespace is layout; anything else is kept, stripped, in content
            if not self.stray_seen:
                s = s.lstrip()
                if not s:
                    return
                self.stray_seen = self.began = True
                self.problems.append(f"text outside a channel, {self._where()}: kept in content")
            s = self.stray_held + s
            body = s.rstrip()  # trailing space waits: it is dropped if a tag comes next
            self.stray_held = s[len(body) :]
            self._emit("content", body)

    def _end_run(self) -> None:
        # A partial character left at a marker is final; its U+FFFD is what a full decode gives too.
        self._text(self.run.pending)
        self.run = IncrementalDetokenizer(self.tokenizer)
        self.stray_seen, self.stray_held = False, ""

    def _stray(self, spelled: str, problem: str) -> None:
        self.began = True
        if self.raw is None:
            self.problems.append(problem + ": kept in content")
        self._emit("content", spelled)

    def _unfinished_tag(self, why: str) -> None:
        ids, self.header = self.header, None
        spelled = self.header_marker + self.tokenizer.decode(ids)
        self._stray(spelled, f"unfinished tag {spelled!r} {why}")

    def _tag(self) -> None:
        ids, self.header = self.header, None
        text = self.tokenizer.decode(ids)
        spelled = self.header_marker + text + SEP
        m = _HEADER.fullmatch(text)
        name = m[1] if m else None
        attrs = {k: _ENTITY.sub(lambda e: _ENTITIES[e[1]], v) for k, v in _ATTR.findall(m[2])} if m else {}
        closing = self.header_marker == CLOSE
        if self.raw is not None:
            self._raw_tag(name, closing, spelled)
        elif name is None or (closing and attrs):
            self._stray(spelled, f"malformed tag {spelled!r}")
        elif closing:
            self._close(name, spelled)
        else:
            self._open(name, attrs, spelled)
        self.began = True

    def _raw_tag(self, name: str | None, closing: bool, spelled: str) -> None:
        """A tag inside a rejected element: spelled into content, tracking nesting so its own close tag ends it."""
        if name is not None and closing and name != self.raw[-1] and name in self.stack:
            # The rejected element was left open and this closes an element around it.
            self.problems.append(f"<{self.raw[-1]}> not closed before </{name}>")
            self.raw = None
            self._close(name, spelled)
            return
        self._emit("content", spelled)
        if name is not None and not closing:
            self.raw.append(name)
        elif name is not None and name == self.raw[-1]:
            self.raw.pop()
            self.raw = self.raw or None

    def _reject(self, name: str, spelled: str, problem: str) -> None:
        self.problems.append(problem + ": kept in content")
        self._emit("content", spelled)
        self.raw = [name]

    def _open(self, name: str, attrs: dict[str, str], spelled: str) -> None:
        if name == "message" and not self.began and attrs.get("role") == "assistant":
            return  # with start="message", the output may begin with the message's own open tag
        # The innermost open element that may hold it; any open above it were left unclosed.
        depth = next((d for d in range(len(self.stack) - 1, -1, -1) if name in _CHILDREN.get(self.stack[d], ())), None)
        if depth is None:
            return self._reject(name, spelled, f"unexpected <{name}> {self._where()}")
        if depth < len(self.stack) - 1:
            self.problems.append(f"<{self.stack[-1]}> not closed before <{name}>")
            self._pop_to(depth + 1)
        if name == "call":
            self.num_call_tags += 1
            tool = attrs.get("tool")
            if tool is None:
                return self._reject(name, spelled, "a call without a tool name")
            if self.tools is not None and tool not in self.tools:
                return self._reject(name, spelled, f"a call to the undeclared tool {tool!r}")
            if attrs.get("index") != str(self.num_call_tags):
                self.problems.append(f"call {tool!r} has index {attrs.get('index')!r}, expected {self.num_call_tags}")
            i = len(self.calls)
            self.calls.append((self.tool_call_id(i), tool, []))
            self.args = _Arguments()
            self.out.append({"tool_calls": [{"index": i, "id": self.calls[i][0], "type": "function",
                                             "function": {"name": tool, "arguments": ""}}]})  # fmt: skip
        elif name == "argument":
            key, kind, call = attrs.get("key"), attrs.get("type"), self._call()
            if key is None or self.args.form == "json":
                why = "without a key" if key is None else "after a json block"
                return self._reject(name, spelled, f"an argument {why} in {call}")
            if kind not in _TYPES:
                self.problems.append(f"argument {key!r} of {call} has type {kind!r}: taken as a string")
                kind = "string"
            if key in self.args.keys:
                self.problems.append(f"argument {key!r} given twice in {call}: both kept in arguments")
            self._arguments(self.args.open_argument(key, kind))
        elif name == "json":
            if self.args.form is not None:
                return self._reject(name, spelled, f"a second json block or one after arguments in {self._call()}")
            self.args.open_json()
        self.stack.append(name)

    def _call(self) -> str:
        return f"call {len(self.calls) - 1} ({self.calls[-1][1]})"

    def _close(self, name: str, spelled: str) -> None:
        if name not in self.stack:
            return self._stray(spelled, f"unexpected </{name}> {self._where()}")
        if self.stack[-1] != name:
            self.problems.append(f"<{self.stack[-1]}> not closed before </{name}>")
        self._pop_to(len(self.stack) - 1 - self.stack[::-1].index(name))
        if name == "message":
            self.complete = True

    def _end_of_msg(self) -> None:
        if self.ended:
            return self._stray(END_OF_MSG, "output after <|end_of_msg|>")
        inner = self.raw[-1] if self.raw else self.stack[-1] if self.stack else None
        if inner is not None:
            self.problems.append(f"<{inner}> not closed before <|end_of_msg|>")
        self.raw = None
        self._pop_to(0)
        self.complete = self.ended = True

    def _pop_to(self, depth: int) -> None:
        """Close the open elements above `depth`, innermost first."""
        while len(self.stack) > depth:
            name = self.stack.pop()
            if name == "argument":
                text, ok = self.args.close_argument()
                if not ok:
                    self.problems.append(f"argument {self.args.key!r} of {self._call()} is not a valid "
                                         f"{self.args.kind}: kept as a string")  # fmt: skip
                self._arguments(text)
            elif name == "call":
                text, ok = self.args.close()
                self._arguments(text)
                if not ok:
                    self.problems.append(f"the arguments of {self._call()} are not a JSON object: kept as written")
                self.args = None


class _CharTokenizer:
    """Text with XTML markers spelled out, as ids: the markers are 0-3, any other character 4 + its code point."""

    special_ids: ClassVar[dict[str, int]] = {m: i for i, m in enumerate(MARKERS)}

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in _MARKER_SPLIT.split(text):
            ids += [MARKERS.index(part)] if part in MARKERS else [4 + ord(c) for c in part]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i - 4) for i in ids if i >= 4)


def parse_xtml(ids: Iterable[int], tokenizer, **parser_options) -> ParsedMessage:
    """The whole output at once: exactly the streaming parser fed everything (XTMLParser's options)."""
    parser = XTMLParser(tokenizer, **parser_options)
    parser.feed(ids)
    parser.finish()
    return parser.result()


def parse_xtml_text(text: str, **parser_options) -> ParsedMessage:
    """Parse output given as text with the markers spelled (a rendered string, a log line). Caveat: text that spells
    a marker is taken as one, where ids would say it is content; `reasoning_tokens` counts characters."""
    tokenizer = _CharTokenizer()
    return parse_xtml(tokenizer.encode(text), tokenizer, **parser_options)

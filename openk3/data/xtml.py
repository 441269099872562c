"""K3's conversation format, XTML: OpenAI-style messages -> segments -> token ids, as the released renderer does it.

The release renders chats with a Python program (`encoding_k3.py`, `build_chat_segments`), not a template. A
conversation becomes a list of segments, each tokenized on its own: structural markers with special tokens allowed,
everything else (tag names, attributes, user/tool/assistant text) with special tokens disallowed, so a user who types
`<|open|>` gets plain-text tokens. The split is part of the format: merging two segments changes the ids, so
`render_xtml` reproduces the release's segment boundaries exactly (tests/fixtures/xtml/render_cases.json).

Grammar (markers are special tokens; `{...}` are text segments; attributes are ` key` + `="` + value + `"`, values
escaped `&` -> `&amp;`, `"` -> `&quot;`):

    element   := <|open|>{tag}{attrs}<|sep|> body <|close|>{tag}<|sep|>
    message   := element(tag="message", role=..., [name=...] | [tool=..., index=...]) <|end_of_msg|>
    assistant := [element(think, reasoning)] element(response, content)
                 [element(tools, element(call, tool=NAME, index=1..n, element(argument, key=K, type=T, value)*
                                                                   | element(json, type="object", raw arguments)))]

In order: the static tool declaration (`tools=`), the thinking-effort message (thinking on and an effort given),
the messages (a system message carrying `tools` is the dynamic declaration), the `tool_choice` message (`required`
or `none`), the `response_format` message (`json_object`, `json_schema`), then the generation prompt: an open
assistant message and its `think` channel (or `response` when thinking is off). Tool results are re-sorted into the
order of the preceding assistant's `tool_calls` by `tool_call_id` first.

Where the release `assert`s (an unknown thinking effort) we raise ValueError; everything else follows its code.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
MARKERS = (OPEN, CLOSE, SEP, END_OF_MSG)
# The text marker of an image in a message; replaced by that image's prompt when `image_prompts` are given.
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
THINKING_EFFORTS = ("low", "high", "max")

_STATIC_DECLARATION = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{}\n```"
_DYNAMIC_DECLARATION = (
    "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n"
    "```json\n{}\n```"
)
_EFFORT = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), "
    "supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with "
    "`thinking_effort={}`."
)
_TOOL_CHOICE = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
_RAW_JSON = "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."
_JSON_OBJECT = "The system is invoked with `response_format=json_object`.\n" + _RAW_JSON
_JSON_SCHEMA = ("The system is invoked with `response_format=json_schema`.\n" + _RAW_JSON +
                "\nThe JSON data must match the following schema:\n```json\n{}\n```")  # fmt: skip


@dataclass(frozen=True)
class Segment:
    text: str
    allow_special: bool = False


class _Out:
    """The segment list being built. Empty texts are dropped, as the release drops them."""

    def __init__(self, image_prompts: list[str] | None):
        self.segments: list[Segment] = []
        self.image_prompts, self.images_used = image_prompts, 0

    def control(self, text: Any) -> None:
        if str(text):
            self.segments.append(Segment(str(text), True))

    def text(self, text: Any) -> None:
        if str(text):
            self.segments.append(Segment(str(text), False))

    def open(self, tag: str, attrs: Iterable[tuple[str, Any]] = ()) -> None:
        self.control(OPEN)
        self.text(tag)
        for key, value in attrs:
            self.text(f" {key}")
            self.text('="')
            self.text(str(value).replace("&", "&amp;").replace('"', "&quot;"))
            self.text('"')
        self.control(SEP)

    def close(self, tag: str) -> None:
        self.control(CLOSE)
        self.text(tag)
        self.control(SEP)

    def end_of_msg(self) -> None:
        self.control(END_OF_MSG)

    def image(self) -> None:
        if self.image_prompts is None:
            self.control(IMAGE_PLACEHOLDER)
            return
        if self.images_used >= len(self.image_prompts):
            raise ValueError(f"more image placeholders than image prompts ({len(self.image_prompts)})")
        self.control(self.image_prompts[self.images_used])
        self.images_used += 1

    def body(self, text: Any) -> None:
        """Message text: with image prompts given, each placeholder in it becomes the next image's prompt."""
        text = str(text)
        if self.image_prompts is None or IMAGE_PLACEHOLDER not in text:
            self.text(text)
            return
        parts = text.split(IMAGE_PLACEHOLDER)
        for i, part in enumerate(parts):
            self.text(part)
            if i < len(parts) - 1:
                self.image()

    def content(self, content: Any) -> None:
        """A message's `content`: a string, None, or a list of parts (`text`, `image`/`image_url`)."""
        if isinstance(content, str):
            self.body(content)
        elif content is not None:
            for part in content:
                if part["type"] in ("image", "image_url"):
                    self.image()
                else:
                    self.body(part["text"])

    def system(self, kind: str, body: str) -> None:
        """An internal system message (`type` = tool-declare, thinking-effort, tool-choice, response-format); all but
        the tool declarations are stripped, as in the release."""
        self.open("message", [("role", "system"), ("type", kind)])
        self.text(body if kind == "tool-declare" else body.strip())
        self.close("message")
        self.end_of_msg()


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _sorted(value: Any) -> Any:
    """Dict keys sorted at every depth (tool declarations and schemas render independently of key order)."""
    if isinstance(value, dict):
        return {k: _sorted(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value


def _argument_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def _arguments(raw: Any) -> tuple[dict, str | None]:
    """A call's arguments as (mapping, None), or ({}, raw text) for a string that is not JSON (rendered as a `json`
    block). A JSON string of something other than an object is a ValueError, as in the release."""
    if raw is None:
        return {}, None
    if isinstance(raw, dict):
        return raw, None
    if not isinstance(raw, str):
        raise TypeError(f"tool call arguments must be a dict or a JSON object string, got {type(raw).__name__}")
    if not raw.strip():
        return {}, None
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError:
        return {}, raw
    if not isinstance(parsed, dict):
        raise ValueError(f"tool call arguments must be a JSON object, got {type(parsed).__name__}: {raw[:80]!r}")
    return parsed, None


def _call_positions(tool_calls: Any) -> dict[str, tuple[int, Any]]:
    """`tool_calls[].id` -> (1-based position, function name); every entry counts, the first of a repeated id wins."""
    found: dict[str, tuple[int, Any]] = {}
    for position, call in enumerate(tool_calls if isinstance(tool_calls, list) else [], start=1):
        if not isinstance(call, dict) or call.get("id") is None or str(call["id"]) in found:
            continue
        fn = call.get("function")
        found[str(call["id"])] = (position, fn.get("name") if isinstance(fn, dict) else call.get("name"))
    return found


def sort_tool_results(messages: list[Any]) -> list[Any]:
    """Each run of consecutive tool messages in the order of the preceding assistant's `tool_calls`, matched by
    `tool_call_id` (or `id`); a matched result's `tool` (and `name`, if it has one) becomes the call's function name.
    A run with any unmatched message is left as it is. The input messages are never modified."""
    out: list[Any] = []
    positions: dict[str, tuple[int, Any]] = {}
    i = 0
    while i < len(messages):
        message = messages[i]
        role = message.get("role") if isinstance(message, dict) else None
        if role != "tool":
            if role == "assistant":
                positions = _call_positions(message.get("tool_calls")) if message.get("tool_calls") else {}
            out.append(message)
            i += 1
            continue
        run = []
        while i < len(messages) and isinstance(messages[i], dict) and messages[i].get("role") == "tool":
            call_id = messages[i].get("tool_call_id", messages[i].get("id"))
            run.append((positions.get(str(call_id)) if call_id is not None else None, len(run), messages[i]))
            i += 1
        if any(match is None for match, _, _ in run):
            out += [m for _, _, m in run]
            continue
        for (_, name), _, m in sorted(run, key=lambda r: (r[0][0], r[1])):
            if name is None:
                out.append(m)
                continue
            resolved = {**m, "tool": name}
            if "name" in resolved:
                resolved["name"] = name
            out.append(resolved)
    return out


def _function(call: dict) -> dict:
    return call.get("function", call)


def _assistant(out: _Out, message: dict, thinking: bool) -> None:
    if thinking:  # the think channel is structural: present (maybe empty) in every assistant message
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        out.open("think")
        if reasoning is not None and str(reasoning).strip():
            out.body(reasoning)
        out.close("think")
    out.open("response")
    out.content(message.get("content"))
    out.close("response")
    calls = message.get("tool_calls")
    if not calls:
        return
    out.open("tools")
    for index, call in enumerate(calls, start=1):
        fn = _function(call)
        out.open("call", [("tool", fn["name"]), ("index", index)])
        arguments, raw = _arguments(fn.get("arguments"))
        if raw is not None:
            out.open("json", [("type", "object")])
            out.body(raw)
            out.close("json")
        else:
            for key, value in arguments.items():
                out.open("argument", [("key", key), ("type", _argument_type(value))])
                out.body(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
                out.close("argument")
        out.close("call")
    out.close("tools")


def _response_schema(options: dict) -> Any:
    """The schema of a `json_schema` response format: `response_schema=` when given, else looked up in
    `response_format.json_schema` (its `schema`, else its `json_schema`, else the object itself)."""
    if "response_schema" in options:
        return options["response_schema"]
    fmt = options.get("response_format")
    spec = fmt.get("json_schema") if isinstance(fmt, dict) else getattr(fmt, "json_schema", None)
    if spec is None:
        return None
    if isinstance(spec, dict):
        return spec.get("schema", spec.get("json_schema", spec))
    for key in ("schema", "json_schema"):
        if getattr(spec, key, None) is not None:
            return getattr(spec, key)
    return spec


def render_xtml(
    messages: list[dict], tools: list[dict] | None = None, *, add_generation_prompt: bool = True,
    thinking: bool = True, image_prompts: list[str] | None = None, **options: Any,
) -> list[Segment]:  # fmt: skip
    """The release's segments for a conversation. `options`: `thinking_effort` (low/high/max; only with thinking
    on), `tool_choice` ("required" and "none" add a system message; "auto" and a named function add nothing),
    `response_format` ({"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}), `response_schema`
    (overrides the one in `response_format`). `image_prompts`: one prompt per image, in order, replacing each image
    part and each `<|kimi_image_placeholder|>` in text; without them a placeholder is emitted per image part."""
    messages = sort_tool_results(messages)
    out = _Out(image_prompts)
    if tools:
        out.system("tool-declare", _STATIC_DECLARATION.format(_compact(_sorted(tools))))
    effort = options.get("thinking_effort")
    if thinking and effort is not None:
        if effort not in THINKING_EFFORTS:
            raise ValueError(f"thinking_effort must be one of {list(THINKING_EFFORTS)}, got {effort!r}")
        out.system("thinking-effort", _EFFORT.format(effort))

    calls, tool_index = None, 0
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = message["role"]
        if role == "system" and message.get("tools"):
            out.system("tool-declare", _DYNAMIC_DECLARATION.format(_compact(_sorted(message["tools"]))))
        elif role in ("user", "system"):
            out.open("message", [("role", role)] + ([("name", message["name"])] if message.get("name") else []))
            out.content(message.get("content"))
            out.close("message")
            out.end_of_msg()
        elif role == "tool":
            tool_index += 1
            name = message.get("tool", message.get("name"))
            if name is None and calls is not None and tool_index <= len(calls):
                name = _function(calls[tool_index - 1])["name"]
            if name is None:
                raise ValueError(f"tool message {tool_index} has no tool name: give it `name` (or `tool`), or a "
                                 f"`tool_call_id` of the preceding assistant's tool_calls")  # fmt: skip
            out.open("message", [("role", "tool"), ("tool", name), ("index", tool_index)])
            out.content(message.get("content"))
            out.close("message")
            out.end_of_msg()
        elif role == "assistant":
            calls, tool_index = message.get("tool_calls"), 0
            out.open("message", [("role", "assistant")] + ([("name", message["name"])] if message.get("name") else []))
            _assistant(out, message, thinking)
            out.close("message")
            out.end_of_msg()

    choice = options.get("tool_choice")
    if isinstance(choice, str) and choice in _TOOL_CHOICE:
        out.system("tool-choice", _TOOL_CHOICE[choice])
    fmt = options.get("response_format")
    kind = fmt.get("type", fmt) if isinstance(fmt, dict) else fmt
    if kind == "json_object":
        out.system("response-format", _JSON_OBJECT)
    elif kind == "json_schema":
        out.system("response-format", _JSON_SCHEMA.format(_compact(_sorted(_response_schema(options)))))

    if add_generation_prompt:
        out.open("message", [("role", "assistant")])
        out.open("think" if thinking else "response")
    if image_prompts is not None and out.images_used != len(image_prompts):
        raise ValueError(f"{len(image_prompts)} image prompts for {out.images_used} images in the conversation")
    return out.segments


def missing_markers(tokenizer) -> list[str]:
    """The XTML markers the tokenizer has no special token for ([] when it can speak the format)."""
    special = getattr(tokenizer, "special_ids", {})
    return [m for m in MARKERS if m not in special]


def require_markers(tokenizer) -> None:
    """ValueError naming the missing markers unless the tokenizer can speak XTML."""
    missing = missing_markers(tokenizer)
    if missing:
        raise ValueError(f"the tokenizer has no special tokens {missing}: it cannot use K3's XTML chat format")


def encode_xtml(segments: Iterable[Segment], tokenizer) -> list[int]:
    """Token ids of rendered segments, each encoded on its own: control segments with the tokenizer's special names
    recognised (`encode_special`), text with special tokens disallowed (`encode`)."""
    require_markers(tokenizer)
    ids: list[int] = []
    for segment in segments:
        ids += tokenizer.encode_special(segment.text) if segment.allow_special else tokenizer.encode(segment.text)
    return ids

"""The OpenAI request and response shapes the server speaks (docs/serving.md, "HTTP server").

Requests are strict pydantic models (no bool-as-int, no string numbers, finite floats, valid Unicode) that ignore
unknown fields (e.g. `user`), refuse the OpenAI fields not implemented (`UNSUPPORTED`: logit_bias, the legacy
`functions`/`function_call`, ...) and reject bad values with a message naming the field; responses are plain dicts in
OpenAI's JSON. Engine extras (`top_k`, `ignore_eos`) arrive as extra body fields, as the openai client's
`extra_body` sends them.

Chat fields for K3's XTML format, and how each maps (`ChatCompletionRequest.render_options`):
- messages: roles system, user, assistant, tool (`developer` is system); `name`, assistant `tool_calls`, tool
  `tool_call_id`, assistant `reasoning_content` (or `reasoning`) go to the renderer as OpenAI dicts.
- tools: `{"type": "function", "function": {"name", "description"?, "parameters"? (a JSON schema object),
  "strict"?}}`, declared to the model as sent.
- tool_choice: "auto" (default), "none" (the model is told not to call; a call it makes anyway is reported as a
  problem and its text kept in content), "required", or a named function: rendered as "required" with every tool
  still declared (the release renderer has no named form; an unchanged declaration keeps prefix-cache hits), and
  only that function's calls are accepted. "required" or named without tools is a 400.
- parallel_tool_calls: true (default) or false: only the first call of the answer is returned, later ones are
  dropped (the model is not told).
- response_format: text, json_object, json_schema (`json_schema.schema`): an instruction to the model, as the release
  renders it; decoding is not constrained.
- reasoning_effort / chat_template_kwargs.thinking_effort: K3's `thinking_effort`, low/high/max (default max);
  chat_template_kwargs.thinking: false turns thinking off. Other chat_template_kwargs keys are a 400.
- images (a vision checkpoint, XTML format only): user content parts `{"type": "image_url", "image_url": {"url":
  "data:image/png;base64,..."}}` (`image_url` may be the URL string) or `{"type": "image", "image": URL}`; only data
  URLs (`ImagePart`); each becomes its image prompt in the rendered text (`encode(..., image_prompts=...)`).
`ChatCompletionRequest.answer` makes the parser of one sample's answer (serve/chat_answer.py).
"""

from __future__ import annotations

import base64
import binascii
import json
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)  # fmt: skip
from pydantic_core import PydanticCustomError

from openk3.data.chat import Message, check_text
from openk3.data.vision import open_image
from openk3.data.xtml import THINKING_EFFORTS
from openk3.serve.chat_answer import ChatAnswer
from openk3.serve.request import CompletionOutput, SamplingParams


def _unicode(value: str) -> str:
    try:
        check_text(value, "text")
    except ValueError as err:
        raise PydanticCustomError("unicode", str(err).removeprefix("text: ")) from None
    return value


# Strings must be valid Unicode (JSON can spell a lone surrogate, "\ud800", which nothing downstream can encode).
Text = Annotated[str, AfterValidator(_unicode)]

# OpenAI fields this server does not implement. Sent with a value other than the one meaning "off", each is a 400
# naming it, never silently ignored. `functions`/`function_call` are the legacy spelling of tools: use `tools`.
UNSUPPORTED = {
    "logit_bias": (None, {}), "functions": (None, []), "function_call": (None, "none", "auto"),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0),
    "suffix": (None, ""), "echo": (None, False), "best_of": (None, 1), "audio": (None,), "modalities": (None, ["text"]),
    "prediction": (None,), "web_search_options": (None,), "min_p": (None, 0, 0.0),
}  # fmt: skip
# Chat fields that /v1/completions (no messages, no chat format) cannot honour.
CHAT_ONLY = {
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "parallel_tool_calls": (None, True, False),
    "response_format": (None, {"type": "text"}), "reasoning_effort": (None,), "chat_template_kwargs": (None, {}),
}  # fmt: skip


def _refuse(data, refused: dict, where: str):
    if isinstance(data, dict):
        for name, off in refused.items():
            if name in data and not any(data[name] == v and type(data[name]) is type(v) for v in off):
                raise PydanticCustomError("unsupported", f"{name} is not supported by {where}", {"field": name})
    return data


class _Request(BaseModel):
    # Strict: `true` is not the token id 1 and "0.5" is not a temperature; unknown OpenAI fields (`user`) are ignored.
    model_config = ConfigDict(extra="ignore", strict=True)

    model: Text | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=0)
    n: int = Field(default=1, ge=1, le=16)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: dict | None = None
    # vLLM's extension: keep generating past the end-of-sequence token (benchmarks and load tests need fixed lengths).
    ignore_eos: bool = False

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        return _refuse(data, UNSUPPORTED, "this server")

    def sampling(self, max_tokens: int, logprobs: int | None, extra_stop: list[str]) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > 8:
            raise ValueError("stop: at most 8 stop sequences")
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              seed=self.seed, stop=stop + extra_stop, n=self.n, logprobs=logprobs,
                              ignore_eos=self.ignore_eos)  # fmt: skip

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Request):
    prompt: Text | list[int] = Field(min_length=1)
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)

    @model_validator(mode="before")
    @classmethod
    def _refuse_chat_fields(cls, data):
        return _refuse(data, CHAT_ONLY, "/v1/completions (it is a chat field: use /v1/chat/completions)")


class FieldError(ValueError):
    """A request its chat format cannot honour; `param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _field_error(field: str, message: str) -> PydanticCustomError:
    """A request-level error that names its field (the server reports `field: message`, param `field`)."""
    return PydanticCustomError("request_field", message, {"field": field})


def _json_text(value) -> None:
    """A JSON value from the body is rendered as JSON text into the prompt: its strings must be valid Unicode."""
    _unicode(json.dumps(value, ensure_ascii=False))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionCall(_Strict):
    name: Text
    arguments: Text  # a JSON object as text, as OpenAI sends it back


class ToolCall(_Strict):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Strict):
    name: Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]
    description: Text | None = None
    parameters: dict | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _json_schema_object(cls, value: dict | None) -> dict | None:
        if value is not None:
            if "type" in value and value["type"] != "object":
                raise PydanticCustomError("schema", "a function's parameters must be a JSON schema of type object")
            _json_text(value)
        return value


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: Annotated[dict[str, Text], Field(min_length=1)]


class JSONSchemaFormat(_Strict):
    name: Text | None = None
    description: Text | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _unicode_schema(cls, value: dict) -> dict:
        _json_text(value)
        return value


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema object with a schema')
        return self


class ChatTemplateKwargs(_Strict):
    """vLLM's `chat_template_kwargs` for K3's format: `thinking` on/off, `thinking_effort`."""

    thinking: bool | None = None
    thinking_effort: Literal[THINKING_EFFORTS] | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data):
        unknown = sorted(set(data) - set(cls.model_fields)) if isinstance(data, dict) else []
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r} (accepted: {', '.join(cls.model_fields)})")
        return data


IMAGE_PART_TYPES = ("image_url", "image")


@dataclass
class ImagePart:
    """An image content part: its URL and the field that holds it (`messages.0.content.1.image_url`), which every
    error about the image names."""

    url: str
    path: str

    def check_url(self) -> None:
        """FieldError naming the part unless its URL is a data URL: nothing is ever fetched."""
        if not self.url.startswith("data:"):
            raise FieldError(self.path, f"{self.path}: only data URLs (data:image/png;base64,...) are accepted; "
                                        f"nothing is fetched")  # fmt: skip

    def open(self, max_pixels: int):
        """The PIL image of this part's `data:...;base64,...` URL. FieldError naming the part for any other URL
        (`check_url`), bad base64, an image over `max_pixels`, or bytes no decoder reads."""
        self.check_url()
        header, sep, data = self.url.partition(",")
        if not sep or not header.lower().endswith(";base64"):
            raise FieldError(self.path, f"{self.path}: a data URL must carry base64 data (data:image/png;base64,...)")
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as err:
            raise FieldError(self.path, f"{self.path}: the data URL is not valid base64 ({err})") from err
        try:
            return open_image(raw, max_pixels)
        except ValueError as err:
            raise FieldError(self.path, f"{self.path}: {err}") from err
        except Exception as err:
            raise FieldError(self.path, f"{self.path}: cannot decode the image ({type(err).__name__}: {err})") from err


def _image_url(part: dict, path: str) -> ImagePart:
    value = part.get(part["type"])
    if value is None and part["type"] == "image":
        value = part.get("image_url")
    if isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str):
        raise FieldError(path, f'{path}: an image part needs a URL (e.g. {{"url": "data:image/png;base64,..."}})')
    return ImagePart(value, f"{path}.{part['type']}")


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[dict] | None = ""
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None
    # vLLM's field name; some clients send back `reasoning`.
    reasoning_content: Text | None = Field(None, validation_alias=AliasChoices("reasoning_content", "reasoning"))

    @model_validator(mode="after")
    def _calls_on_assistant(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls: only assistant messages carry tool calls, not {self.role} messages")
        return self

    def text(self) -> str:
        """The text of a message; content parts of type "text" are joined (image parts: see `image_parts`)."""
        if isinstance(self.content, list):
            parts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("messages: only text and image content parts are supported")
                parts.append(part["text"])
            return "".join(parts)
        return self.content or ""

    @staticmethod
    def _xtml_part(part: dict) -> dict:
        if part.get("type") in IMAGE_PART_TYPES:
            return {"type": part["type"]}  # the renderer puts the image's prompt here
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError("messages: only text and image content parts are supported")
        return {"type": "text", "text": part["text"]}

    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(p.get("type") in IMAGE_PART_TYPES for p in self.content)

    def xtml(self) -> dict:
        """The message as the XTML renderer takes it (OpenAI's dict; `developer` is a system message). Image parts
        stay parts, in order, for the renderer to put each image's prompt there."""
        content = self.text() if not self.has_images() else [self._xtml_part(p) for p in self.content]
        out = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: Literal[THINKING_EFFORTS] | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None

    @field_validator("tool_choice", mode="wrap")
    @classmethod
    def _one_tool_choice(cls, value, handler):
        # One clear line instead of pydantic's per-branch union errors.
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("tool_choice", 'must be "auto", "none", "required" or {"type": "function", '
                                      '"function": {"name": NAME}}') from None  # fmt: skip

    @model_validator(mode="after")
    def _consistent(self):
        declared = [t.function.name for t in self.tools or []]
        choice = self.tool_choice
        if (choice == "required" or isinstance(choice, NamedToolChoice)) and not declared:
            raise _field_error("tool_choice", "a required or named tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.get("name") not in declared:
            raise _field_error("tool_choice", f"names the function {choice.function.get('name')!r}, which is not "
                                              f"among tools ({', '.join(declared)})")  # fmt: skip
        kwargs_effort = self.chat_template_kwargs and self.chat_template_kwargs.thinking_effort
        if kwargs_effort and self.reasoning_effort and kwargs_effort != self.reasoning_effort:
            raise _field_error("reasoning_effort", f"{self.reasoning_effort!r} contradicts chat_template_kwargs."
                                                   f"thinking_effort {kwargs_effort!r}")  # fmt: skip
        return self

    def image_parts(self) -> list[ImagePart]:
        """Every image content part, in order; FieldError for one in a non-user message or without a URL."""
        images = []
        for i, m in enumerate(self.messages):
            if not m.has_images():
                continue
            for j, part in enumerate(m.content):
                if part.get("type") not in IMAGE_PART_TYPES:
                    continue
                path = f"messages.{i}.content.{j}"
                if m.role != "user":
                    raise FieldError(path, f"{path}: images are accepted in user messages only, not {m.role} ones")
                images.append(_image_url(part, path))
        return images

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def check_format(self, template) -> None:
        """A plain or Jinja chat format has no tool calls, no thinking channel and no response formats: a request
        that uses one is a FieldError naming the field. K3's XTML format (`template.supports_tools`) takes all."""
        if template.supports_tools:
            return
        refused = self._xtml_only()
        if refused is not None:
            param, path, feature = refused
            raise FieldError(param, f"{path}: this checkpoint's chat format ({template.name}) has no {feature}; they "
                                    f"need K3's XTML chat format")  # fmt: skip

    def _xtml_only(self) -> tuple[str, str, str] | None:
        """(param, path, feature) of the first field that only K3's XTML chat format honours, else None."""
        if self.tools:
            return "tools", "tools", "tool calls"
        for i, m in enumerate(self.messages):
            if m.has_images():
                j = next(j for j, p in enumerate(m.content) if p.get("type") in IMAGE_PART_TYPES)
                return f"messages.{i}.content.{j}", f"messages.{i}.content.{j}", "image inputs"
        for i, m in enumerate(self.messages):
            if m.role == "tool" or m.tool_calls:
                return "messages", f"messages.{i}" + (".tool_calls" if m.tool_calls else ".role"), "tool calls"
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format", "response_format", "response formats"
        if self.reasoning_effort is not None:
            return "reasoning_effort", "reasoning_effort", "thinking options"
        if self.chat_template_kwargs is not None and self.chat_template_kwargs.model_fields_set:
            return "chat_template_kwargs", "chat_template_kwargs", "thinking options"
        return None

    def encode(self, template, image_prompts: list[str] | None = None) -> list[int]:
        """The prompt ids. K3's XTML format takes the messages as OpenAI dicts with the request's tools and options
        (and `image_prompts`, one per image part, in order); a plain or Jinja format takes roles and text only
        (after `check_format`)."""
        if template.supports_tools:
            messages = [m.xtml() for m in self.messages]
            options = self.render_options()
            if image_prompts is not None:
                options["image_prompts"] = image_prompts
            return template.encode(messages, add_generation_prompt=True, **options)
        self.check_format(template)
        messages = [Message("system" if m.role == "developer" else m.role, m.text()) for m in self.messages]
        return template.encode(messages, add_generation_prompt=True)

    @property
    def thinking(self) -> bool:
        kwargs = self.chat_template_kwargs
        return True if kwargs is None or kwargs.thinking is None else kwargs.thinking

    def render_options(self) -> dict:
        """The XTML renderer's options for this request; what is not given keeps the template's default (thinking
        on, thinking_effort "max"). A named tool_choice renders as "required" with every tool still declared: the
        release renderer has no named form, and an unchanged declaration keeps prefix-cache hits; the parser then
        accepts only that function (`callable_tools`)."""
        options: dict = {}
        if self.tools:
            options["tools"] = [tool.model_dump(exclude_unset=True) for tool in self.tools]
        if self.tool_choice is not None:
            options["tool_choice"] = "required" if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        if self.response_format is not None and self.response_format.type != "text":
            options["response_format"] = self.response_format.model_dump(exclude_unset=True, by_alias=True)
        kwargs = self.chat_template_kwargs
        if kwargs is not None and kwargs.thinking is not None:
            options["thinking"] = kwargs.thinking
        effort = (kwargs and kwargs.thinking_effort) or self.reasoning_effort
        if effort is not None:
            options["thinking_effort"] = effort
        return options

    def callable_tools(self) -> tuple[str, ...]:
        """The tools the model may call in its answer: none for tool_choice "none", the named one for a named
        choice, else every declared tool. A call to any other is a parser problem; its text stays in content."""
        if self.tool_choice == "none":
            return ()
        if isinstance(self.tool_choice, NamedToolChoice):
            return (self.tool_choice.function["name"],)
        return tuple(tool.function.name for tool in self.tools or [])

    def answer(self, template, stop: list[str]) -> ChatAnswer:
        """A fresh parser of one sample's answer (an XTML template's)."""
        parser = template.parser(thinking=self.thinking, tools=self.callable_tools())
        return ChatAnswer(parser, stop, self.parallel_tool_calls is not False)


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One line naming the field for a pydantic error list: the deepest error (in a union, the branch that got
    furthest), its path without pydantic's type tags, and the top-level field as `param`."""
    if not errors:
        return "body: invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        where = first.get("loc", ("body", "?"))[-1]
        return (f"the body is not valid JSON ({first.get('ctx', {}).get('error', 'decode error')} at character "\
               f"{where})"), None  # fmt: skip
    if first.get("type") in ("unsupported", "request_field"):  # request-level checks that name their field
        field = first["ctx"]["field"]
        return f"{field}: {first['msg']}", field
    err = max(errors, key=lambda e: len(e.get("loc", ())))
    path = [str(p) for p in err.get("loc", ()) if p != "body" and not (isinstance(p, str) and (
        "[" in p or p in _TYPE_TAGS))]  # fmt: skip
    message = err.get("msg", "invalid value").removeprefix("Value error, ")
    return f"{'.'.join(path) or 'body'}: {message}", (path[0] if path else None)


def chat_request(body: dict) -> ChatCompletionRequest:
    """A chat request from Python values (`LLM.chat`), checked as the server checks one: a ValueError that names the
    field, e.g. `tools.0.function.name: Field required`."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as err:
        raise ValueError(validation_message(err.errors())[0]) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: int = 400) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, outputs: list[CompletionOutput], cached: int,
          reasoning_tokens: int | None = None) -> dict:  # fmt: skip
    """OpenAI's usage; `reasoning_tokens` (the think channel's tokens, all samples) when the chat format has one."""
    completion = sum(len(o.token_ids) for o in outputs)
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body


def chat_logprobs(out: CompletionOutput, start: int, end: int, top: int, decode) -> dict | None:
    """OpenAI's chat `logprobs.content` for tokens [start, end) of a sample."""
    if out.logprobs is None:
        return None
    content = []
    for tok, lp in zip(out.token_ids[start:end], out.logprobs[start:end]):
        ranked = sorted(lp.items(), key=lambda kv: -kv[1])[:top]
        text = decode([tok])
        content.append({"token": text, "logprob": lp[tok], "bytes": list(text.encode("utf-8")),
                        "top_logprobs": [{"token": decode([t]), "logprob": v, "bytes": list(decode([t]).encode())}
                                         for t, v in ranked]})  # fmt: skip
    return {"content": content}


def completion_logprobs(out: CompletionOutput, start: int, end: int, top: int, decode) -> dict | None:
    """The legacy completions `logprobs` object for tokens [start, end)."""
    if out.logprobs is None:
        return None
    tokens, token_lps, tops = [], [], []
    for tok, lp in zip(out.token_ids[start:end], out.logprobs[start:end]):
        tokens.append(decode([tok]))
        token_lps.append(lp[tok])
        ranked = sorted(lp.items(), key=lambda kv: -kv[1])[:top]
        tops.append({decode([t]): v for t, v in ranked})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": []}

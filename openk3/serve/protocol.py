"""The OpenAI request and response shapes the server speaks (spec/serving.md §6).

Requests are strict pydantic models (no bool-as-int, no string numbers, finite floats, valid Unicode) that ignore
unknown fields (e.g. `user`), refuse the OpenAI fields not implemented yet (`UNSUPPORTED`: tools, logit_bias, ...)
and reject bad values with a message naming the field; responses are plain dicts in OpenAI's JSON. Engine extras
(`top_k`) arrive as extra body fields, as the openai client's `extra_body` sends them.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from openk3.data.chat import check_text
from openk3.serve.request import CompletionOutput, SamplingParams


def _unicode(value: str) -> str:
    try:
        check_text(value, "text")
    except ValueError as err:
        raise PydanticCustomError("unicode", str(err).removeprefix("text: ")) from None
    return value


# Strings must be valid Unicode (JSON can spell a lone surrogate, "\ud800", which nothing downstream can encode).
Text = Annotated[str, AfterValidator(_unicode)]

# OpenAI fields this server does not implement yet. Sent with a value other than the one meaning "off", each is a
# 400 naming it, never silently ignored (a client asking for tools must not get a plain completion back).
UNSUPPORTED = {
    "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
    "function_call": (None, "none", "auto"), "response_format": (None, {"type": "text"}),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0),
    "suffix": (None, ""), "echo": (None, False), "best_of": (None, 1), "audio": (None,), "modalities": (None, ["text"]),
    "prediction": (None,), "parallel_tool_calls": (None, True, False), "web_search_options": (None,),
    "min_p": (None, 0, 0.0),
}  # fmt: skip


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

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        if isinstance(data, dict):
            for name, off in UNSUPPORTED.items():
                if name in data and not any(data[name] == v and type(data[name]) is type(v) for v in off):
                    raise PydanticCustomError("unsupported", f"{name} is not supported by this server",
                                              {"field": name})  # fmt: skip
        return data

    def sampling(self, max_tokens: int, logprobs: int | None, extra_stop: list[str]) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > 8:
            raise ValueError("stop: at most 8 stop sequences")
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              seed=self.seed, stop=stop + extra_stop, n=self.n, logprobs=logprobs)  # fmt: skip

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Request):
    prompt: Text | list[int] = Field(min_length=1)
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant", "developer"]
    content: Text | list[dict] | None = ""

    def text(self) -> str:
        """The text of a message; content parts of type "text" are joined (images are not served yet)."""
        if isinstance(self.content, list):
            parts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("messages: only text content parts are supported")
                parts.append(part["text"])
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: int = 400) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, outputs: list[CompletionOutput], cached: int) -> dict:
    completion = sum(len(o.token_ids) for o in outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip


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

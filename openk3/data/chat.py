"""Chat formats: turn OpenAI-style messages into prompt token ids, and say where the model's answer stops.

`PlainChatTemplate` is the documented format of openk3 checkpoints whose tokenizers name no XTML markers (the byte
fallback, and BPE tokenizers trained before the markers were named), so its role markers are plain text:

    [BOS]### System:\\n{system}\\n\\n### User:\\n{user}\\n\\n### Assistant:\\n{assistant}[EOS]\\n\\n### User:\\n ...
    ... ### Assistant:\\n                                   <- the generation prompt; the answer ends at [EOS]

Message text is encoded with special tokens disallowed (the tokenizers' `encode`), so a user cannot inject [EOS] or
any other control token by spelling it. `JinjaChatTemplate` renders a checkpoint's own Hugging Face-style template
(`chat_template` in tokenizer_config.json, a string or Hugging Face's named list, or a `chat_template.jinja`
file) in a sandboxed Jinja environment inside a worker process with a time and output limit (`jinja_sandbox.py`).

`XTMLChatTemplate` is K3's own format (`data/xtml.py`, the release's Python renderer, segment for segment): tool
declarations and calls, a `think` channel, `tool_choice` and `response_format`; its `parser()` turns the model's
output back into reasoning, content and tool calls (`data/xtml_parse.py`). It is used for the release's tokenizer
and for every tokenizer openk3 trains (they name K3's special ids, the XTML markers included).

Which format a checkpoint uses: its own Jinja template when it ships one; else `chat_format` in
tokenizer_config.json ("xtml" or "plain"); else XTML when its tokenizer has the XTML markers as special tokens (the
release), plain otherwise (openk3 checkpoints trained before the markers were named).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from openk3.data.jinja_sandbox import SandboxedRenderer, TemplateError, compile_check
from openk3.data.xtml import Segment, encode_xtml, missing_markers, render_xtml, require_markers
from openk3.utils import file_inside, read_json

ROLES = ("system", "user", "assistant")
XTML_ROLES = ("system", "user", "assistant", "tool")
CHAT_FORMATS = ("xtml", "plain")


@dataclass
class Message:
    role: str
    content: str


def check_text(text: str, where: str) -> None:
    """Text must be valid Unicode: a lone surrogate ("\\ud800" in JSON) cannot be encoded or tokenized."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = text[err.start : err.end].encode("unicode_escape").decode("ascii")
        raise ValueError(f"{where}: not valid Unicode text (lone surrogate {bad} at position {err.start})") from None


def check_messages(messages: Sequence[Message]) -> None:
    if not messages:
        raise ValueError("messages must not be empty")
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {list(ROLES)}, got {m.role!r}")
        check_text(m.content, f"messages[{i}].content")


class PlainChatTemplate:
    name = "openk3-plain"
    supports_tools = False
    source = "[BOS]### System:\\n{system}\\n\\n### User:\\n{user}\\n\\n### Assistant:\\n{assistant}[EOS]\\n\\n...### Assistant:\\n"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        check_messages(messages)
        tok = self.tokenizer
        ids = [tok.bos_token_id] if tok.bos_token_id is not None else []
        for m in messages:
            ids += tok.encode(f"### {m.role.capitalize()}:\n{m.content}")
            if m.role == "assistant" and tok.eos_token_id is not None:
                ids.append(tok.eos_token_id)
            ids += tok.encode("\n\n")
        if add_generation_prompt:
            ids += tok.encode("### Assistant:\n")
        return ids

    @property
    def stop(self) -> list[str]:
        """Stop strings besides EOS: a model that forgets EOS still ends its turn before writing the next one."""
        return ["\n### User:", "\n### System:"]

    def close(self) -> None:
        """Nothing to release (a JinjaChatTemplate stops its worker process)."""


class JinjaChatTemplate:
    """A checkpoint's Hugging Face-style template, rendered in a worker process under a time and output limit
    (`data/jinja_sandbox.py`). A syntax error is a TemplateError at construction, naming the line."""

    name = "checkpoint-jinja"
    supports_tools = False

    def __init__(self, tokenizer, source: str, renderer: SandboxedRenderer | None = None, origin: str = "template"):
        self.tokenizer, self.source = tokenizer, source
        try:
            compile_check(source)
        except TemplateError as err:
            raise TemplateError(f"{origin}: {err}") from None
        self.renderer = renderer or SandboxedRenderer()
        self._specials = {f"{name}_token": _special_text(tokenizer, getattr(tokenizer, f"{name}_token_id", None))
                          for name in ("bos", "eos", "pad")}  # fmt: skip

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        check_messages(messages)
        context = {"messages": [{"role": m.role, "content": m.content} for m in messages],
                   "add_generation_prompt": add_generation_prompt, **self._specials}  # fmt: skip
        text = self.renderer.render(self.source, context)
        check_text(text, "the rendered chat template")
        return text

    def encode(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        # The rendered template spells its own markers; encode it as one text (special names stay text).
        return self.tokenizer.encode(self.render(messages, add_generation_prompt))

    @property
    def stop(self) -> list[str]:
        return []

    def close(self) -> None:
        """Stop the template worker process."""
        self.renderer.close()


class XTMLChatTemplate:
    """K3's XTML format. `encode` takes OpenAI-style message dicts (or `Message`s) and the request's options, with
    the release tokenizer's defaults: thinking on, `thinking_effort="max"`."""

    name = "k3-xtml"
    supports_tools = True
    source = "K3 XTML (Python renderer, openk3/data/xtml.py): <|open|>message role=\"...\"<|sep|> ... " \
             "<|close|>message<|sep|><|end_of_msg|>"  # fmt: skip

    def __init__(self, tokenizer):
        require_markers(tokenizer)
        self.tokenizer = tokenizer

    def render(self, messages, add_generation_prompt: bool = True, *, tools: list[dict] | None = None,
               thinking: bool = True, thinking_effort: str | None = "max", **options) -> list[Segment]:  # fmt: skip
        """The release's segments (`render_xtml`). `options`: tool_choice, response_format, response_schema,
        image_prompts."""
        dicts = [{"role": m.role, "content": m.content} if isinstance(m, Message) else m for m in messages]
        if not dicts:
            raise ValueError("messages must not be empty")
        for i, m in enumerate(dicts):
            if not isinstance(m, dict) or m.get("role") not in XTML_ROLES:
                role = m.get("role") if isinstance(m, dict) else m
                raise ValueError(f"messages[{i}].role must be one of {list(XTML_ROLES)}, got {role!r}")
            for key in ("content", "reasoning_content", "name"):
                if isinstance(m.get(key), str):
                    check_text(m[key], f"messages[{i}].{key}")
        return render_xtml(dicts, tools, add_generation_prompt=add_generation_prompt, thinking=thinking,
                           thinking_effort=thinking_effort, **options)  # fmt: skip

    def encode(self, messages, add_generation_prompt: bool = True, **options) -> list[int]:
        return encode_xtml(self.render(messages, add_generation_prompt, **options), self.tokenizer)

    def parser(self, *, thinking: bool = True, tools: Iterable[str] | None = None, tool_call_id=None):
        """A streaming parser of the answer to a prompt encoded with the same `thinking` (the generation prompt
        opened the think channel, or the response channel with thinking off). `tools`: the declared tool names."""
        from openk3.data.xtml_parse import XTMLParser

        return XTMLParser(self.tokenizer, start="think" if thinking else "response", tools=tools,
                          tool_call_id=tool_call_id)  # fmt: skip

    @property
    def stop(self) -> list[str]:
        return []  # the answer ends at <|end_of_msg|>, the model's eos token

    def close(self) -> None:
        """Nothing to release."""


def _special_text(tokenizer, token_id: int | None) -> str:
    """How a special token is spelled (bos_token, eos_token in a template's context); "" where it has no name."""
    if token_id is None:
        return ""
    try:
        return tokenizer.decode([token_id], skip_special_tokens=False)
    except Exception:  # noqa: BLE001 - a tokenizer without names for its specials
        return ""


def _pick_template(value, file: str) -> str | None:
    """tokenizer_config.json's `chat_template`: a string, or Hugging Face's list of {"name", "template"} (the one
    named "default" is the chat template)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        names = sorted(map(str, named))
        raise ValueError(f"{file}: chat_template is a list without a 'default' entry (names: {names})")
    kind = type(value).__name__
    raise ValueError(f"{file}: chat_template must be a string or a list of {{name, template}}, got {kind}")


def load_chat_template(path: str | os.PathLike | None, tokenizer, renderer: SandboxedRenderer | None = None):
    """The checkpoint's own template when it ships one (chat_template.jinja, or tokenizer_config.json
    `chat_template`); else the format tokenizer_config.json's `chat_format` names; else `XTMLChatTemplate` when the
    tokenizer has the XTML markers, `PlainChatTemplate` when not. A broken template is a ValueError naming its
    file."""
    chat_format = None
    if path is not None:
        jinja_file = file_inside(path, "chat_template.jinja", "chat template file")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                return JinjaChatTemplate(tokenizer, f.read(), renderer, origin=jinja_file)
        config_file = file_inside(path, "tokenizer_config.json", "tokenizer file")
        if os.path.isfile(config_file):
            config = read_json(config_file)
            source = _pick_template(config.get("chat_template") if isinstance(config, dict) else None, config_file)
            if source is not None:
                return JinjaChatTemplate(tokenizer, source, renderer, origin=config_file)
            chat_format = config.get("chat_format") if isinstance(config, dict) else None
            if chat_format is not None and chat_format not in CHAT_FORMATS:
                raise ValueError(f"{config_file}: chat_format must be one of {list(CHAT_FORMATS)}, got {chat_format!r}")
    if chat_format is None:
        chat_format = "plain" if missing_markers(tokenizer) else "xtml"
    return XTMLChatTemplate(tokenizer) if chat_format == "xtml" else PlainChatTemplate(tokenizer)

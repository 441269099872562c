"""Chat formats: turn OpenAI-style messages into prompt token ids, and say where the model's answer stops.

`PlainChatTemplate` is the documented format of openk3's own checkpoints (their tokenizers carry only BOS, EOS and
pad as special tokens, so the role markers are plain text):

    [BOS]### System:\\n{system}\\n\\n### User:\\n{user}\\n\\n### Assistant:\\n{assistant}[EOS]\\n\\n### User:\\n ...
    ... ### Assistant:\\n                                   <- the generation prompt; the answer ends at [EOS]

Message text is encoded with special tokens disallowed (the tokenizers' `encode`), so a user cannot inject [EOS] or
any other control token by spelling it. `JinjaChatTemplate` renders a checkpoint's own Hugging Face-style template
(`chat_template` in tokenizer_config.json, a string or Hugging Face's named list, or a `chat_template.jinja`
file) in a sandboxed Jinja environment inside a worker process with a time and output limit (`jinja_sandbox.py`).
`load_chat_template(dir, tokenizer)` picks the checkpoint's template when it ships one, else the plain one.

K3's official conversation format is a Python renderer ("XTML", spec/model.md §14), not a template file; this
module does not reimplement it, since without the released renderer there is nothing to check it against
token for token.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from openk3.data.jinja_sandbox import SandboxedRenderer, TemplateError, compile_check
from openk3.utils import file_inside, read_json

ROLES = ("system", "user", "assistant")


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
    `chat_template`), else `PlainChatTemplate`. A broken template is a ValueError naming its file."""
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
    return PlainChatTemplate(tokenizer)

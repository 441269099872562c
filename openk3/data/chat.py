"""Chat formats: turn OpenAI-style messages into prompt token ids, and say where the model's answer stops.

`PlainChatTemplate` is the documented format of openk3's own checkpoints (their tokenizers carry only BOS, EOS and
pad as special tokens, so the role markers are plain text):

    [BOS]### System:\\n{system}\\n\\n### User:\\n{user}\\n\\n### Assistant:\\n{assistant}[EOS]\\n\\n### User:\\n ...
    ... ### Assistant:\\n                                   <- the generation prompt; the answer ends at [EOS]

Message text is encoded with special tokens disallowed (the tokenizers' `encode`), so a user cannot inject [EOS] or
any other control token by spelling it. `JinjaChatTemplate` renders a checkpoint's own Hugging Face-style template
(`chat_template` in tokenizer_config.json or a `chat_template.jinja` file) in a sandboxed Jinja environment.
`load_chat_template(dir, tokenizer)` picks the checkpoint's template when it ships one, else the plain one.

K3's official conversation format is a Python renderer ("XTML", spec/model.md §14), not a template file; this
module does not reimplement it, since without the released renderer there is nothing to check it against
token for token.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

ROLES = ("system", "user", "assistant")


@dataclass
class Message:
    role: str
    content: str


def check_messages(messages: Sequence[Message]) -> None:
    if not messages:
        raise ValueError("messages must not be empty")
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {list(ROLES)}, got {m.role!r}")


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


class JinjaChatTemplate:
    name = "checkpoint-jinja"

    def __init__(self, tokenizer, source: str):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.tokenizer, self.source = tokenizer, source
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(source)

    def encode(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        check_messages(messages)
        text = self._template.render(
            messages=[{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=add_generation_prompt,
        )
        # The rendered template spells its own markers; encode it as one text (special names stay text).
        return self.tokenizer.encode(text)

    @property
    def stop(self) -> list[str]:
        return []


def load_chat_template(path: str | os.PathLike | None, tokenizer):
    """The checkpoint's own template when it ships one (tokenizer_config.json `chat_template`, or
    chat_template.jinja), else `PlainChatTemplate`."""
    if path is not None:
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                return JinjaChatTemplate(tokenizer, f.read())
        config_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(config_file):
            with open(config_file, encoding="utf-8") as f:
                source = json.load(f).get("chat_template")
            if isinstance(source, str):
                return JinjaChatTemplate(tokenizer, source)
    return PlainChatTemplate(tokenizer)

"""One sample's chat answer in K3's XTML format: output ids in, OpenAI chat deltas and the assistant message out.

The server (streamed and not), `LLM.chat` and `k3 chat` all read answers through `ChatAnswer`, so they agree.
"""

from __future__ import annotations

import logging

from openk3.data.xtml_parse import assistant_message

log = logging.getLogger("openk3.serve")


class ChatAnswer:
    """One sample's answer in K3's XTML format: output ids in, OpenAI chat deltas and the assistant message out.

    Wraps the template's streaming parser (data/xtml_parse.py) with what the request adds:
    - user stop strings: the engine ended the sample at one (it searches the decoded text, markers skipped), so
      `reasoning_content` and `content` are each cut at the first occurrence; while the sample runs, the last
      (longest stop - 1) characters of each are held back, as TextDelta does, so a stream never sends text that a
      stop string takes back;
    - `parallel_tool_calls: false`: only the first call is kept (the model is not told; later calls are dropped).
    Concatenating the deltas gives `message()`, field by field.
    """

    CHANNELS = ("reasoning_content", "content")

    def __init__(self, parser, stop: list[str], parallel_tool_calls: bool = True):
        self.parser, self.stop, self.parallel = parser, list(stop), parallel_tool_calls
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = dict.fromkeys(self.CHANNELS, "")
        self.sent = dict.fromkeys(self.CHANNELS, 0)
        self.fed, self.finished = 0, False

    def update(self, token_ids: list[int], finished: bool) -> list[dict]:
        """The deltas that the sample's output ids so far add (only the ids not seen before are parsed)."""
        deltas = self.parser.feed(token_ids[self.fed :])
        self.fed = len(token_ids)
        if finished and not self.finished:
            deltas += self.parser.finish()
            self.finished = True
        out: list[dict] = []
        for delta in deltas:
            if "tool_calls" not in delta:
                for key, text in delta.items():
                    self.text[key] += text
            elif self.parallel or delta["tool_calls"][0]["index"] == 0:
                out += self._flush()  # keep the text that came before the call ahead of it
                out.append(delta)
        return out + self._flush()

    def _flush(self) -> list[dict]:
        out = []
        for key in self.CHANNELS:
            text, sent = self.text[key], self.sent[key]
            end = max(self._cut(text), sent) if self.finished else len(text) - self.hold
            if end > sent:
                out.append({key: text[sent:end]})
                self.sent[key] = end
        return out

    def _cut(self, text: str) -> int:
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(found, default=len(text))

    def message(self) -> dict:
        """The OpenAI assistant message (after the last update): `content` None only beside tool calls,
        `reasoning_content` None when there was none, no empty `tool_calls`."""
        calls = self.result.tool_calls if self.parallel else self.result.tool_calls[:1]
        content, reasoning = (self.text[k][: self.sent[k]] for k in ("content", "reasoning_content"))
        return assistant_message(content, reasoning, calls)

    @property
    def result(self):
        return self.parser.result()

    @property
    def problems(self) -> list[str]:
        dropped = 0 if self.parallel else max(len(self.result.tool_calls) - 1, 0)
        extra = [f"{dropped} tool calls dropped (parallel_tool_calls is false)"] if dropped else []
        return self.result.problems + extra

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the sample ended normally with calls."""
        return "tool_calls" if engine_reason == "stop" and self.message().get("tool_calls") else engine_reason

    def report(self, label: str, output) -> None:
        """Log what the parser found malformed in a finished sample (`output`: its CompletionOutput): a warning when
        the model ended its message, info when the sample was cut short (max_tokens, a stop string, an abort), where
        an unclosed element is expected."""
        if self.problems:
            ended = output.finish_reason == "stop" and not isinstance(output.stop_reason, str)  # a stop token
            log.log(logging.WARNING if ended else logging.INFO, "%s: %s", label, "; ".join(self.problems))

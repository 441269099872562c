"""Incremental text for streaming: which part of a sample's text is safe to send now.

A stream must never send text it later takes back. Two things can make the latest decoded text unsafe:
- a partial UTF-8 sequence: byte-level tokens can split a character, which decodes to U+FFFD until the rest
  arrives, so trailing U+FFFD characters are held back;
- a stop string still being completed: the final text is cut before the stop string, so while a sample runs, the
  last (longest stop string - 1) characters are held back.
When the sample finishes, whatever is left of its final text goes out.
"""

from __future__ import annotations


class TextDelta:
    def __init__(self, stop: list[str] | None = None):
        self.hold = max((len(s) for s in stop or []), default=1) - 1
        self.sent = 0

    def update(self, text: str, finished: bool) -> str:
        """The new text to send, given the sample's full text so far."""
        if finished:
            safe = len(text)
        else:
            safe = len(text) - self.hold
            while safe > self.sent and text[safe - 1] == "\ufffd":
                safe -= 1
        if safe <= self.sent:
            return ""
        delta, self.sent = text[self.sent : safe], safe
        return delta


class TextStream:
    """One sample's text chunks (completions, and chat in a plain or Jinja format): the text that no stop string can
    take back, with the log-probs of the tokens since the last chunk; the last chunk carries the finish reason.
    `chunk(output, text, start, end, finish)` makes a chunk body; `opening` goes out before the first."""

    def __init__(self, stop: list[str], chunk, opening: dict | None = None):
        self.delta, self.chunk, self.sent = TextDelta(stop), chunk, 0
        self.pending = [opening] if opening is not None else []

    def __call__(self, o) -> list[dict]:
        bodies, self.pending = self.pending, []
        done = o.finish_reason is not None
        text = self.delta.update(o.text, done)
        if text or done:
            bodies.append(self.chunk(o, text, self.sent, len(o.token_ids), o.finish_reason if done else None))
            self.sent = len(o.token_ids)
        return bodies

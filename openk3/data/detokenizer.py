"""Incremental detokenization: one sample's output text, grown token by token instead of re-decoded each step. The
engine keeps one per sample; the XTML output parser (data/xtml_parse.py) one per text run between markers.

The prefix/read-offset scheme (HF text-generation-inference, vLLM): the text of ids[:read] is final; a new token
decodes the short window ids[prefix:] and the new text is what it adds to the window's own decode of
ids[prefix:read]. While the window ends in U+FFFD the token may be the first bytes of a character split across
tokens, so nothing is committed: the window's extra text is `pending` (searched for stop strings, shown only once
the sample finishes) until a later token completes it. Only `decode` is used, so any tokenizer works; for the
byte-level tokenizers (bytes, our BPE, tiktoken) a window that ends in a whole character ends on a UTF-8 boundary,
hence `text + pending` is exactly `tokenizer.decode(all ids)` at every step (tests/serve/test_detokenizer.py).

Stop strings are searched only where a new occurrence can be: the text added since the last token, plus the last
(longest stop - 1) characters before it, so a step costs the window and the stops, not the whole output.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = stop or []
        self.overlap = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # committed: never revised
        self.pending = ""  # the window's text past `text`; may end in a partial character and change
        self.window: list[int] = []  # ids[prefix:]
        self.read = 0  # ids[prefix : prefix + read] are committed
        self.prefix_text = ""  # decode(ids[prefix : prefix + read])
        self.searched = 0  # len(text) before the last token: what find_stop has already searched
        self.stop_index: int | None = None  # where the text is cut when a stop string ended the sample

    def append(self, token: int) -> None:
        """Add one token."""
        self.searched = len(self.text)
        self.window.append(token)
        window_text = self.tokenizer.decode(self.window)
        new = window_text[len(self.prefix_text) :]
        if window_text.endswith("\ufffd"):
            self.pending = new
        else:
            self.text += new
            self.pending = ""
            self.window = self.window[self.read :]
            self.read = len(self.window)
            self.prefix_text = self.tokenizer.decode(self.window)

    def take(self) -> str:
        """The text committed since the last `take`, handed over and dropped here. For a caller that keeps the text
        itself and uses no stop strings (the XTML parser): `text` then stays short, where growing it by `+=` on an
        attribute would copy the whole output at every token."""
        new, self.text = self.text, ""
        return new

    def find_stop(self) -> str | None:
        """The stop string the last token completed (the first of `stop` in list order), else None; the output is
        then cut before its first occurrence. Call after every `append` (the search assumes the text up to the
        previous token held no stop string)."""
        # An occurrence that starts before `searched - overlap` lies in text already searched at the previous token.
        start = max(0, self.searched - self.overlap)
        region = self.text[start:] + self.pending
        for s in self.stop:
            at = region.find(s)
            if at >= 0:
                self.stop_index = start + at
                return s
        return None

    def output(self, finished: bool) -> str:
        """The text to report: the committed text while running; once finished the whole decode, cut before the
        stop string that ended it."""
        if not finished:
            return self.text
        text = self.text + self.pending
        return text if self.stop_index is None else text[: self.stop_index]

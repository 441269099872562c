"""Byte-level tokenizer: the fallback that needs no files. Token id = byte value (0..255); the model's special ids
(bos/eos/pad) sit above 255 and decode to nothing. Any K3 config with vocab_size >= 256 can use it.
"""

from __future__ import annotations


class ByteTokenizer:
    def __init__(self, vocab_size: int, bos_token_id: int | None = None, eos_token_id: int | None = None):
        if vocab_size < 256:
            raise ValueError(f"a byte-level tokenizer needs vocab_size >= 256, the model has {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos and self.bos_token_id is not None else ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

"""Our three tokenizers as a GGUF byte-level BPE vocabulary (`tokenizer.ggml.model = "gpt2"`), the form llama.cpp's
BPE tokenizer loads (src/llama-vocab.cpp): one token string per id in GPT-2's byte-to-unicode alphabet, a type per
token, the merges as "left right" strings in rank order, and a pre-tokenizer name (`tokenizer.ggml.pre`) that selects
llama.cpp's split regex.

- `ByteTokenizer` (ids 0-255 are bytes): the 256 byte symbols and no real merge, pre "gpt-2" (with no merge every
  piece falls apart into its bytes whatever the split). gguf-py writes no empty array and llama.cpp refuses a `gpt2`
  vocabulary without merges, so one merge that can never fire is written: its left side is two symbols, and with no
  other merge no symbol is ever longer than one.
- `BPETokenizer` (HF `tokenizers`, trained by `k3 train`): vocabulary, merges and added tokens from its
  `tokenizer.json`. Its `ByteLevel` pre-tokenizer splits with GPT-2's regex, which is llama.cpp's "gpt-2" pattern;
  with `Digits(individual_digits=True)` in front (rl/sft.py) it first cuts every `\\p{N}` alone, which is llama.cpp's
  "starcoder" (`\\p{N}`, then the GPT-2 regex). Base ids no merge can reach (`<|unused_base_*|>` fillers) are UNUSED.
- `TikTokenTokenizer` (the release): token bytes by rank, merges recovered by running byte-pair merging on each token
  restricted to lower ranks (the two parts left are its merge), pre "kimi-k2" (llama.cpp's hand-written splitter of
  Kimi's pattern; a different pattern is warned about).

Specials (the 256 ids on top, and bos/eos/pad) are CONTROL; ids no tokenizer defines up to the model's embedding rows
are UNUSED `[PAD{id}]`, as llama.cpp's own converter pads.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from openk3.data.tokenizer import (
    K3_ROLE_OFFSETS,
    K3_SPECIAL_NAMES,
    NUM_SPECIAL_TOKENS,
    BPETokenizer,
    ByteTokenizer,
    TikTokenTokenizer,
)

log = logging.getLogger("openk3")

# llama.cpp's token types (gguf.TokenType).
NORMAL, USER_DEFINED, CONTROL, UNUSED = 1, 4, 3, 5

# Kimi's tiktoken split pattern (tokenization_kimi.py), which llama.cpp's "kimi-k2" pre-tokenizer implements by hand.
KIMI_PATTERN = (
    r"[\p{Han}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)


class GGUFVocabError(ValueError):
    """The tokenizer has a feature llama.cpp's BPE tokenizer cannot reproduce."""


@dataclass
class GGUFVocab:
    pre: str  # tokenizer.ggml.pre
    tokens: list[str]  # one per id, byte-level strings
    token_types: list[int]
    merges: list[str]  # "left right", rank order


def byte_symbols() -> list[str]:
    """GPT-2's byte -> printable character map, indexed by byte: printable Latin-1 bytes map to themselves, the
    other 68 to chr(256 + n) in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def _as_symbols(token: bytes, table: list[str]) -> str:
    return "".join(table[b] for b in token)


def _role_name(role: str, i: int, vocab_size: int) -> str:
    """K3's name for a bos/eos/pad id at its K3 offset from the special base, else <|role|> (train_bpe's rule)."""
    offset = i - (vocab_size - NUM_SPECIAL_TOKENS)
    return K3_SPECIAL_NAMES[offset] if K3_ROLE_OFFSETS[role] == offset else f"<|{role}|>"


def _byte_vocab(tokenizer: ByteTokenizer, vocab_size: int) -> GGUFVocab:
    table = byte_symbols()
    tokens, types = list(table), [NORMAL] * 256
    roles = {tokenizer.bos_token_id: "bos", tokenizer.eos_token_id: "eos", tokenizer.pad_token_id: "pad"}
    for i in range(256, tokenizer.vocab_size):
        if i in roles:
            tokens.append(_role_name(roles[i], i, vocab_size))
            types.append(CONTROL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
    never = f"{table[0]}{table[0]} {table[0]}"  # left side two symbols long: never adjacent symbols
    return GGUFVocab("gpt-2", tokens, types, [never])


def _is_byte_level(pre: dict) -> bool:
    return pre.get("type") == "ByteLevel" and not pre.get("add_prefix_space", False) and pre.get("use_regex", True)


def _bpe_pre(pre: dict | None) -> str:
    if pre is not None and _is_byte_level(pre):
        return "gpt-2"
    if pre is not None and pre.get("type") == "Sequence":
        parts = pre.get("pretokenizers", [])
        if (len(parts) == 2 and parts[0].get("type") == "Digits" and parts[0].get("individual_digits")
                and _is_byte_level(parts[1])):  # fmt: skip
            return "starcoder"
    raise GGUFVocabError(
        f"tokenizer.json: pre-tokenizer {json.dumps(pre)[:200]} has no llama.cpp equivalent (supported: ByteLevel "
        f"without prefix space -> 'gpt-2'; Sequence[Digits(individual_digits), ByteLevel] -> 'starcoder')"
    )


def _bpe_vocab(tokenizer: BPETokenizer) -> GGUFVocab:
    # The HF tokenizer object is the only holder of the trained vocabulary and merges.
    data = json.loads(tokenizer._tok.to_str())
    model = data["model"]
    unsupported = {k: model.get(k) for k in ("dropout", "continuing_subword_prefix", "end_of_word_suffix")}
    unsupported = {k: v for k, v in unsupported.items() if v}
    if model.get("type") != "BPE" or model.get("byte_fallback") or model.get("ignore_merges") or unsupported:
        raise GGUFVocabError(f"tokenizer.json: only a plain byte-level BPE model exports to GGUF, got type "
                             f"{model.get('type')!r} with {unsupported or 'byte_fallback/ignore_merges'}")  # fmt: skip
    if data.get("normalizer") is not None:
        kind = data["normalizer"].get("type")
        raise GGUFVocabError(f"tokenizer.json: normalizer {kind!r} has no llama.cpp equivalent")
    pre = _bpe_pre(data.get("pre_tokenizer"))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    produced = {m.replace(" ", "", 1) for m in merges}  # byte-level symbols hold no literal space
    by_id: dict[int, tuple[str, int]] = {}
    for text, i in model["vocab"].items():
        by_id[i] = (text, NORMAL if len(text) == 1 or text in produced else UNUSED)
    for added in data.get("added_tokens", []):
        by_id[added["id"]] = (added["content"], CONTROL if added.get("special") else USER_DEFINED)
    n = tokenizer.vocab_size
    if sorted(by_id) != list(range(n)):
        raise GGUFVocabError(f"tokenizer.json: ids must be exactly 0..{n - 1}")
    return GGUFVocab(pre, [by_id[i][0] for i in range(n)], [by_id[i][1] for i in range(n)], merges)


def _bpe_parts(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """Byte-pair merging of `token` with the merges of rank < max_rank, lowest rank first."""
    parts = [bytes([b]) for b in token]
    while True:
        best, best_rank = -1, max_rank
        for j in range(len(parts) - 1):
            rank = ranks.get(parts[j] + parts[j + 1])
            if rank is not None and rank < best_rank:
                best, best_rank = j, rank
        if best < 0:
            return parts
        parts[best : best + 2] = [parts[best] + parts[best + 1]]


def _tiktoken_vocab(tokenizer: TikTokenTokenizer) -> GGUFVocab:
    if tokenizer.pattern != KIMI_PATTERN:
        log.warning("GGUF export: this tiktoken split pattern is not Kimi's; llama.cpp's 'kimi-k2' pre-tokenizer "
                    "implements Kimi's, so llama.cpp may cut text into different tokens than openk3")  # fmt: skip
    table = byte_symbols()
    enc = tokenizer._enc  # the token bytes by rank live only in the tiktoken encoding
    by_rank = [enc.decode_single_token_bytes(i) for i in range(tokenizer.num_base_tokens)]
    ranks = {token: rank for rank, token in enumerate(by_rank)}
    merges = []
    for rank, token in enumerate(by_rank):
        if len(token) > 1:
            parts = _bpe_parts(ranks, token, rank)
            if len(parts) == 2:
                merges.append(f"{_as_symbols(parts[0], table)} {_as_symbols(parts[1], table)}")
    tokens = [_as_symbols(t, table) for t in by_rank]
    types = [NORMAL] * len(tokens)
    for i in range(tokenizer.num_base_tokens, tokenizer.vocab_size):
        tokens.append(tokenizer.special_names[i])
        types.append(CONTROL)
    return GGUFVocab("kimi-k2", tokens, types, merges)


def gguf_vocab(tokenizer, vocab_size: int) -> GGUFVocab:
    """The GGUF vocabulary of `tokenizer` for a model with `vocab_size` embedding rows (ids beyond the tokenizer's are
    UNUSED fillers)."""
    if isinstance(tokenizer, ByteTokenizer):
        vocab = _byte_vocab(tokenizer, vocab_size)
    elif isinstance(tokenizer, BPETokenizer):
        vocab = _bpe_vocab(tokenizer)
    elif isinstance(tokenizer, TikTokenTokenizer):
        vocab = _tiktoken_vocab(tokenizer)
    else:
        raise GGUFVocabError(f"no GGUF vocabulary for a {type(tokenizer).__name__}")
    if len(vocab.tokens) > vocab_size:
        raise GGUFVocabError(f"the tokenizer has {len(vocab.tokens)} ids, the model only {vocab_size} embedding rows")
    for i in range(len(vocab.tokens), vocab_size):
        vocab.tokens.append(f"[PAD{i}]")
        vocab.token_types.append(UNUSED)
    seen: dict[str, int] = {}
    for i, text in enumerate(vocab.tokens):
        if text in seen:  # llama.cpp maps text -> id and asserts the map has one entry per id
            raise GGUFVocabError(f"token text {text!r} is used by ids {seen[text]} and {i}")
        seen[text] = i
    return vocab

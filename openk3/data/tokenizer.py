"""Tokenizers: the byte-level fallback, our trained byte-level BPE, and the official tiktoken-format K3 tokenizer.

All three share one small surface that the trainer, `generate` and the server use:
`encode(text, add_bos=False) -> list[int]`, `encode_batch(texts) -> list[list[int]]`,
`decode(ids, skip_special_tokens=True) -> str`, `save(dir)` (so a checkpoint carries its tokenizer), the attributes
`vocab_size`, `bos_token_id`, `eos_token_id`, `pad_token_id`, and `fingerprint` (a content hash keying token caches).

Vocabulary layout (K3's): the base ranks fill ids [0, vocab_size - 256) and the 256 special ids sit on top: bos = base +
0, eos = base + 2, pad = vocab_size - 1; unnamed specials render as `<|reserved_token_{id}|>`. User text is always
encoded with special tokens disallowed (`encode_ordinary` semantics), so text that spells a special token's name is
encoded as plain text and cannot inject control tokens.

`load_tokenizer(path, text_config)` picks, in order: `tokenizer.json` (our BPE) -> `tiktoken.model` (official format)
-> `ByteTokenizer`, and checks the ids against the model config. The files must resolve inside `path` (no symlink
leading out), and an unreadable one is a ValueError naming it.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator

from openk3.utils import file_inside, read_json

NUM_SPECIAL_TOKENS = 256
# K3's named special ids, as offsets from the first special id (the released tokenizer config's added_tokens_decoder:
# 163584 [BOS], 163585 [EOS], 163586 <|end_of_msg|> (the model's eos_token_id: a turn ends there), 163587-163589 the
# XTML markers, 163602-163605 the media tokens, 163838 [UNK], 163839 [PAD]). Our BPE tokenizers name the same offsets,
# so a model trained here speaks the release's chat format (data/xtml.py).
K3_SPECIAL_NAMES = {
    0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>",
    18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>",
    254: "[UNK]", 255: "[PAD]",
}  # fmt: skip
# The config roles whose K3 offsets name them; a role placed elsewhere is named <|role|>.
K3_ROLE_OFFSETS = {"bos": 0, "eos": 2, "pad": 255}
# K3's workaround for a tiktoken limit: encode in 400,000-character windows and cut any run of whitespace or of
# non-whitespace longer than 25,000 characters. It changes token boundaries, so we must do the same to match ids.
TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACES_CHARS = 25_000


class ByteTokenizer:
    """Token id = byte value (0..255); the model's special ids (bos/eos/pad) sit above 255 and decode to nothing. Any
    K3 config with vocab_size >= 256 can use it."""

    def __init__(
        self, vocab_size: int, bos_token_id: int | None = None, eos_token_id: int | None = None,
        pad_token_id: int | None = None,
    ):  # fmt: skip
        if vocab_size < 256:
            raise ValueError(f"a byte-level tokenizer needs vocab_size >= 256, the model has {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_token_id, self.eos_token_id, self.pad_token_id = bos_token_id, eos_token_id, pad_token_id
        self.fingerprint = f"byte:{vocab_size}:{bos_token_id}:{eos_token_id}:{pad_token_id}"
        self.special_ids: dict[str, int] = {}  # no names: its specials cannot be spelled

    def encode_special(self, text: str) -> list[int]:
        return self.encode(text)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos and self.bos_token_id is not None else ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def save(self, path: str | os.PathLike) -> None:
        """Nothing to write: `load_tokenizer` falls back to bytes when a folder holds no tokenizer files."""


def _specials_pattern(special_ids: dict[str, int]) -> re.Pattern | None:
    """A regex matching any special name, longest first (so one name that prefixes another cannot win)."""
    names = sorted(special_ids, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, names))) if names else None


def _encode_with_specials(text: str, pattern: re.Pattern | None, special_ids: dict[str, int], encode) -> list[int]:
    ids, start = [], 0
    for m in pattern.finditer(text) if pattern is not None else ():
        ids += encode(text[start : m.start()]) if m.start() > start else []
        ids.append(special_ids[m.group()])
        start = m.end()
    return ids + (encode(text[start:]) if start < len(text) else [])


def _special_names(vocab_size: int, named: dict[int, str]) -> dict[int, str]:
    """id -> name for the 256 ids on top of the vocabulary; unnamed ones get K3's `<|reserved_token_{id}|>`."""
    base = vocab_size - NUM_SPECIAL_TOKENS
    return {i: named.get(i, f"<|reserved_token_{i}|>") for i in range(base, vocab_size)}


class BPETokenizer:
    """Our byte-level BPE (HF `tokenizers`), trained by `train_bpe` and saved as `tokenizer.json` next to the model.
    `tokenizer_config.json` records which special names are bos/eos/pad."""

    def __init__(self, tokenizer, bos_token: str | None = None, eos_token: str | None = None,
                 pad_token: str | None = None):  # fmt: skip
        self._tok = tokenizer
        # Not serialised by `tokenizers`, so set on every construction: user text never yields special ids.
        self._tok.encode_special_tokens = True
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.num_base_tokens = tokenizer.get_vocab_size(with_added_tokens=False)
        # A role's name: the one given (tokenizer_config.json's), else K3's, else the <|role|> of older openk3 BPEs.
        names = {}
        for role, given in (("bos", bos_token), ("eos", eos_token), ("pad", pad_token)):
            k3 = K3_SPECIAL_NAMES[K3_ROLE_OFFSETS[role]]
            names[role] = given or (k3 if tokenizer.token_to_id(k3) is not None else f"<|{role}|>")
        self.bos_token_id = tokenizer.token_to_id(names["bos"])
        self.eos_token_id = tokenizer.token_to_id(names["eos"])
        self.pad_token_id = tokenizer.token_to_id(names["pad"])
        self._tokens = {f"{role}_token": name for role, name in names.items()}
        self.fingerprint = "bpe:" + hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest()
        self.special_ids = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self._special_re = _specials_pattern(self.special_ids)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        # encode_batch of one text: the same ids as encode, but it releases the GIL (encode holds it for seconds on
        # a long text, freezing every other thread, e.g. a server's event loop).
        ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        return [self.bos_token_id, *ids] if add_bos else ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode_special(self, text: str) -> list[int]:
        """Control text (a chat format's markers): special names become their ids, the text between them is
        encoded as `encode` does. Never call it on user text."""
        return _encode_with_specials(text, self._special_re, self.special_ids, self.encode)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, path: str | os.PathLike) -> None:
        """Write `tokenizer.json` and a small `tokenizer_config.json` (special names and ids, and the chat format:
        "xtml" when the XTML markers are named, else "plain") into `path`."""
        os.makedirs(path, exist_ok=True)
        self._tok.save(os.path.join(path, "tokenizer.json"))
        from openk3.data.xtml import missing_markers  # xtml.py is the one place that knows the markers

        xtml = not missing_markers(self)
        meta = {
            "tokenizer_class": "BPETokenizer", "num_base_tokens": self.num_base_tokens, "vocab_size": self.vocab_size,
            **self._tokens, "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id, "chat_format": "xtml" if xtml else "plain",
        }  # fmt: skip
        with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> BPETokenizer:
        from tokenizers import Tokenizer

        file = file_inside(path, "tokenizer.json", "tokenizer file")
        try:
            tok = Tokenizer.from_file(file)
        except Exception as err:  # `tokenizers` raises a bare Exception for a malformed file
            raise ValueError(f"{file}: not a readable tokenizers file ({err})") from err
        meta = _read_config(path)
        names = {k: meta[k] for k in ("bos_token", "eos_token", "pad_token") if isinstance(meta.get(k), str)}
        return cls(tok, **names)


def train_bpe(
    texts: Iterable[str], vocab_size: int, special_ids: dict[str, int], split_digits: bool = False
) -> BPETokenizer:
    """Train a byte-level BPE whose base ranks fill [0, vocab_size - 256) and whose 256 specials sit on top.

    `special_ids` maps a role to its id, e.g. `{"bos": 768, "eos": 770, "pad": 1023}` (take them from the model
    config). The specials are named as K3's (`K3_SPECIAL_NAMES`: `[BOS]`, `<|end_of_msg|>` for eos, the XTML markers,
    the media tokens, `[PAD]`), so the tokenizer speaks the release's chat format; a role placed off its K3 offset is
    named `<|role|>`, every other top id `<|reserved_token_{id}|>`. The trainer learns merges up to the base size; if
    the corpus is too small to fill it, the remaining base ids become unreachable placeholders `<|unused_base_{id}|>`
    so that the special ids still land exactly where the config says. `split_digits`: every digit its own token.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    base = vocab_size - NUM_SPECIAL_TOKENS
    if base < 256:
        raise ValueError(f"vocab_size {vocab_size} leaves {base} base ranks; a byte-level BPE needs at least 256")
    for role, i in special_ids.items():
        if not base <= i < vocab_size:
            raise ValueError(f"special_ids[{role!r}] = {i} is outside the special range [{base}, {vocab_size})")
    if len(set(special_ids.values())) != len(special_ids):
        raise ValueError(f"special_ids assigns one id twice: {special_ids}")
    for role in ("bos", "eos", "pad"):
        if role not in special_ids:
            raise ValueError(f"special_ids needs a {role!r} id, got {sorted(special_ids)}")
    named = {base + offset: name for offset, name in K3_SPECIAL_NAMES.items()}
    roles = {}
    for role, i in special_ids.items():
        if i - base == K3_ROLE_OFFSETS.get(role):
            roles[role] = named[i]
        elif i - base in K3_SPECIAL_NAMES:
            raise ValueError(f"special_ids[{role!r}] = {i} is K3's {named[i]} (base + {i - base}); put {role} at base "
                             f"+ {K3_ROLE_OFFSETS.get(role, 'a free offset')}")  # fmt: skip
        else:
            named[i] = roles[role] = f"<|{role}|>"

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split_digits:  # one token per digit: a number reads the same wherever it stands (prompt, code, tool output)
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), tok.pre_tokenizer])
    tok.decoder = decoders.ByteLevel()
    # The full 256-byte alphabet makes every string encodable, whatever bytes the training corpus happened to hold.
    trainer = trainers.BpeTrainer(
        vocab_size=base, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False, special_tokens=[]
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() < base:
        tok = _pad_base_vocab(tok, base)
    names = _special_names(vocab_size, named)
    # Added tokens take consecutive ids after the base vocabulary, so adding them in id order places each exactly.
    tok.add_special_tokens([names[i] for i in range(base, vocab_size)])
    out = BPETokenizer(tok, **{f"{role}_token": roles[role] for role in ("bos", "eos", "pad")})
    assert out.vocab_size == vocab_size and all(tok.token_to_id(n) == i for i, n in named.items())
    return out


def _pad_base_vocab(tok, base: int):
    from tokenizers import Tokenizer

    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for i in range(len(vocab), base):
        vocab[f"<|unused_base_{i}|>"] = i  # no merge produces it, so the BPE never emits it
    return Tokenizer.from_str(json.dumps(data))


def split_long_text(text: str, max_run: int = MAX_NO_WHITESPACES_CHARS) -> Iterator[str]:
    """K3's long-input splitting: 400,000-character windows, each cut so that no piece holds a run of whitespace or of
    non-whitespace longer than `max_run` characters (a run is cut every `max_run` characters from its start).
    Equivalent to the released per-character loop, found with a regex instead (`\\s` is `str.isspace` in `re`)."""
    n = max_run + 1
    long_run = re.compile(rf"\s{{{n},}}|\S{{{n},}}")
    for w in range(0, max(len(text), 1), TIKTOKEN_MAX_ENCODE_CHARS):
        window = text[w : w + TIKTOKEN_MAX_ENCODE_CHARS]
        start = 0
        if len(window) > max_run:
            for m in long_run.finditer(window):
                for cut in range(m.start() + max_run, m.end(), max_run):
                    yield window[start:cut]
                    start = cut
        yield window[start:]


class TikTokenTokenizer:
    """The official K3 tokenizer: `tiktoken.model` (one `base64(token) rank` per line), 256 specials on top named by
    `tokenizer_config.json`'s `added_tokens_decoder`, and Kimi's split pattern read from the local files."""

    def __init__(
        self, mergeable_ranks: dict[bytes, int], special_names: dict[int, str], pattern: str,
        bos_token_id: int | None, eos_token_id: int | None, pad_token_id: int | None, fingerprint: str,
    ):  # fmt: skip
        import tiktoken

        self.num_base_tokens = len(mergeable_ranks)
        self.vocab_size = self.num_base_tokens + NUM_SPECIAL_TOKENS
        self.special_names = special_names
        self._enc = tiktoken.Encoding(
            "openk3", pat_str=pattern, mergeable_ranks=mergeable_ranks,
            special_tokens={name: i for i, name in special_names.items()},
        )  # fmt: skip
        self.bos_token_id, self.eos_token_id, self.pad_token_id = bos_token_id, eos_token_id, pad_token_id
        self.special_ids = {name: i for i, name in special_names.items()}
        self.fingerprint = fingerprint
        self.pattern = pattern
        # Set by from_dir, for save(): where the official files are, their config, and whether pattern= was given.
        self.source_dir: str | None = None
        self.config: dict = {}
        self.explicit_pattern = False

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = [i for piece in split_long_text(text) for i in self._enc.encode_ordinary(piece)]
        return [self.bos_token_id, *ids] if add_bos else ids

    def encode_special(self, text: str) -> list[int]:
        """Control text (a chat format's markers), as the release encodes it: `allowed_special="all"` on each piece
        of the long-input split. Never call it on user text."""
        return [i for piece in split_long_text(text) for i in self._enc.encode(piece, allowed_special="all")]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # Texts too short to need splitting go through tiktoken's threaded batch encoder.
        short = [i for i, t in enumerate(texts) if len(t) <= MAX_NO_WHITESPACES_CHARS]
        out: list[list[int]] = [[] for _ in texts]
        for i, ids in zip(short, self._enc.encode_ordinary_batch([texts[i] for i in short])):
            out[i] = ids
        for i in set(range(len(texts))) - set(short):
            out[i] = self.encode(texts[i])
        return out

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        if skip_special_tokens:
            ids = [i for i in ids if i < self.num_base_tokens]
        return self._enc.decode(ids)

    def save(self, path: str | os.PathLike) -> None:
        """Copy the official files this tokenizer came from (`tiktoken.model`, `tokenizer_config.json`,
        `tokenization_kimi.py`) into `path`, so a checkpoint carries its tokenizer. A pattern given as `pattern=`
        is recorded as `pat_str` in `tokenizer_config.json`, so the copy loads without it."""
        os.makedirs(path, exist_ok=True)
        for name in ("tiktoken.model", "tokenization_kimi.py"):
            src, dst = os.path.join(self.source_dir, name), os.path.join(path, name)
            if os.path.exists(src) and not (os.path.exists(dst) and os.path.samefile(src, dst)):
                shutil.copyfile(src, dst)
        config = {**self.config, "pat_str": self.pattern} if self.explicit_pattern else self.config
        if config:
            with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
                json.dump(config, f, indent=2, ensure_ascii=False)

    @classmethod
    def from_dir(cls, path: str | os.PathLike, pattern: str | None = None) -> TikTokenTokenizer:
        explicit = pattern is not None
        model_file = file_inside(path, "tiktoken.model", "tokenizer file")
        ranks = _read_tiktoken_model(model_file)
        config_file = os.path.join(path, "tokenizer_config.json")
        config = _read_config(path)
        decoder = config.get("added_tokens_decoder", {})
        if not isinstance(decoder, dict):
            raise ValueError(f"{config_file}: added_tokens_decoder must be an object, got {type(decoder).__name__}")
        named = {}
        for key, entry in decoder.items():
            content = entry.get("content") if isinstance(entry, dict) else entry
            if not key.isdigit() or not isinstance(content, str):
                raise ValueError(f"{config_file}: added_tokens_decoder[{key!r}] is not an id -> token: {entry!r}")
            named[int(key)] = content
        names = _special_names(len(ranks) + NUM_SPECIAL_TOKENS, named)
        pattern = (pattern or config.get("pat_str")
                   or _pattern_from_source(file_inside(path, "tokenization_kimi.py", "tokenizer file")))  # fmt: skip
        if pattern is None:
            raise ValueError(
                f"{path}: no split pattern found (no 'pat_str' in tokenizer_config.json and no pat_str assignment in "
                f"tokenization_kimi.py); pass pattern= to load_tokenizer / TikTokenTokenizer.from_dir"
            )
        by_name = {name: i for i, name in names.items()}

        def special_id(key: str) -> int | None:
            entry = config.get(key)
            name = entry.get("content") if isinstance(entry, dict) else entry
            if name is None:
                return None
            if not isinstance(name, str) or name not in by_name:
                raise ValueError(f"{config_file}: {key} {name!r} is not one of the 256 special tokens")
            return by_name[name]

        digest = hashlib.sha256()
        with open(model_file, "rb") as f:
            digest.update(f.read())
        digest.update(json.dumps([names, pattern], sort_keys=True).encode("utf-8"))
        ids = special_id("bos_token"), special_id("eos_token"), special_id("pad_token")
        try:
            tok = cls(ranks, names, pattern, *ids, "tiktoken:" + digest.hexdigest())
        except (ValueError, TypeError) as err:  # tiktoken names neither the folder nor the pattern
            raise ValueError(f"{path}: tiktoken cannot build an encoding (pattern {pattern!r:.80}): {err}") from err
        tok.source_dir, tok.config, tok.explicit_pattern = os.fspath(path), config, explicit
        return tok


def _read_config(path: str | os.PathLike) -> dict:
    """`path/tokenizer_config.json` as a dict ({} when absent)."""
    file = file_inside(path, "tokenizer_config.json", "tokenizer file")
    if not os.path.exists(file):
        return {}
    config = read_json(file)
    if not isinstance(config, dict):
        raise ValueError(f"{file}: must be a JSON object, got {type(config).__name__}")
    return config


def _read_tiktoken_model(file: str) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    with open(file, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError as e:  # binascii.Error is a ValueError
                raise ValueError(f"{file}:{lineno}: expected 'base64-token rank', got {line[:80]!r} ({e})") from None
    if not ranks:
        raise ValueError(f"{file}: no 'base64-token rank' lines")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{file}: ranks must be exactly 0..{len(ranks) - 1} with no gaps or repeats")
    return ranks


def _pattern_from_source(file: str) -> str | None:
    """Find `pat_str = ...` (a name or `self.pat_str`) in the released `tokenization_kimi.py` without executing it:
    only string literals, `+` and `"sep".join([...])` of them, and earlier module-level string names are evaluated."""
    if not os.path.exists(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=file)
    except (SyntaxError, UnicodeDecodeError) as err:
        raise ValueError(f"{file}: not readable Python source ({err})") from err
    names: dict[str, str] = {}

    def evaluate(node: ast.AST) -> str:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return evaluate(node.left) + evaluate(node.right)
        if isinstance(node, ast.Name) and node.id in names:
            return names[node.id]
        if (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join"
            and len(node.args) == 1 and not node.keywords and isinstance(node.args[0], (ast.List, ast.Tuple))
        ):  # fmt: skip
            return evaluate(node.func.value).join(evaluate(e) for e in node.args[0].elts)
        raise ValueError(f"{file}:{getattr(node, 'lineno', '?')}: pat_str is not built from string literals only")

    for node in tree.body:  # module-level string constants a pattern may refer to
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                names[node.targets[0].id] = evaluate(node.value)
            except ValueError:
                pass
    for node in ast.walk(tree):  # breadth first: a class attribute wins over one assigned inside a method
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        else:
            continue
        for t in targets:
            if getattr(t, "id", None) == "pat_str" or getattr(t, "attr", None) == "pat_str":
                return evaluate(node.value)
    return None


def load_tokenizer(path: str | os.PathLike | None, text_config, pattern: str | None = None):
    """The tokenizer for a model: `path/tokenizer.json` (our BPE), else `path/tiktoken.model` (official format), else
    the byte-level fallback. `text_config` is the model's `K3TextConfig` (anything with vocab_size, bos_token_id,
    eos_token_id, pad_token_id); the tokenizer's size and special ids must agree with it."""
    vocab, bos, eos, pad = (
        text_config.vocab_size,
        text_config.bos_token_id,
        text_config.eos_token_id,
        text_config.pad_token_id,
    )
    if path is not None and os.path.exists(os.path.join(path, "tokenizer.json")):
        tok, source = BPETokenizer.from_dir(path), os.path.join(path, "tokenizer.json")
    elif path is not None and os.path.exists(os.path.join(path, "tiktoken.model")):
        tok, source = TikTokenTokenizer.from_dir(path, pattern), os.path.join(path, "tiktoken.model")
        # The official config may not name bos/eos/pad; then the model config's ids are the truth.
        tok.bos_token_id = bos if tok.bos_token_id is None else tok.bos_token_id
        tok.eos_token_id = eos if tok.eos_token_id is None else tok.eos_token_id
        tok.pad_token_id = pad if tok.pad_token_id is None else tok.pad_token_id
    else:
        return ByteTokenizer(vocab, bos, eos, pad)
    if tok.vocab_size != vocab:
        raise ValueError(f"{source}: tokenizer has {tok.vocab_size} ids, the model's vocab_size is {vocab}")
    for name, want in (("bos_token_id", bos), ("eos_token_id", eos), ("pad_token_id", pad)):
        if want is not None and getattr(tok, name) != want:
            raise ValueError(f"{source}: tokenizer {name} is {getattr(tok, name)}, the model config says {want}")
    return tok

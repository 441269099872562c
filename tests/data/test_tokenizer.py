"""Tokenizers: the trained byte-level BPE (round trip, K3's special-id layout, save/load), the official tiktoken
format (local files, pattern from tokenization_kimi.py, K3's long-input splitting) and load_tokenizer's choice."""

from __future__ import annotations

import base64
import json
import random
from types import SimpleNamespace

import pytest

from openk3.config import K3Config
from openk3.data.corpus import stdlib_documents
from openk3.data.tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    TikTokenTokenizer,
    load_tokenizer,
    split_long_text,
    train_bpe,
)  # fmt: skip

SAMPLES = [
    "plain ASCII text, with punctuation!?",
    "unicode: héllo wörld — ✓ 中文 日本語 한국어 🚀👍🏽 \u200b\u00a0",
    "def f(x):\n\tif x:\n        return {'a': [1, 2]}  # comment\n\n\n    \r\n",
    "  leading and trailing spaces   ",
    "",
    "\x00\x01 control bytes \x7f",
]


@pytest.fixture(scope="module")
def tiny_bpe():
    text = K3Config.preset("tiny").text_config
    docs = stdlib_documents(max_bytes=300_000)
    special = {"bos": text.bos_token_id, "eos": text.eos_token_id, "pad": text.pad_token_id}
    return train_bpe((d.text for d in docs), text.vocab_size, special), text


def test_byte_tokenizer_api():
    tok = ByteTokenizer(1024, 768, 770)
    assert tok.encode("hé", add_bos=True) == [768, 104, 195, 169]
    assert tok.decode([768, 104, 195, 169, 770]) == "hé"
    assert tok.encode_batch(["a", "b"]) == [[97], [98]]
    with pytest.raises(ValueError, match="256"):
        ByteTokenizer(100)


def test_bpe_round_trips_and_compresses(tiny_bpe):
    tok, _ = tiny_bpe
    for s in SAMPLES:
        ids = tok.encode(s)
        assert tok.decode(ids) == s
        assert all(0 <= i < 768 for i in ids)  # user text only ever maps to base ranks
    code = "    def __init__(self, name):\n        self.name = name\n"
    assert len(tok.encode(code)) < len(code.encode()) / 2
    assert tok.encode_batch(SAMPLES) == [tok.encode(s) for s in SAMPLES]


def test_bpe_special_ids_match_the_config(tiny_bpe, tmp_path):
    tok, text = tiny_bpe
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1024, 768, 770, 1023)
    assert tok.num_base_tokens == 768
    assert tok.encode("x", add_bos=True)[0] == 768
    raw = tok._tok
    # K3's layout (the release's tokenizer config): bos, [EOS], eos = <|end_of_msg|>, the XTML markers, media, pad.
    named = {768: "[BOS]", 769: "[EOS]", 770: "<|end_of_msg|>", 771: "<|open|>", 772: "<|close|>", 773: "<|sep|>",
             774: "<|reserved_token_774|>", 786: "<|media_begin|>", 789: "<|media_pad|>", 1022: "[UNK]",
             1023: "[PAD]"}  # fmt: skip
    assert {i: raw.id_to_token(i) for i in named} == named
    assert all(tok.special_ids[name] == i for i, name in named.items())
    # Text spelling a special token is plain text, not a control token; control text (encode_special) maps names.
    assert all(i < 768 for i in tok.encode("[BOS] <|end_of_msg|><|open|><|reserved_token_800|>"))
    assert tok.encode_special("<|open|>msg<|sep|><|sep|>") == [771, *tok.encode("msg"), 773, 773]
    assert tok.decode([768, *tok.encode("hi"), 770]) == "hi"
    assert tok.decode([768, *tok.encode("hi")], skip_special_tokens=False) == "[BOS]hi"

    tok.save(tmp_path)
    loaded = load_tokenizer(tmp_path, text)
    assert isinstance(loaded, BPETokenizer) and loaded.fingerprint == tok.fingerprint
    assert [loaded.encode(s) for s in SAMPLES] == [tok.encode(s) for s in SAMPLES]
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (768, 770, 1023)
    small = K3Config.preset("small").text_config
    with pytest.raises(ValueError, match="tokenizer.json: tokenizer has 1024 ids"):
        load_tokenizer(tmp_path, small)
    with pytest.raises(ValueError, match="eos_token_id is 770"):
        wrong_eos = SimpleNamespace(vocab_size=1024, bos_token_id=768, eos_token_id=769, pad_token_id=None)
        load_tokenizer(tmp_path, wrong_eos)


def test_bpe_on_a_tiny_corpus_keeps_the_layout():
    tok = train_bpe(["aaa bbb"], 600, {"bos": 344, "eos": 346, "pad": 599})
    assert (tok.vocab_size, tok.num_base_tokens, tok.bos_token_id, tok.eos_token_id) == (600, 344, 344, 346)
    assert tok.decode(tok.encode(SAMPLES[1])) == SAMPLES[1]
    with pytest.raises(ValueError, match="outside the special range"):
        train_bpe(["a"], 600, {"bos": 10, "eos": 346, "pad": 599})
    with pytest.raises(ValueError, match="needs a 'pad' id"):
        train_bpe(["a"], 600, {"bos": 344, "eos": 346})
    # A role off its K3 offset keeps a name of its own, unless it would take an XTML marker's id.
    moved = train_bpe(["aaa"], 600, {"bos": 344, "eos": 350, "pad": 599})
    assert moved._tok.id_to_token(350) == "<|eos|>" and moved.special_ids["<|end_of_msg|>"] == 346
    with pytest.raises(ValueError, match=r"K3's <\|open\|>"):
        train_bpe(["a"], 600, {"bos": 344, "eos": 347, "pad": 599})


def test_load_tokenizer_falls_back_to_bytes(tmp_path):
    text = K3Config.preset("tiny").text_config
    tok = load_tokenizer(None, text)
    assert isinstance(tok, ByteTokenizer) and (tok.bos_token_id, tok.pad_token_id) == (768, 1023)
    tok.save(tmp_path)
    assert isinstance(load_tokenizer(tmp_path, text), ByteTokenizer) and not list(tmp_path.iterdir())


# Stand-ins for the released tokenization_kimi.py: the pattern is a "|".join of raw literals, as a class attribute
# (K3) or assigned in __init__ (K2); the loader must read it without executing the file.
PATTERN_PARTS = [r"""[\p{Han}]+""", r""" ?\p{L}+""", r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
                 r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+"""]  # fmt: skip
_JOIN = '"|".join(\n    [\n' + "".join(f'        r"""{p}""",\n' for p in PATTERN_PARTS) + "    ]\n)\n"
FAKE_SOURCES = {
    "class": "import tiktoken\n\nclass TikTokenTokenizer:\n    num_reserved_special_tokens = 256\n\n    pat_str = "
    + _JOIN.replace("\n", "\n    ")
    + "\n    def __init__(self, vocab_file):\n        raise RuntimeError('never run')\n",
    "init": "import tiktoken\n\nclass TikTokenTokenizer:\n    def __init__(self, vocab_file):\n        self.pat_str = "
    + _JOIN.replace("\n", "\n        ")
    + "\n        raise RuntimeError('never run')\n",
}
MERGES = [b"th", b"the", b"in", b"  ", b"    ", b"er", b" the", b"\xe4\xb8"]


def _write_tiktoken_dir(path, with_source=True, pat_in_config=None, source="class"):
    ranks = [bytes([i]) for i in range(256)] + MERGES
    (path / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)), encoding="utf-8"
    )
    base = len(ranks)
    config = {
        "added_tokens_decoder": {str(base): {"content": "[BOS]"}, str(base + 2): {"content": "[EOS]"},
                                 str(base + 3): {"content": "<|im_user|>"}, str(base + 255): {"content": "[PAD]"}},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
    }  # fmt: skip
    if pat_in_config:
        config["pat_str"] = pat_in_config
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if with_source:
        (path / "tokenization_kimi.py").write_text(FAKE_SOURCES[source], encoding="utf-8")
    vocab = base + 256
    return SimpleNamespace(vocab_size=vocab, bos_token_id=base, eos_token_id=base + 2, pad_token_id=vocab - 1)


@pytest.mark.parametrize("source", sorted(FAKE_SOURCES))
def test_tiktoken_loads_from_local_files(tmp_path, source):
    text = _write_tiktoken_dir(tmp_path, source=source)
    tok = load_tokenizer(tmp_path, text)
    assert isinstance(tok, TikTokenTokenizer)
    assert tok._enc._pat_str == "|".join(PATTERN_PARTS)
    base = 256 + len(MERGES)
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (base + 256, base, base + 2,
                                                                                        base + 255)  # fmt: skip
    assert tok.special_names[base + 1] == f"<|reserved_token_{base + 1}|>"
    assert tok.special_names[base + 3] == "<|im_user|>"
    assert tok.encode("the") == [257] and tok.encode(" the") == [262]
    for s in SAMPLES:
        assert tok.decode(tok.encode(s)) == s
    # Special tokens are disallowed in user text: they encode as plain bytes.
    assert all(i < base for i in tok.encode("[BOS]<|im_user|><|reserved_token_300|>"))
    assert tok.decode([base, *tok.encode("hi"), base + 3], skip_special_tokens=False) == "[BOS]hi<|im_user|>"
    assert tok.encode_batch(SAMPLES) == [tok.encode(s) for s in SAMPLES]
    tok.save(tmp_path / "ckpt")  # a checkpoint carries the official files
    copy = load_tokenizer(tmp_path / "ckpt", text)
    assert copy.fingerprint == tok.fingerprint and copy.encode(SAMPLES[2]) == tok.encode(SAMPLES[2])


def test_tiktoken_pattern_sources(tmp_path):
    _write_tiktoken_dir(tmp_path, with_source=False, pat_in_config=r"\S+|\s+")
    assert TikTokenTokenizer.from_dir(tmp_path)._enc._pat_str == r"\S+|\s+"
    (tmp_path / "tokenizer_config.json").write_text("{}", encoding="utf-8")
    with pytest.raises(ValueError, match="pass pattern="):
        TikTokenTokenizer.from_dir(tmp_path)
    explicit = TikTokenTokenizer.from_dir(tmp_path, pattern=r"\w+|\W+")
    explicit.save(tmp_path / "ckpt")  # the explicit pattern travels in the saved config
    assert TikTokenTokenizer.from_dir(tmp_path / "ckpt").encode("ab cd") == explicit.encode("ab cd")
    (tmp_path / "tiktoken.model").write_text("dGg= 0\nnot-base64!! 1\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"tiktoken.model:2"):
        TikTokenTokenizer.from_dir(tmp_path, pattern=r"\w+")


def _reference_split(s: str, max_run: int) -> list[str]:
    """The released per-character loop: cut whenever a run of (non-)whitespace exceeds max_run characters."""
    out, run, is_space, start = [], 0, s[0].isspace() if s else False, 0
    for i, ch in enumerate(s):
        if ch.isspace() != is_space:
            run, is_space = 1, ch.isspace()
        else:
            run += 1
            if run > max_run:
                out.append(s[start:i])
                start, run = i, 1
    return out + [s[start:]]


def test_long_input_splitting_matches_the_released_loop():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randrange(0, 60)
        s = "".join(rng.choice("ab \n\t\u3000\u00a0x") * rng.randrange(1, 9) for _ in range(n))
        for max_run in (1, 3, 7):
            assert list(split_long_text(s, max_run)) == _reference_split(s, max_run), (s, max_run)


def test_long_inputs_are_encoded_in_windows_and_runs(tmp_path):
    text = _write_tiktoken_dir(tmp_path)
    tok = load_tokenizer(tmp_path, text)
    long = "the " * 20_000 + "a" * 60_000 + " " * 30_000 + "in" * 200_000 + "the end"
    pieces = [p for w in range(0, len(long), 400_000) for p in _reference_split(long[w : w + 400_000], 25_000)]
    # Runs over 25,000 characters are cut every 25,000 from their start; the 400,000-character window cuts too.
    assert pieces[0] == "the " * 20_000 + "a" * 25_000 and pieces[1] == "a" * 25_000
    assert pieces[2] == "a" * 10_000 + " " * 25_000 and len(pieces) == 20
    assert "".join(pieces) == long and list(split_long_text(long)) == pieces
    ids = tok.encode(long)
    assert ids == [i for p in pieces for i in tok._enc.encode_ordinary(p)]
    assert tok.decode(ids) == long
    assert tok.encode_batch([long, "the"]) == [ids, [257]]

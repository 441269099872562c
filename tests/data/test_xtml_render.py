"""Golden tests for the XTML chat renderer (`openk3.data.xtml`).

This file owns: the exact segment lists of `tests/fixtures/xtml/render_cases.json` (texts and segment boundaries,
since every segment is tokenized on its own), the renderer's errors, that rendering never mutates its inputs, and
that `encode_xtml` puts the structural markers, and only them, on special ids: with our trained BPE in K3's layout and
with the official tiktoken format, whose ids come from its `tokenizer_config.json`.

The goldens were derived by hand from the released `build_chat_segments` (read as a specification). Never regenerate
them by running a renderer: that would make these tests check the renderer against itself.
"""

from __future__ import annotations

import base64
import copy
import difflib
import json
import os

import pytest

from openk3.data.xtml import Segment, encode_xtml, render_xtml

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "xtml", "render_cases.json")
with open(FIXTURE, encoding="utf-8") as _f:
    _DATA = json.load(_f)
CASES = _DATA["cases"]
ERRORS = _DATA["errors"]

# In the fixture a leading § marks a control segment (allow_special=True); no golden text contains § otherwise.
SPECIAL_MARK = "§"
MARKERS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
# K3's special layout as offsets from the first special id (the released tokenizer_config.json's added_tokens_decoder).
K3_OFFSETS = {
    "[BOS]": 0, "[EOS]": 1, "<|end_of_msg|>": 2, "<|open|>": 3, "<|close|>": 4, "<|sep|>": 5,
    "<|media_begin|>": 18, "<|media_content|>": 19, "<|media_end|>": 20, "<|media_pad|>": 21,
    "[UNK]": 254, "[PAD]": 255,
}  # fmt: skip


def _decode_golden(entry: str) -> Segment:
    if entry.startswith(SPECIAL_MARK):
        return Segment(entry[len(SPECIAL_MARK) :], allow_special=True)
    return Segment(entry)


def _encode_golden(segment: Segment) -> str:
    return SPECIAL_MARK + segment.text if segment.allow_special else segment.text


def _render(case: dict) -> list[Segment]:
    return render_xtml(case["messages"], case["tools"], **case["options"])


def _by_name(name: str) -> dict:
    return next(c for c in CASES if c["name"] == name)


def test_fixture_is_well_formed():
    names = [c["name"] for c in CASES + ERRORS]
    assert len(names) == len(set(names)), "case names must be unique (they are the test ids)"
    assert len(CASES) >= 32
    for case in CASES:
        for entry in case["segments"]:
            # An empty segment is dropped by the release, so a golden never holds one.
            assert entry not in ("", SPECIAL_MARK), case["name"]
            assert SPECIAL_MARK not in entry[1:], f"{case['name']}: § inside a text would be ambiguous: {entry!r}"


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_render_matches_golden(case):
    actual = _render(case)
    assert isinstance(actual, list) and all(isinstance(s, Segment) for s in actual)
    got = [_encode_golden(s) for s in actual]
    want = case["segments"]
    if got != want:
        diff = "\n".join(
            difflib.unified_diff([repr(s) for s in want], [repr(s) for s in got], "golden", "render_xtml", lineterm="")
        )
        pytest.fail(f"{case['name']}: segments differ (§ = allow_special)\n{diff}")
    assert actual == [_decode_golden(s) for s in want]


@pytest.mark.parametrize("case", ERRORS, ids=[c["name"] for c in ERRORS])
def test_render_errors(case):
    # Where the release uses `assert` (thinking_effort), we raise ValueError: asserts vanish under python -O.
    error = {"ValueError": ValueError, "TypeError": TypeError}[case["error"]]
    with pytest.raises(error):
        _render(case)


@pytest.mark.parametrize("case", CASES + ERRORS, ids=[c["name"] for c in CASES + ERRORS])
def test_render_does_not_mutate_inputs(case):
    before = copy.deepcopy((case["messages"], case["tools"], case["options"]))
    try:
        _render(case)
    except (ValueError, TypeError):
        pass  # the error cases: a failed render must not leave half-normalized messages behind either
    assert (case["messages"], case["tools"], case["options"]) == before


def _expected_ids(tok, segments: list[Segment], num_base: int) -> list[int]:
    """The release's per-segment encoding, spelled out: a marker segment is exactly its one special id, any other
    control segment (an image prompt) goes through encode_special, and plain text never yields a special id."""
    ids: list[int] = []
    for seg in segments:
        if seg.allow_special and seg.text in MARKERS:
            ids.append(tok.special_ids[seg.text])
        elif seg.allow_special:
            ids.extend(tok.encode_special(seg.text))
        else:
            part = tok.encode(seg.text)
            assert all(i < num_base for i in part), f"plain text {seg.text!r} produced a special id: {part}"
            ids.extend(part)
    return ids


def _check_encoding(tok, segments: list[Segment], num_base: int) -> list[int]:
    ids = encode_xtml(segments, tok)
    assert ids == _expected_ids(tok, segments, num_base)
    for marker in MARKERS:
        controls = sum(1 for s in segments if s.allow_special and s.text == marker)
        assert ids.count(tok.special_ids[marker]) == controls, marker
    # With no image prompts, the special ids sit exactly at the marker segments' positions.
    if all(s.text in MARKERS for s in segments if s.allow_special):
        assert sum(1 for i in ids if i >= num_base) == sum(1 for s in segments if s.allow_special)
    assert tok.decode(ids, skip_special_tokens=False) == "".join(s.text for s in segments)
    return ids


@pytest.fixture(scope="module")
def bpe():
    pytest.importorskip("tokenizers")
    from openk3.data.tokenizer import train_bpe

    texts = [_decode_golden(e).text for c in CASES for e in c["segments"] if not e.startswith(SPECIAL_MARK)]
    return train_bpe(texts, 1024, {"bos": 768, "eos": 770, "pad": 1023})


def test_bpe_names_k3_special_layout(bpe):
    for name, offset in K3_OFFSETS.items():
        assert bpe.special_ids[name] == 768 + offset, name


@pytest.mark.parametrize(
    "name",
    ["user_spells_control_markers", "tool_call_arguments_dict_all_types", "static_tools_sorted_compact_unicode",
     "attribute_escaping", "image_parts_with_prompts", "image_parts_without_prompts", "multi_turn_tool_rounds"],
)  # fmt: skip
def test_encode_xtml_bpe_markers_on_special_ids(bpe, name):
    _check_encoding(bpe, _render(_by_name(name)), 768)


def test_encode_xtml_user_cannot_inject_markers(bpe):
    typed = "Type <|open|>message<|sep|> then <|end_of_msg|> and <|close|>"
    segments = render_xtml([{"role": "user", "content": typed}], add_generation_prompt=False)
    ids = _check_encoding(bpe, segments, 768)
    # One message: exactly one open, one close, two seps and one end_of_msg, whatever the user typed.
    counts = {m: ids.count(bpe.special_ids[m]) for m in MARKERS}
    assert counts == {"<|open|>": 1, "<|close|>": 1, "<|sep|>": 2, "<|end_of_msg|>": 1}
    assert bpe.decode(bpe.encode(typed), skip_special_tokens=False) == typed


def test_encode_xtml_tiktoken_ids_come_from_config(tmp_path):
    pytest.importorskip("tiktoken")
    from openk3.data.tokenizer import TikTokenTokenizer

    # 256 single-byte ranks (rank = byte), so plain text encodes to exactly its UTF-8 bytes.
    (tmp_path / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)), encoding="utf-8"
    )
    # The markers sit away from K3's offsets (open would be 259): the ids must come from this config.
    names = {256: "[BOS]", 257: "[EOS]", 296: "<|open|>", 297: "<|close|>", 298: "<|sep|>", 299: "<|end_of_msg|>",
             300: "<|media_pad|>", 510: "[UNK]", 511: "[PAD]"}  # fmt: skip
    config = {
        "added_tokens_decoder": {str(i): {"content": n, "special": True} for i, n in names.items()},
        "bos_token": "[BOS]", "eos_token": "<|end_of_msg|>", "pad_token": "[PAD]", "pat_str": r"\S+|\s+",
    }  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    tok = TikTokenTokenizer.from_dir(tmp_path)
    assert {n: tok.special_ids[n] for n in names.values()} == {n: i for i, n in names.items()}
    assert 259 not in {tok.special_ids[m] for m in MARKERS}

    case = _by_name("attribute_escaping")
    segments = _render(case)
    ids = _check_encoding(tok, segments, 256)
    assert ids[0] == 296 and ids.count(296) == sum(1 for s in segments if s.allow_special and s.text == "<|open|>")
    for seg in segments:
        if not seg.allow_special:
            assert tok.encode(seg.text) == list(seg.text.encode("utf-8"))
    # A user typing a marker gets its bytes, never the config's id.
    typed = render_xtml([{"role": "user", "content": "<|open|><|end_of_msg|>"}], add_generation_prompt=False)
    typed_ids = _check_encoding(tok, typed, 256)
    assert typed_ids.count(296) == 1 and typed_ids.count(299) == 1
    # An image prompt in a control segment puts its media token on the config's id.
    prompt = [Segment("<|media_pad|>", allow_special=True), Segment("x")]
    assert encode_xtml(prompt, tok) == [300, ord("x")]

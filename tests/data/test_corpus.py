"""Corpus: the embedded stdlib corpus, user files/folders/JSONL, and the deterministic train/val split."""

from __future__ import annotations

import json

import pytest

from openk3.data.corpus import Document, load_documents, split_train_val, stdlib_documents


def test_stdlib_documents_prose_then_code_deterministic_and_capped():
    docs = stdlib_documents(max_bytes=600_000)
    assert docs == stdlib_documents(max_bytes=600_000)
    total = sum(len(d.text.encode("utf-8")) for d in docs)
    assert total <= 600_000
    prose = [d for d in docs if d.source.startswith("pydoc:")]
    code = [d for d in docs if d.source.startswith("stdlib/")]
    assert len(prose) > 20 and len(code) > 0 and len(prose) + len(code) == len(docs)
    assert docs[: len(prose)] == prose and code == sorted(code, key=lambda d: d.source)
    assert any("assert" in d.source for d in prose)
    for d in code:
        parts = d.source.split("/")
        assert parts[-1].endswith(".py")
        assert not {"test", "tests", "site-packages", "idlelib", "encodings"} & set(parts), d.source
        assert d.text.strip()


def test_stdlib_documents_larger_cap_is_a_superset():
    small = {d.source for d in stdlib_documents(max_bytes=400_000)}
    large = {d.source for d in stdlib_documents(max_bytes=1_500_000)}
    assert small < large


def test_split_is_stable_order_independent_and_pinned():
    docs = [Document(f"text {i}", f"doc{i}") for i in range(1000)]
    train, val = split_train_val(docs, val_fraction=0.01, seed=0)
    assert len(train) + len(val) == 1000 and 0 < len(val) < 30
    # Pinned: a salted hash() or an order-dependent rule would change this list between runs.
    assert [d.source for d in val] == PINNED_VAL
    _train_r, val_r = split_train_val(docs[::-1], val_fraction=0.01, seed=0)
    assert {d.source for d in val_r} == {d.source for d in val}
    assert {d.source for d in split_train_val(docs, 0.01, seed=1)[1]} != {d.source for d in val}
    # Membership depends on the document alone, not on which other documents exist.
    first_half = {f"doc{i}" for i in range(500)}
    assert {d.source for d in split_train_val(docs[:500], 0.01)[1]} == {d.source for d in val} & first_half


PINNED_VAL = ["doc170", "doc188", "doc219", "doc276", "doc294", "doc476", "doc796", "doc928"]


def test_split_never_leaves_val_or_train_empty():
    docs = [Document("a", "x"), Document("b", "y")]
    train, val = split_train_val(docs, val_fraction=0.01)
    assert len(train) == 1 and len(val) == 1
    train, val = split_train_val(docs, val_fraction=0.99)
    assert len(train) == 1 and len(val) == 1
    assert split_train_val(docs, val_fraction=0.0) == (docs, [])
    with pytest.raises(ValueError, match="val_fraction"):
        split_train_val(docs, val_fraction=1.0)


def test_load_text_file_folder_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("alpha", encoding="utf-8")
    (tmp_path / "sub" / "deep").mkdir(parents=True)
    (tmp_path / "sub" / "b.md").write_text("# beta", encoding="utf-8")
    (tmp_path / "sub" / "deep" / "c.py").write_text("x = 1\n", encoding="utf-8")
    (tmp_path / "sub" / "d.jsonl").write_text(
        json.dumps({"text": "first", "id": 1}) + "\n\n" + json.dumps({"text": "second"}) + "\n", encoding="utf-8"
    )
    (tmp_path / "skip.bin").write_bytes(b"\x00\x01")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "h.txt").write_text("hidden", encoding="utf-8")
    (tmp_path / "empty.txt").write_text("  \n", encoding="utf-8")

    assert load_documents(tmp_path / "a.txt") == [Document("alpha", str(tmp_path / "a.txt"))]
    docs = load_documents(tmp_path)
    assert [d.text for d in docs] == ["alpha", "# beta", "first", "second", "x = 1\n"]  # sorted by path
    jsonl = str(tmp_path / "sub" / "d.jsonl")
    assert [d.source for d in docs[2:4]] == [f"{jsonl}:1", f"{jsonl}:3"]
    assert load_documents(str(tmp_path)) == docs


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"text": "ok"}', '{"text": "ok"}', "{not json"], r"bad\.jsonl:3: invalid JSON"),
        (['{"text": "ok"}', '{"content": "no text"}'], r"bad\.jsonl:2: expected a JSON object with a 'text' field"),
        (['["a list"]'], r"bad\.jsonl:1: expected a JSON object"),
        (['{"text": 5}'], r"bad\.jsonl:1: 'text' must be a string"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, lines, message):
    file = tmp_path / "bad.jsonl"
    file.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        load_documents(file)
    with pytest.raises(ValueError, match=message):  # also when found inside a folder
        load_documents(tmp_path)


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_documents(tmp_path / "missing")
    with pytest.raises(ValueError, match="no files ending in"):
        load_documents(tmp_path)
    (tmp_path / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin\.txt: not UTF-8"):
        load_documents(tmp_path / "latin.txt")

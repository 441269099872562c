"""Text corpora as lists of `Document`s: the embedded default that needs no download, user files, and the split.

- `stdlib_documents()`: text every Python installation carries: the standard library's help topics
  (`pydoc_data.topics`, English prose) followed by the `.py` sources of the standard library (code), minus tests,
  `site-packages` and generated or joke modules. Deterministic for a given Python build; capped by `max_bytes`.
- `load_documents(path)`: a text file (one document), a JSONL file (one document per line, from its `text` field),
  or a folder (every text file below it, recursively, in sorted path order).
- `split_train_val(docs)`: a deterministic split by a stable hash of each document's `source`.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import warnings
from dataclasses import dataclass

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl")
# Folders of the standard library that are tests, tooling or data rather than library prose and code.
_STDLIB_SKIP_DIRS = {
    "test", "tests", "idle_test", "site-packages", "dist-packages", "idlelib", "turtledemo", "ensurepip", "encodings",
    "__pycache__", "pydoc_data", "lib2to3", "lib-dynload",
}  # fmt: skip
# Single modules that are generated tables or jokes (`this` is the Zen in rot13).
_STDLIB_SKIP_FILES = {"this.py", "antigravity.py", "__hello__.py", "__phello__.foo.py"}
DEFAULT_MAX_BYTES = 4_000_000


@dataclass(frozen=True)
class Document:
    text: str
    source: str  # stable identifier: "pydoc:<topic>", "stdlib/<relative path>", a file path, or "<file>:<line>"


def _stable_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "big")


def stdlib_documents(max_bytes: int | None = DEFAULT_MAX_BYTES) -> list[Document]:
    """The standard library's help topics (all of them, first, sorted by topic) then its `.py` sources, sorted by path.

    The help topics are about 0.5 MB of prose; the sources about 10 MB of code. With `max_bytes` (UTF-8 bytes over
    all documents) the code files are chosen in the order of a stable hash of their path until the budget is spent,
    which samples every part of the library instead of the alphabetically first modules. `None` takes everything.
    """
    docs: list[Document] = []
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions ship the help topics in a separate package
        warnings.warn("pydoc_data.topics is not installed; the default corpus has no prose, only code", stacklevel=2)
        topics = {}
    for name in sorted(topics):
        if topics[name].strip():
            docs.append(Document(topics[name], f"pydoc:{name}"))
    used = sum(len(d.text.encode("utf-8")) for d in docs)

    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS and not d.startswith("config-")]
        for name in filenames:
            if name.endswith(".py") and name not in _STDLIB_SKIP_FILES and not name.startswith("_sysconfigdata"):
                files.append(os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
    code = []
    for rel in sorted(files, key=lambda r: (_stable_hash(r), r)):
        with open(os.path.join(root, rel), "rb") as f:
            raw = f.read()
        if max_bytes is not None and used + len(raw) > max_bytes:
            continue  # a smaller file later in the order may still fit
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue  # a handful of stdlib files are latin-1 test data; not worth a special case
        if text.strip():
            code.append(Document(text, f"stdlib/{rel}"))
            used += len(raw)
    return docs + sorted(code, key=lambda d: d.source)


def load_documents(path: str | os.PathLike) -> list[Document]:
    """Documents from a text file, a `.jsonl` file (each non-empty line a JSON object with a string `text` field;
    source `<file>:<line>`), or a folder (files ending in `TEXT_SUFFIXES`, recursively, sorted by path; hidden
    files and folders are skipped). Empty documents are dropped. Errors name the file and line."""
    path = os.fspath(path)
    if os.path.isdir(path):
        docs = []
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                if name.endswith(TEXT_SUFFIXES) and not name.startswith("."):
                    docs.extend(_load_file(os.path.join(dirpath, name)))
        docs.sort(key=lambda d: _source_order(d.source))
        if not docs:
            raise ValueError(f"{path}: no files ending in {', '.join(TEXT_SUFFIXES)} found")
        return docs
    if not os.path.exists(path):
        raise ValueError(f"--data {path}: no such file or folder")
    return _load_file(path)


def _source_order(source: str) -> tuple[str, int]:
    # "<file>:<line>" sources of one JSONL file keep their line order; os.walk order is not sorted across levels.
    file, _, line = source.rpartition(":")
    return (file, int(line)) if line.isdigit() and file else (source, 0)


def _load_file(file: str) -> list[Document]:
    try:
        with open(file, encoding="utf-8") as f:
            if not file.endswith(".jsonl"):
                text = f.read()
                return [Document(text, file)] if text.strip() else []
            return _load_jsonl(f, file)
    except UnicodeDecodeError as e:
        raise ValueError(f"{file}: not UTF-8 text ({e})") from None


def _load_jsonl(lines, file: str) -> list[Document]:
    docs = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(record, dict) or "text" not in record:
            raise ValueError(f"{file}:{lineno}: expected a JSON object with a 'text' field")
        if not isinstance(record["text"], str):
            raise ValueError(f"{file}:{lineno}: 'text' must be a string, got {type(record['text']).__name__}")
        if record["text"].strip():
            docs.append(Document(record["text"], f"{file}:{lineno}"))
    return docs


def split_train_val(
    docs: list[Document], val_fraction: float = 0.01, seed: int = 0
) -> tuple[list[Document], list[Document]]:
    """(train, val), each in the input order. A document is in val iff a stable hash of (seed, source) falls below
    `val_fraction`, so the split does not depend on the order or number of other documents, nor on PYTHONHASHSEED.
    When `val_fraction > 0` and no document falls below it, the lowest-hashed one goes to val so val is never empty
    and train keeps at least one (for two or more documents)."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    scale = float(1 << 64)
    u = [_stable_hash(f"{seed}:{d.source}") / scale for d in docs]
    is_val = [x < val_fraction for x in u]
    if val_fraction > 0 and len(docs) >= 2 and not any(is_val):
        is_val[min(range(len(docs)), key=u.__getitem__)] = True
    if len(docs) >= 2 and all(is_val):
        is_val[max(range(len(docs)), key=u.__getitem__)] = False
    train = [d for d, v in zip(docs, is_val) if not v]
    val = [d for d, v in zip(docs, is_val) if v]
    return train, val

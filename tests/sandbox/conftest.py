"""Fixtures of the namespace backend's tests: one backend for the session (skipped, with the host's reason, where
user namespaces, overlayfs or root are missing; this project's machines have them all, so there they run), a fresh
sandbox per test and a factory for sandboxes with limits, each closed after its test; and `tree`, a listing of a
sandbox's root file tree made inside the sandbox (paths, kinds, modes, owners, sizes, mtimes, link targets, content
hashes) for exact before/after comparisons.
"""

from __future__ import annotations

import pytest

from openk3.sandbox import NamespaceBackend, SandboxUnavailable

# Walks the overlay only: /usr (the host's, read-only), /proc and /dev are other mounts and not part of snapshots.
TREE = r"""
import hashlib, os, stat
dev = os.lstat("/").st_dev
out = []
def note(path):
    st = os.lstat(path)
    kind = stat.S_IFMT(st.st_mode)
    extra = ""
    if stat.S_ISLNK(st.st_mode):
        extra = os.readlink(path)
    elif stat.S_ISREG(st.st_mode):
        try:
            with open(path, "rb") as f:
                extra = hashlib.sha256(f.read()).hexdigest()
        except PermissionError:
            extra = "unreadable"
    out.append(f"{path} {kind:o} {stat.S_IMODE(st.st_mode):o} {st.st_uid} {st.st_size if not stat.S_ISDIR(st.st_mode) else 0} {st.st_mtime_ns} {extra}")
for top, dirs, files in os.walk("/"):
    dirs[:] = sorted(d for d in dirs if os.lstat(os.path.join(top, d)).st_dev == dev)
    for name in sorted(dirs + files):
        note(os.path.join(top, name))
print("\n".join(out))
"""


@pytest.fixture(scope="session")
def backend():
    try:
        b = NamespaceBackend()
    except SandboxUnavailable as e:
        pytest.skip(str(e))
    yield b
    b.close()


@pytest.fixture
def sandbox(backend):
    sb = backend.create()
    yield sb
    sb.close()


@pytest.fixture
def make(backend):
    """make(**limits) -> a new sandbox of the session backend, closed at the end of the test."""
    made = []

    def make(**limits):
        sb = backend.create(**limits)
        made.append(sb)
        return sb

    yield make
    for sb in made:
        sb.close()


@pytest.fixture
def tree():
    def tree(sb) -> list[str]:
        result = sb.exec(["python3", "-I", "-S", "-c", TREE])
        assert result.exit_code == 0, result.stderr
        return result.stdout.splitlines()

    return tree

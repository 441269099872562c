"""Fixtures of the RL environment tests: a sandbox fleet per test module (skipped, with the host's reason, where
user namespaces, overlayfs or root are missing; this project's machines have them all, so there they run) and the
task snapshots its episodes share."""

from __future__ import annotations

import pytest

from openk3.sandbox import SandboxUnavailable


@pytest.fixture(scope="module")
def fleet():
    from openk3.sandbox.fleet import Fleet

    try:
        f = Fleet(max_sandboxes=16, warm=2, memory_mb=256)
    except SandboxUnavailable as e:
        pytest.skip(str(e))
    yield f
    f.close()


@pytest.fixture(scope="module")
def snapshots(fleet):
    from openk3.rl.env import TaskSnapshots

    s = TaskSnapshots(fleet, max_tasks=32)
    yield s
    s.close()

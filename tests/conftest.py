"""Shared fixtures (the fixture checkpoints' paths are in fixture_paths.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """Pin the BLAS thread count for bitwise comparisons (CPU results can depend on it)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


class _CountingLibrary:
    """The CPU kernel library with a count of the calls of each C function (proof that a path ran a kernel)."""

    def __init__(self, lib):
        self.lib, self.count = lib, {}

    def __getattr__(self, name):
        fn = getattr(self.lib, name)

        def call(*args):
            self.count[name] = self.count.get(name, 0) + 1
            return fn(*args)

        return call


@pytest.fixture
def calls(monkeypatch):
    """{C function name: calls} of `openk3.ops.cpu_kernels` during the test (needs the library built)."""
    from openk3.ops import cpu_kernels

    spy = _CountingLibrary(cpu_kernels.library())
    monkeypatch.setattr(cpu_kernels, "_lib", spy)
    return spy.count

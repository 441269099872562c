"""Shared fixtures (the fixture checkpoints' paths are in fixture_paths.py)."""

from __future__ import annotations

import os
import resource

import pytest
import torch


@pytest.fixture
def one_thread():
    """Pin the BLAS thread count for bitwise comparisons (CPU results can depend on it)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def past_fd_setsize():
    """Every descriptor opened during the test is numbered past select()'s FD_SETSIZE (1024), as in a process with
    over a thousand open (a server's connections, a fleet of sandboxes): the limit is raised to 1200 and the low
    numbers are held open; both are restored after. Skips where the hard limit is below 1200."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard descriptor limit ({hard}) is below 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    filler: list[int] = []
    try:
        while not filler or filler[-1] < 1030:
            filler.append(os.open(os.devnull, os.O_RDONLY))
        yield
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


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


def _kernel_isas() -> list[str]:
    from openk3.ops.cpu_features import features

    return list(features().isas())


@pytest.fixture(params=_kernel_isas())
def kernel_isa(request):
    """Runs the test once per build of the CPU kernels this CPU runs (`ops.cpu_kernels.use_isa`: AVX-512, AVX2,
    portable); a build that fails fails the test with the compiler's message."""
    from openk3.ops import cpu_kernels

    with cpu_kernels.use_isa(request.param):
        yield request.param


@pytest.fixture
def calls(monkeypatch):
    """{C function name: calls} of `openk3.ops.cpu_kernels` during the test (needs the library built)."""
    from openk3.ops import cpu_kernels

    spy = _CountingLibrary(cpu_kernels.library())
    monkeypatch.setattr(cpu_kernels, "_lib", spy)
    return spy.count

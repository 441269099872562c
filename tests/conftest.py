"""Shared fixtures (the fixture checkpoints' paths are in fixture_paths.py)."""

from __future__ import annotations

import os
import resource

import pytest
import torch

from openk3.threads import physical_cores

MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's default): one worker per physical core, at most MAX_WORKERS; most tests are small ops
    whose time is Python's, which more threads in one process do not shorten, and more workers would multiply the
    memory of the tests that build models and start several ranks."""
    return max(1, min(MAX_WORKERS, physical_cores()))


def _share_cores_among_workers():
    """Under pytest-xdist each worker takes its share of the cores (torch's threads, and OMP_NUM_THREADS for the
    processes its tests start), unless the user set OMP_NUM_THREADS."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and not os.environ.get("OMP_NUM_THREADS"):
        share = max(1, physical_cores() // workers)
        os.environ["OMP_NUM_THREADS"] = str(share)
        torch.set_num_threads(share)


_share_cores_among_workers()


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

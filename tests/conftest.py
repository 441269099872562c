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

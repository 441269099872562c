"""Shared fixtures: paths to the official-format checkpoints (copied from shared/fixtures, see their README)."""

from __future__ import annotations

import os

import pytest
import torch

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
PLAIN = os.path.join(FIXTURES, "k3-official-tiny")
MXFP4 = os.path.join(FIXTURES, "k3-official-tiny-mxfp4")
LOGITS = os.path.join(FIXTURES, "k3-official-tiny-logits.safetensors")


@pytest.fixture
def one_thread():
    """Pin the BLAS thread count for bitwise comparisons (CPU results can depend on it)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)

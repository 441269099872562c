"""Paths to the official-format checkpoints in tests/fixtures (see tests/fixtures/README.md).

Test modules import them from here, not from a conftest: several folders have a conftest.py, and pytest registers
each as the module `conftest`, so `from conftest import ...` would depend on which one was loaded last.
"""

from __future__ import annotations

import os

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
PLAIN = os.path.join(FIXTURES, "k3-official-tiny")
MXFP4 = os.path.join(FIXTURES, "k3-official-tiny-mxfp4")
LOGITS = os.path.join(FIXTURES, "k3-official-tiny-logits.safetensors")

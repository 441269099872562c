"""Kimi Delta Attention ops (spec/kda.md): the gate, the token-loop reference, the tile-chunked op, the decode step.

`ref.py` is the specification; `chunk.py` and `step.py` are tested against it in tests/ops/test_kda.py.
"""

from openk3.ops.kda.chunk import kda_chunked
from openk3.ops.kda.ref import kda_gate, kda_recurrent
from openk3.ops.kda.step import kda_step

__all__ = ["kda_chunked", "kda_gate", "kda_recurrent", "kda_step"]

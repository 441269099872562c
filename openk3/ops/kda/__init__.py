"""Kimi Delta Attention ops (spec/kda.md): the gate, the token-loop reference, the chunked ops, the decode step
and its speculative verify/fold.

`ref.py` is the specification; `tile_ref.py` is the readable tile-by-tile chunked reference; `chunk.py` is the fast
chunked path the model calls (CPU), `chunk_bf16.py` its opt-in bf16-operand variant, `unit_lower.py` their UT
inverses (the pre-K3 log-space baseline lives in benchmarks/kda_baselines.py); `affine.py` gives a segment's affine state map for context parallelism; `gpu.py` wraps fla-core's kernels.
All are tested against `ref.py` in tests/ops/test_kda*.py.
"""

from openk3.ops.kda.affine import compose_summaries, entry_states, kda_segment_summary
from openk3.ops.kda.chunk import kda_chunked
from openk3.ops.kda.ref import kda_gate, kda_recurrent
from openk3.ops.kda.step import KDASteps, kda_fold, kda_step, kda_verify
from openk3.ops.kda.tile_ref import kda_chunked_tiles

__all__ = [
    "KDASteps",
    "compose_summaries",
    "entry_states",
    "kda_chunked",
    "kda_chunked_tiles",
    "kda_fold",
    "kda_gate",
    "kda_recurrent",
    "kda_segment_summary",
    "kda_step",
    "kda_verify",
]  # fmt: skip

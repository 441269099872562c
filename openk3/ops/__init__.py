"""Pure tensor functions (no nn.Module state, no model types): the public op surface of openk3.

Each op has a readable reference beside any fast path and a test comparing them (STYLE.md rule 1).
"""

from openk3.ops.attention.ref import causal_attention, causal_attention_ref
from openk3.ops.attnres import attn_res_mix
from openk3.ops.conv import short_conv, short_conv_ref
from openk3.ops.kda import (
    compose_summaries,
    entry_states,
    kda_chunked,
    kda_chunked_tiles,
    kda_gate,
    kda_recurrent,
    kda_segment_summary,
    kda_step,
)  # fmt: skip
from openk3.ops.moe.mxfp4 import mxfp4_pack, mxfp4_unpack
from openk3.ops.moe.route import route_topk, router_scores
from openk3.ops.norm import gated_rms_norm, l2_norm, rms_norm
from openk3.ops.sampling import sample
from openk3.ops.situ import situ_glu

__all__ = [
    "attn_res_mix", "causal_attention", "causal_attention_ref", "compose_summaries", "entry_states",
    "gated_rms_norm", "kda_chunked", "kda_chunked_tiles", "kda_gate", "kda_recurrent", "kda_segment_summary",
    "kda_step", "l2_norm", "mxfp4_pack", "mxfp4_unpack", "rms_norm", "route_topk", "router_scores", "sample",
    "short_conv", "short_conv_ref", "situ_glu",
]  # fmt: skip

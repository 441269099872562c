"""KimiDeltaAttention: the K3 linear-attention layer (spec/model.md §5, spec/kda.md).

    q0, k0, v0 = q_proj(x), k_proj(x), v_proj(x)
    q1, k1, v1 = SiLU(short causal depthwise conv) of each              (fp32 math, activation dtype out)
    g          = -5 * sigmoid(exp(A_log) * (f_b_proj(f_a_proj(x)) + dt_bias))     (fp32, per key channel)
    beta       = sigmoid(f32(b_proj(x)))
    q^, k^     = L2-normalised per head (rounded to the activation dtype on the chunk path, fp32 on decode)
    o          = DeltaRule(q^ * K^-0.5, k^, v1, g, beta)                (fp32 state)
    out        = o_proj(RMSNorm_gated(o; o_norm, sigmoid(g_proj(x))))

Kernel choice is visible here: one new token per sequence on top of a cache is the decode step (`kda_step`, the
released code's fused recurrent path); everything else is the chunked op with the cached state as initial state.

Legend: T packed tokens, N sequences, L padded length, H heads, K = V head dim, P = H*K, D hidden, W conv width.
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.config import K3TextConfig
from openk3.model.batch import ForwardBatch
from openk3.model.cache import KDAState
from openk3.model.layers import ShortConvolution
from openk3.ops.conv import short_conv
from openk3.ops.dispatch import kda_chunked, kda_step  # CPU fast path, or fla-core kernels on CUDA
from openk3.ops.kda import kda_gate
from openk3.ops.norm import gated_rms_norm, l2_norm
from openk3.utils import fp32_region


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: K3TextConfig):
        super().__init__()
        la = config.linear_attn_config
        D, H, K, W = config.hidden_size, la.num_heads, la.head_dim, la.short_conv_kernel_size
        self.num_heads, self.head_dim, self.lower_bound = H, K, la.gate_lower_bound
        self.eps = config.rms_norm_eps
        P = H * K
        self.q_proj = nn.Linear(D, P, bias=False)
        self.k_proj = nn.Linear(D, P, bias=False)
        self.v_proj = nn.Linear(D, P, bias=False)
        self.q_conv1d = ShortConvolution(P, W)
        self.k_conv1d = ShortConvolution(P, W)
        self.v_conv1d = ShortConvolution(P, W)
        self.f_a_proj = nn.Linear(D, K, bias=False)  # low-rank gate, rank = head_dim as released
        self.f_b_proj = nn.Linear(K, P, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))  # stored padded to head_dim in checkpoints (model/hf.py)
        self.dt_bias = nn.Parameter(torch.empty(P))
        self.b_proj = nn.Linear(D, H, bias=False)
        self.g_proj = nn.Linear(D, P, bias=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.empty(K))  # one gated-RMSNorm weight shared by every head
        self.o_proj = nn.Linear(P, D, bias=False)

    def _conv(self, x_TP: torch.Tensor, conv: ShortConvolution, tail: torch.Tensor | None, batch: ForwardBatch):
        """Conv over each sequence (restarting at its start or continuing from its cached tail)."""
        lengths_N = torch.tensor(batch.seq_lens, device=x_TP.device)
        y_NLP, new_tail = short_conv(batch.to_padded(x_TP), conv.weight, tail, lengths_N)
        return batch.to_packed(y_NLP), new_tail

    @staticmethod
    def _delta_rule(q_THK, k_THK, v_THV, g_THK, beta_TH, state, batch: ForwardBatch, act_dtype: torch.dtype):
        if batch.is_decode:
            return kda_step(q_THK, k_THK, v_THV, g_THK, beta_TH, state)
        # The released chunk path stores q^, k^ in the activation dtype before the kernel (spec/model.md §5).
        q_NLHK, k_NLHK = batch.to_padded(q_THK.to(act_dtype)), batch.to_padded(k_THK.to(act_dtype))
        # Zero padding rows are neutral: g = 0 keeps the state, beta = 0 writes nothing.
        o_NLHV, final = kda_chunked(
            q_NLHK, k_NLHK, batch.to_padded(v_THV), batch.to_padded(g_THK), batch.to_padded(beta_TH),
            initial_state=state, output_final_state=state is not None,
        )  # fmt: skip
        return batch.to_packed(o_NLHV), final

    def forward(self, x_TD: torch.Tensor, batch: ForwardBatch, cache: KDAState | None = None) -> torch.Tensor:
        T = x_TD.shape[0]
        H, K = self.num_heads, self.head_dim
        tails = (cache.conv_q_NWP, cache.conv_k_NWP, cache.conv_v_NWP) if cache is not None else (None,) * 3
        q1, q_tail = self._conv(self.q_proj(x_TD), self.q_conv1d, tails[0], batch)
        k1, k_tail = self._conv(self.k_proj(x_TD), self.k_conv1d, tails[1], batch)
        v1, v_tail = self._conv(self.v_proj(x_TD), self.v_conv1d, tails[2], batch)
        g_THK = kda_gate(self.f_b_proj(self.f_a_proj(x_TD)).view(T, H, K), self.A_log, self.dt_bias, self.lower_bound)
        beta_TH = torch.sigmoid(self.b_proj(x_TD).float())
        q_THK, k_THK = l2_norm(q1.view(T, H, K)), l2_norm(k1.view(T, H, K))
        v_THV = v1.view(T, H, K)
        state = cache.recurrent_NHKV if cache is not None else None
        with fp32_region():  # the delta rule and its state are fp32 whatever autocast says
            o_THV, final = self._delta_rule(q_THK, k_THK, v_THV, g_THK, beta_TH, state, batch, x_TD.dtype)
        if cache is not None:
            cache.conv_q_NWP, cache.conv_k_NWP, cache.conv_v_NWP = q_tail, k_tail, v_tail
            cache.recurrent_NHKV = final
        gate_THK = self.g_proj(x_TD).view(T, H, K)
        o_THV = gated_rms_norm(o_THV.to(x_TD.dtype), gate_THK, self.o_norm.weight, self.eps)
        return self.o_proj(o_THV.reshape(T, H * K))

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
from openk3.model.cache import KDAState, VerifyStep
from openk3.model.layers import ShortConvolution
from openk3.ops.conv import short_conv, short_conv_few
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
        # Swap point for context parallelism (parallel/cp.py): a callable (layer, x_TD, batch) -> out_TD that runs this
        # layer on one rank's contiguous shard of each sequence, from the layer's own pieces below.
        self.context_parallel = None

    def _conv(self, x_TP: torch.Tensor, conv: ShortConvolution, tail: torch.Tensor | None, batch: ForwardBatch):
        """Conv over each sequence (restarting at its start or continuing from its cached tail)."""
        if batch.is_decode or batch.verify:  # a few real tokens per sequence on a cached tail
            y_NLP, new_tail = short_conv_few(batch.to_padded(x_TP), conv.weight, tail)
            return batch.to_packed(y_NLP), new_tail
        lengths_N = torch.tensor(batch.seq_lens, device=x_TP.device)
        y_NLP, new_tail = short_conv(batch.to_padded(x_TP), conv.weight, tail, lengths_N)
        return batch.to_packed(y_NLP), new_tail

    @staticmethod
    def _delta_rule(q_THK, k_THK, v_THV, g_THK, beta_TH, state, batch: ForwardBatch, act_dtype: torch.dtype):
        if batch.is_decode:
            return kda_step(q_THK, k_THK, v_THV, g_THK, beta_TH, state)
        # The released chunk path stores q^, k^ in the activation dtype before the kernel (spec/model.md §5).
        q_THK, k_THK = q_THK.to(act_dtype), k_THK.to(act_dtype)
        if batch.uniform:
            o_NLHV, final = kda_chunked(
                batch.to_padded(q_THK), batch.to_padded(k_THK), batch.to_padded(v_THV), batch.to_padded(g_THK),
                batch.to_padded(beta_TH), initial_state=state, output_final_state=state is not None,
            )  # fmt: skip
            return batch.to_packed(o_NLHV), final
        # Ragged sequences run packed (cu_seqlens), so a long prefill chunk next to decode tokens costs no padding.
        o_1THV, final = kda_chunked(
            q_THK[None], k_THK[None], v_THV[None], g_THK[None], beta_TH[None], initial_state=state,
            output_final_state=state is not None, cu_seqlens=batch.cu_seqlens.to(q_THK.device),
        )  # fmt: skip
        return o_1THV[0], final

    def _projections(self, x_TD: torch.Tensor):
        """The per-token inputs of the conv and the delta rule: pre-conv q, k, v [T, P]; g [T, H, K]; beta [T, H]."""
        T, H, K = x_TD.shape[0], self.num_heads, self.head_dim
        g_THK = kda_gate(self.f_b_proj(self.f_a_proj(x_TD)).view(T, H, K), self.A_log, self.dt_bias, self.lower_bound)
        beta_TH = torch.sigmoid(self.b_proj(x_TD).float())
        return (self.q_proj(x_TD), self.k_proj(x_TD), self.v_proj(x_TD)), g_THK, beta_TH

    def _output(self, o_THV: torch.Tensor, x_TD: torch.Tensor) -> torch.Tensor:
        T, H, K = x_TD.shape[0], self.num_heads, self.head_dim
        gate_THK = self.g_proj(x_TD).view(T, H, K)
        o_THV = gated_rms_norm(o_THV.to(x_TD.dtype), gate_THK, self.o_norm.weight, self.eps)
        return self.o_proj(o_THV.reshape(T, H * K))

    def forward(self, x_TD: torch.Tensor, batch: ForwardBatch, cache: KDAState | None = None) -> torch.Tensor:
        if self.context_parallel is not None:
            return self.context_parallel(self, x_TD, batch)
        if batch.verify:
            return self._verify(x_TD, batch, cache)
        T, H, K = x_TD.shape[0], self.num_heads, self.head_dim
        tails, state = cache.load() if cache is not None else ((None,) * 3, None)
        (q0, k0, v0), g_THK, beta_TH = self._projections(x_TD)
        q1, q_tail = self._conv(q0, self.q_conv1d, tails[0], batch)
        k1, k_tail = self._conv(k0, self.k_conv1d, tails[1], batch)
        v1, v_tail = self._conv(v0, self.v_conv1d, tails[2], batch)
        q_THK, k_THK = l2_norm(q1.view(T, H, K)), l2_norm(k1.view(T, H, K))
        with fp32_region():  # the delta rule and its state are fp32 whatever autocast says
            o_THV, final = self._delta_rule(q_THK, k_THK, v1.view(T, H, K), g_THK, beta_TH, state, batch, x_TD.dtype)
        if cache is not None:
            cache.store((q_tail, k_tail, v_tail), final)
        return self._output(o_THV, x_TD)

    def _verify(self, x_TD: torch.Tensor, batch: ForwardBatch, cache) -> torch.Tensor:
        """Speculative verification: N sequences of G = 1 + drafts tokens each. Projections, convs and norms run
        batched over the N*G rows; the delta rule runs G decode steps (`kda_step`, fp32 q^ and k^ as in decode) on a
        register copy of the state. Each step's inputs go to `cache.record`, and nothing is written to the cache:
        the engine folds the accepted prefix from the records with the same `kda_step` (spec/serving.md §4.2)."""
        N, G, H, K = batch.num_seqs, batch.max_len, self.num_heads, self.head_dim
        assert batch.uniform and cache is not None, "verify needs equal draft lengths and a cache"
        tails, state = cache.load()
        pre, g_THK, beta_TH = self._projections(x_TD)
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        q1, k1, v1 = (self._conv(x, c, tail, batch)[0] for x, c, tail in zip(pre, convs, tails))
        # Position-major contiguous copies: each step's [N, ...] operands are then contiguous blocks, as in decode.
        q_GNHK, k_GNHK = (l2_norm(x.view(N, G, H, K)).transpose(0, 1).contiguous() for x in (q1, k1))
        v_GNHV, g_GNHK, beta_GNH, *pre_GNP = (
            x.view(N, G, *x.shape[1:]).transpose(0, 1).contiguous() for x in (v1.view(-1, H, K), g_THK, beta_TH, *pre)
        )  # fmt: skip
        outs = []
        with fp32_region():
            for t in range(G):
                step = VerifyStep(q_GNHK[t], k_GNHK[t], v_GNHV[t], g_GNHK[t], beta_GNH[t], [x[t] for x in pre_GNP])
                o_NHV, state = kda_step(step.q_NHK, step.k_NHK, step.v_NHV, step.g_NHK, step.beta_NH, state)
                cache.record(step)
                outs.append(o_NHV)
        return self._output(torch.stack(outs, 1).view(N * G, H, K), x_TD)

"""KimiDeltaAttention: the K3 linear-attention layer (spec/model.md §5, spec/kda.md).

    q0, k0, v0 = q_proj(x), k_proj(x), v_proj(x)
    q1, k1, v1 = SiLU(short causal depthwise conv) of each              (fp32 math, activation dtype out)
    g          = -5 * sigmoid(exp(A_log) * (f_b_proj(f_a_proj(x)) + dt_bias))     (fp32, per key channel)
    beta       = sigmoid(f32(b_proj(x)))
    q^, k^     = L2-normalised per head (rounded to the activation dtype on the chunk path, fp32 on decode)
    o          = DeltaRule(q^ * K^-0.5, k^, v1, g, beta)                (fp32 state)
    out        = o_proj(RMSNorm_gated(o; o_norm, sigmoid(g_proj(x))))

`forward` branches on `batch.mode`: DECODE (one new token per sequence on a cache) is the decode step (`kda_step`,
the released code's fused recurrent path; on CPU `_decode_fused` runs the whole layer as one C kernel, the torch path
being its reference); VERIFY runs G decode steps on a copy of the state and hands the cache
their inputs instead of a new state (`kda_verify`; the engine folds the accepted prefix); FULL and EXTEND run the
packed conv and the chunked op from the entering state.

What crosses a sequence boundary goes through a hand-off object: the conv tails and the entering state in, the
leaving ones out. `CacheHandOff` reads and writes the cache entry; context parallelism (parallel/cp.py) supplies
one through `batch.context_parallel` that exchanges conv halos and state summaries with the neighbouring shards.

Legend: T packed tokens, N sequences, L padded length, H heads, K = V head dim, P = H*K, D hidden, W conv width.
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.config import K3TextConfig
from openk3.model.batch import ForwardBatch, Mode
from openk3.model.cache import KDAState
from openk3.model.layers import Linear, ShortConvolution
from openk3.ops import dispatch
from openk3.ops.conv import short_conv, short_conv_few, short_conv_varlen
from openk3.ops.dispatch import kda_chunked, kda_step, kda_verify  # CPU fast path, or fla-core kernels on CUDA
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
        self.q_proj = Linear(D, P, bias=False)
        self.k_proj = Linear(D, P, bias=False)
        self.v_proj = Linear(D, P, bias=False)
        self.q_conv1d = ShortConvolution(P, W)
        self.k_conv1d = ShortConvolution(P, W)
        self.v_conv1d = ShortConvolution(P, W)
        self.f_a_proj = Linear(D, K, bias=False)  # low-rank gate, rank = head_dim as released
        self.f_b_proj = Linear(K, P, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))  # stored padded to head_dim in checkpoints (model/hf.py)
        self.dt_bias = nn.Parameter(torch.empty(P))
        self.b_proj = Linear(D, H, bias=False)
        self.g_proj = Linear(D, P, bias=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.empty(K))  # one gated-RMSNorm weight shared by every head
        self.o_proj = Linear(P, D, bias=False)

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

    def _decode_fused(self, x_TD: torch.Tensor, cache: KDAState) -> torch.Tensor | None:
        """A DECODE step as one kernel call (`ops.cpu_kernels.KDADecode`: the input projections, conv, L2 norms,
        gate, delta step, gated norm and o_proj), updating the cache entry where it lives (`decode_in_out`); None
        where the kernel does not apply (the caller runs the torch path, its reference)."""
        kernel = dispatch.prepared_kernel("kda_decode", self, x_TD.device, self._decode_weights)
        if kernel is None:
            return None
        io = cache.decode_in_out()
        if not kernel.applies(x_TD, io):
            return None
        out = kernel(x_TD, io)
        io.commit()
        return out

    def _decode_weights(self):
        """The fused kernel's weights (matrices; fp32 tensors) and how to make it over them (`prepared_kernel`)."""
        inputs = (self.q_proj, self.k_proj, self.v_proj, self.g_proj, self.f_a_proj, self.b_proj)
        projections = [p.weight for p in inputs]
        w_fb, w_o = self.f_b_proj.weight, self.o_proj.weight
        convs = [self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]
        A_log, dt_bias, norm_w = self.A_log, self.dt_bias, self.o_norm.weight

        def make(cls):
            return cls(projections, w_fb, w_o, convs, A_log, dt_bias, self.lower_bound, norm_w, self.eps,
                       self.head_dim**-0.5)  # fmt: skip

        return [*projections, w_fb, w_o], [*convs, A_log, dt_bias, norm_w], make

    def forward(self, x_TD: torch.Tensor, batch: ForwardBatch, cache: KDAState | None = None) -> torch.Tensor:
        mode = batch.mode
        if mode is Mode.DECODE and batch.context_parallel is None and cache is not None:
            out = self._decode_fused(x_TD, cache)
            if out is not None:
                return out
        T, H, K = x_TD.shape[0], self.num_heads, self.head_dim
        if batch.context_parallel is not None:
            handoff = batch.context_parallel.kda_handoff(batch)
        else:
            handoff = CacheHandOff(cache)
        pre, g_THK, beta_TH = self._projections(x_TD)
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        tails = handoff.conv_tails(pre, self.q_conv1d.weight.shape[-1])
        if mode is Mode.DECODE or mode is Mode.VERIFY:  # a few real tokens per sequence on a cached tail
            N, G = batch.num_seqs, batch.max_len
            outs = [short_conv_few(x.view(N, G, -1), c.weight, tail) for x, c, tail in zip(pre, convs, tails)]
            q1, k1, v1 = (y.view(T, -1) for y, _ in outs)
        elif mode is Mode.EXTEND:  # packed sequences of any lengths: a long chunk beside decodes costs no padding
            outs = [short_conv_varlen(x, c.weight, batch.cu_seqlens, tail) for x, c, tail in zip(pre, convs, tails)]
            q1, k1, v1 = (y for y, _ in outs)
        else:
            # FULL (training): right-padded rows. The packed form gives bitwise the same outputs, but its weight
            # gradient reduces in another order, and the fixed-seed training loss is pinned to this one.
            lengths_N = torch.tensor(batch.seq_lens, device=x_TD.device)
            outs = [short_conv(batch.to_padded(x), c.weight, tail, lengths_N) for x, c, tail in zip(pre, convs, tails)]
            q1, k1, v1 = (batch.to_packed(y) for y, _ in outs)
        new_tails = tuple(tail for _, tail in outs)
        q_THK, k_THK, v_THV = l2_norm(q1.view(T, H, K)), l2_norm(k1.view(T, H, K)), v1.view(T, H, K)
        with fp32_region():  # the delta rule and its state are fp32 whatever autocast says
            if mode is Mode.VERIFY:
                # G decode steps (fp32 q^, k^ as in decode) on a copy of the state; nothing is written. The cache
                # keeps each step's inputs and the pre-conv rows, from which the engine folds the accepted prefix.
                N, G = batch.num_seqs, batch.max_len
                o_NGHV, steps = kda_verify(
                    *(x.view(N, G, *x.shape[1:]) for x in (q_THK, k_THK, v_THV, g_THK, beta_TH)),
                    handoff.initial_state(),
                )  # fmt: skip
                cache.record(steps, tuple(x.view(N, G, -1) for x in pre))
                return self._output(o_NGHV.reshape(T, H, K), x_TD)
            if mode is Mode.DECODE:
                o_THV, final = kda_step(q_THK, k_THK, v_THV, g_THK, beta_TH, handoff.initial_state())
            else:
                # The released chunk path stores q^, k^ in the activation dtype before the kernel (spec/model.md §5).
                q_THK, k_THK = q_THK.to(x_TD.dtype), k_THK.to(x_TD.dtype)
                state = handoff.initial_state(q_THK, k_THK, v_THV, g_THK, beta_TH)
                o_THV, final = self._chunked(q_THK, k_THK, v_THV, g_THK, beta_TH, state, batch)
        handoff.store(new_tails, final)
        return self._output(o_THV, x_TD)

    @staticmethod
    def _chunked(q_THK, k_THK, v_THV, g_THK, beta_TH, state, batch: ForwardBatch):
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


class CacheHandOff:
    """The KDA hand-off on one process: tails and state from the cache entry (zeros without one) and back into
    it. `parallel/cp.py` builds the context-parallel hand-off with the same three methods."""

    def __init__(self, cache: KDAState | None):
        self.cache = cache
        self.tails, self.state = cache.load() if cache is not None else ((None,) * 3, None)

    def conv_tails(self, pre_TP, width: int):
        """The [N, W-1, P] pre-conv rows before each sequence, for q, k and v (None: zeros)."""
        return self.tails

    def initial_state(self, *chunk_inputs) -> torch.Tensor | None:
        """The [N, H, K, V] fp32 state each sequence enters with (None: zeros). The chunk path passes its inputs
        (q^, k^, v, g, beta): the context-parallel hand-off summarises its shard from them."""
        return self.state

    def store(self, tails, state_NHKV: torch.Tensor | None) -> None:
        if self.cache is not None:
            self.cache.store(tails, state_NHKV)

"""GatedMLA: K3's full-attention layer, multi-head latent attention with NoPE and a sigmoid output gate
(spec/model.md §6).

    cq   = RMSNorm_1e-6(q_a_proj(x))                      q = q_b_proj(cq) -> [T, H, nope + rope]
    ckv  = kv_a_proj_with_mqa(x) = [c ; k_pe]             c_n = RMSNorm_1e-6(c)   (the 1e-6 eps quirk)
    kv   = kv_b_proj(c_n) -> [T, H, nope + v]             k = [k_nope ; k_pe shared by every head]
    out  = o_proj( flatten(softmax(q k^T * (nope + rope)^-0.5, causal) v) * sigmoid(g_proj(x)) )

No rotary is applied anywhere: the "rope" dims are ordinary unrotated dims. The cache keeps the latent [c_n ; k_pe]
per token (model/cache.py).

One forward for every mode. The layer computes queries and new latents, then asks the hand-off for the context
latents its queries attend over (`MLAContext`: which tokens, which latents, which mask): the batch's own latents
(full), the all-gathered shard latents with the global document mask under context parallelism (parallel/cp.py),
or the cache's past + new latents (extend, verify). The context is expanded with kv_b_proj and attended once per
context. A decode step (one new token per sequence on a cache) instead uses the absorbed form over the batched
block-table view of the cache (ops/attention/mla.py), which never expands cached latents; on CPU as two C kernels
around the cache append (`_decode_fused`; the torch path is their reference).

Legend: T packed tokens, N sequences, B rows of one context, L queries per row, S context positions, H heads,
R = kv_lora_rank + rope, Dqk = nope + rope, Dv value head dim, D hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from openk3.config import K3TextConfig
from openk3.model.batch import ForwardBatch, Mode
from openk3.model.cache import MLACache
from openk3.model.layers import Linear, RMSNorm
from openk3.ops import dispatch
from openk3.ops.attention.mla import absorbed_weights, mla_decode
from openk3.ops.attention.ref import causal_attention

# q_a_layernorm and kv_a_layernorm are built without an eps argument in the released code (class default 1e-6).
MLA_LORA_NORM_EPS = 1e-6


@dataclass
class MLAContext:
    """What one group of queries attends over (the MLA hand-off): the packed tokens `tokens` (a contiguous range,
    read as B rows of L queries), the latents of their S context positions, and which positions each query sees
    (True = attend; None: causal, the L queries being the last L of the S positions). Latents a mask hides must
    be finite: zeros or a copy of a real position, never unwritten cache memory."""

    tokens: slice
    latent_BSR: torch.Tensor
    mask_BLS: torch.Tensor | None = None


def own_contexts(latent_TR: torch.Tensor, batch: ForwardBatch) -> list[MLAContext]:
    """The hand-off without a cache or context parallelism: every sequence attends over its own new latents."""
    T = latent_TR.shape[0]
    if batch.row_len is not None:
        # Packed training rows: attend per row, masked to each token's own document.
        seg_RL = batch.segment_ids(latent_TR.device)
        L = batch.row_len
        causal_LL = torch.ones(L, L, dtype=torch.bool, device=latent_TR.device).tril()
        mask = (seg_RL[:, :, None] == seg_RL[:, None, :]) & causal_LL
        return [MLAContext(slice(0, T), latent_TR.view(-1, L, latent_TR.shape[-1]), mask)]
    if batch.uniform:
        # Whole equal-length sequences (training, plain prefill): one batched causal attention.
        return [MLAContext(slice(0, T), batch.to_padded(latent_TR))]
    # Ragged sequences run one by one rather than padded to the longest.
    bounds = batch.cu_seqlens.tolist()
    return [MLAContext(slice(a, b), latent_TR[a:b][None]) for a, b in zip(bounds[:-1], bounds[1:])]


def cached_contexts(cache: MLACache, latent_TR: torch.Tensor, batch: ForwardBatch) -> list[MLAContext]:
    """The hand-off on a cache (extend, verify): the new latents are written first, then each sequence attends over
    everything it has written (past + new). Per sequence: batching ragged chunks would pad every query row and
    every context to the longest of the batch (tiny preset, CPU: a 512-token chunk beside 15 decodes took 88 ms per
    sequence and 618 ms padded; even an equal-length verify batch was 12 ms vs 33 ms, the padded contexts)."""
    cache.append(latent_TR, batch.seq_lens)
    bounds = batch.cu_seqlens.tolist()
    return [MLAContext(slice(a, b), cache.past(i)[None]) for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]


class GatedMLA(nn.Module):
    def __init__(self, config: K3TextConfig):
        super().__init__()
        D, H = config.hidden_size, config.num_attention_heads
        self.num_heads = H
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_rank = config.kv_lora_rank
        self.scale = (self.nope + self.rope) ** -0.5
        self.q_a_proj = Linear(D, config.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, MLA_LORA_NORM_EPS)
        self.q_b_proj = Linear(config.q_lora_rank, H * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = Linear(D, self.kv_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, MLA_LORA_NORM_EPS)
        self.kv_b_proj = Linear(self.kv_rank, H * (self.nope + self.v_dim), bias=False)
        self.g_proj = Linear(D, H * self.v_dim, bias=False)
        self.o_proj = Linear(H * self.v_dim, D, bias=False)
        self._absorbed: tuple[tuple, tuple[torch.Tensor, torch.Tensor]] | None = None

    def latent(self, x_TD: torch.Tensor) -> torch.Tensor:
        """The cached per-token latent [c_n ; k_pe], [T, R]."""
        c_TR, k_pe_T = self.kv_a_proj_with_mqa(x_TD).split([self.kv_rank, self.rope], dim=-1)
        return torch.cat([self.kv_a_layernorm(c_TR), k_pe_T], dim=-1)

    def expand(self, latent_SR: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys [..., S, H, Dqk] and values [..., S, H, Dv] from latents [..., S, R]."""
        c_n, k_pe = latent_SR.split([self.kv_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(c_n).unflatten(-1, (self.num_heads, self.nope + self.v_dim))
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_pe = k_pe.unsqueeze(-2).expand(*k_nope.shape[:-1], self.rope)
        return torch.cat([k_nope, k_pe], dim=-1), v

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 W_uk [H, nope, r] and W_uv [H, Dv, r] of the current kv_b_proj weight, computed once per weight
        version: the key is the parameter's identity, storage, dtype and in-place version counter, so an optimizer
        step, a weight sync, `load_state_dict` or `.to()` recomputes them. Detached: decode is inference only."""
        w = self.kv_b_proj.weight
        if w.is_inference():  # no version counter to key on: recompute every step
            return absorbed_weights(w, self.num_heads, self.nope)
        key = (id(w), w.data_ptr(), w.dtype, w.device, w._version)
        if self._absorbed is None or self._absorbed[0] != key:
            with torch.inference_mode(False):  # a normal tensor, usable in any later mode
                self._absorbed = (key, absorbed_weights(w, self.num_heads, self.nope))
        return self._absorbed[1]

    def forward(self, x_TD: torch.Tensor, batch: ForwardBatch, cache: MLACache | None = None) -> torch.Tensor:
        if batch.mode is Mode.DECODE and batch.context_parallel is None:
            out = self._decode_fused(x_TD, batch, cache)
            if out is not None:
                return out
        q_THD = self.queries(x_TD)
        latent_TR = self.latent(x_TD)
        if batch.mode is Mode.DECODE:
            # Absorbed form over the batched block-table view (spec/serving.md §1.1): no cached latent is expanded.
            cache.append(latent_TR, batch.seq_lens)
            latent_NSR, len_N = cache.block()
            return self.output(mla_decode(q_THD, latent_NSR, len_N, *self.absorbed(), self.scale), x_TD)
        if batch.mode is Mode.FULL:
            cp = batch.context_parallel
            contexts = own_contexts(latent_TR, batch) if cp is None else cp.mla_contexts(latent_TR, batch)
        else:  # EXTEND, VERIFY
            contexts = cached_contexts(cache, latent_TR, batch)
        outs = []
        for ctx in contexts:
            q_BLHD = q_THD[ctx.tokens].unflatten(0, (ctx.latent_BSR.shape[0], -1))
            k, v = self.expand(ctx.latent_BSR)
            outs.append(causal_attention(q_BLHD, k, v, self.scale, ctx.mask_BLS).flatten(0, 1))
        return self.output(torch.cat(outs) if len(outs) > 1 else outs[0], x_TD)

    def _decode_fused(self, x_TD: torch.Tensor, batch: ForwardBatch, cache: MLACache) -> torch.Tensor | None:
        """A DECODE step in two kernel calls around the cache append (`ops.cpu_kernels.MLADecode`: projections and
        norms; the absorbed attention over the cache block and the gated o_proj); None where they do not apply (the
        caller runs the torch path below, their reference). Checked before anything is appended."""
        kernel = dispatch.prepared_kernel("mla_decode", self, x_TD.device, self._decode_weights)
        if kernel is None:
            return None
        w_uk, w_uv = self.absorbed()
        if not kernel.applies(x_TD, w_uk, w_uv):
            return None
        q_TQ, latent_TR, g_TG = kernel.inputs(x_TD)
        cache.append(latent_TR, batch.seq_lens)
        latent_NSR, len_N = cache.block()
        return kernel.output(q_TQ, latent_NSR, len_N.tolist(), w_uk, w_uv, self.scale, g_TG)

    def _decode_weights(self):
        """The fused kernels' weights (no fp32 ones: the absorbed W_uk, W_uv are passed per step, as they follow
        kv_b_proj's values) and how to make them (`ops.dispatch.prepared_kernel`)."""
        tensors = [self.q_a_proj.weight, self.q_a_layernorm.weight, self.q_b_proj.weight,
                   self.kv_a_proj_with_mqa.weight, self.kv_a_layernorm.weight, self.g_proj.weight,
                   self.o_proj.weight]  # fmt: skip
        return tensors, [], lambda cls: cls(*tensors, MLA_LORA_NORM_EPS)

    def queries(self, x_TD: torch.Tensor) -> torch.Tensor:
        """[T, H, nope + rope]."""
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_TD)))
        return q.view(x_TD.shape[0], self.num_heads, self.nope + self.rope)

    def output(self, attn_THV: torch.Tensor, x_TD: torch.Tensor) -> torch.Tensor:
        """The sigmoid output gate and o_proj: [T, H, Dv] -> [T, D]."""
        gated = attn_THV.reshape(x_TD.shape[0], -1) * torch.sigmoid(self.g_proj(x_TD))
        return self.o_proj(gated)

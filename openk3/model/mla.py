"""GatedMLA: K3's full-attention layer, multi-head latent attention with NoPE and a sigmoid output gate
(spec/model.md §6).

    cq   = RMSNorm_1e-6(q_a_proj(x))                      q = q_b_proj(cq) -> [T, H, nope + rope]
    ckv  = kv_a_proj_with_mqa(x) = [c ; k_pe]             c_n = RMSNorm_1e-6(c)   (the 1e-6 eps quirk)
    kv   = kv_b_proj(c_n) -> [T, H, nope + v]             k = [k_nope ; k_pe shared by every head]
    out  = o_proj( flatten(softmax(q k^T * (nope + rope)^-0.5, causal) v) * sigmoid(g_proj(x)) )

No rotary is applied anywhere: the "rope" dims are ordinary unrotated dims. The cache keeps the latent [c_n ; k_pe]
per token (model/cache.py). Prefill and training expand the latents with kv_b_proj; a decode step (one new token per
sequence on a cache) uses the absorbed form, whose cost does not include expanding every cached latent.

Legend: T packed tokens, N sequences, L padded length, S cached + new tokens, H heads, R = kv_lora_rank + rope,
Dqk = nope + rope, Dv value head dim, D hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.config import K3TextConfig
from openk3.model.batch import ForwardBatch
from openk3.model.cache import MLACache
from openk3.model.layers import RMSNorm
from openk3.ops.attention.ref import causal_attention
from openk3.utils import fp32_op

# q_a_layernorm and kv_a_layernorm are built without an eps argument in the released code (class default 1e-6).
MLA_LORA_NORM_EPS = 1e-6


class GatedMLA(nn.Module):
    def __init__(self, config: K3TextConfig):
        super().__init__()
        D, H = config.hidden_size, config.num_attention_heads
        self.num_heads = H
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_rank = config.kv_lora_rank
        self.scale = (self.nope + self.rope) ** -0.5
        self.q_a_proj = nn.Linear(D, config.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, MLA_LORA_NORM_EPS)
        self.q_b_proj = nn.Linear(config.q_lora_rank, H * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.kv_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, MLA_LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_rank, H * (self.nope + self.v_dim), bias=False)
        self.g_proj = nn.Linear(D, H * self.v_dim, bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, D, bias=False)
        # Swap point for context parallelism (parallel/cp.py): (layer, x_TD, batch) -> out_TD on one rank's shard.
        self.context_parallel = None

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

    @fp32_op
    def _decode_absorbed(self, q_HD: torch.Tensor, cache, i: int, new_1R: torch.Tensor) -> torch.Tensor:
        """One decode token of sequence i in the absorbed form (spec/serving.md §1.1): the query moves into latent
        space once, q_lat = W_uk^T q_nope, so the cached latents are never expanded to per-head keys and values.
        Both passes over the cache are single GEMMs on the contiguous [S, R] latents (scores against [q_lat; q_pe],
        then p @ latents, keeping the c_n columns), so a step costs two reads of the cache. fp32 math, [1, H, Dv]."""
        cache.append(i, new_1R)
        latent_SR = cache.past(i).float()
        w_HXR = self.kv_b_proj.weight.float().view(self.num_heads, self.nope + self.v_dim, self.kv_rank)
        q_nope_H, q_pe_H = q_HD.float().split([self.nope, self.rope], dim=-1)
        q_lat_HR = torch.einsum("hn,hnr->hr", q_nope_H, w_HXR[:, : self.nope])
        # [H, R] @ [R, S], not latent @ q: CPU BLAS handles the skinny product several times faster this way.
        scores_HS = (torch.cat([q_lat_HR, q_pe_H], dim=-1) * self.scale) @ latent_SR.T
        o_lat_HR = (torch.softmax(scores_HS, dim=-1) @ latent_SR)[:, : self.kv_rank]
        return torch.einsum("hr,hvr->hv", o_lat_HR, w_HXR[:, self.nope :]).to(q_HD.dtype)[None]

    def forward(self, x_TD: torch.Tensor, batch: ForwardBatch, cache: MLACache | None = None) -> torch.Tensor:
        if self.context_parallel is not None:
            return self.context_parallel(self, x_TD, batch)
        T = x_TD.shape[0]
        q_THD = self.queries(x_TD)
        latent_TR = self.latent(x_TD)
        if cache is None and batch.uniform:
            # Whole equal-length sequences (training, plain prefill): one batched causal attention.
            k, v = self.expand(batch.to_padded(latent_TR))
            attn = causal_attention(batch.to_padded(q_THD), k, v, self.scale)
            attn_THV = batch.to_packed(attn)
        elif cache is None and batch.row_len is not None:
            # Packed training rows: attend per row, masked to each token's own document.
            L = batch.row_len
            k, v = self.expand(latent_TR.view(-1, L, latent_TR.shape[-1]))
            attn = causal_attention(q_THD.view(-1, L, *q_THD.shape[1:]), k, v, self.scale, batch.segment_ids(x_TD.device))
            attn_THV = attn.reshape(T, *attn.shape[2:])
        elif batch.is_decode:
            attn_THV = torch.cat([self._decode_absorbed(q_THD[i], cache, i, latent_TR[i : i + 1]) for i in range(T)])
        else:
            outs = []
            for i, (start, end) in enumerate(zip(batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist())):
                full_SR = latent_TR[start:end]
                if cache is not None:
                    full_SR = torch.cat([cache.past(i), full_SR], dim=0)
                    cache.append(i, latent_TR[start:end])
                k, v = self.expand(full_SR)
                outs.append(causal_attention(q_THD[start:end], k, v, self.scale))
            attn_THV = torch.cat(outs, dim=0)
        return self.output(attn_THV, x_TD)

    def queries(self, x_TD: torch.Tensor) -> torch.Tensor:
        """[T, H, nope + rope]."""
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_TD)))
        return q.view(x_TD.shape[0], self.num_heads, self.nope + self.rope)

    def output(self, attn_THV: torch.Tensor, x_TD: torch.Tensor) -> torch.Tensor:
        """The sigmoid output gate and o_proj: [T, H, Dv] -> [T, D]."""
        gated = attn_THV.reshape(x_TD.shape[0], -1) * torch.sigmoid(self.g_proj(x_TD))
        return self.o_proj(gated)

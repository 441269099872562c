"""Absorbed-latent MLA decode over the paged latent cache (spec/serving.md §1.1): one new query per sequence attends
over that sequence's cached latents [c_n ; k_pe] without expanding them into per-head keys and values.

With kv_b_proj's weight split per head into W_uk [H, nope, r] (keys) and W_uv [H, Dv, r] (values), the score of a
query against cached latent j is q_nope · (W_uk c_j) + q_pe · k_pe_j = [W_uk^T q_nope ; q_pe] · latent_j, and the
output is W_uv (Σ_j p_j c_j). So the query moves into latent space once, both passes over the cache are batched
GEMMs on the [N, S, R] latent block, and a step reads the cache twice whatever the head count.

`mla_decode` runs every sequence of a batch at once over a right-padded block with per-sequence lengths;
`mla_decode_ref` is the same formula written out per sequence on unpadded latents, the reference it is tested
against. Positions at or past a sequence's length get probability exactly 0: their scores are replaced with -inf
(`masked_fill`, not added to), so a NaN score there cannot reach the softmax. Their latents must still be finite,
since 0 · NaN is NaN in the second GEMM: the paged view pads with a copy of a written position
(serve/kv/views.py), never unwritten memory.

Legend: N sequences, S longest context (cached + new), H heads, r kv_lora_rank, R = r + rope, Dv value head dim.
"""

from __future__ import annotations

import torch

from openk3.utils import fp32_op


def absorbed_weights(kv_b_weight: torch.Tensor, num_heads: int, nope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj.weight [H * (nope + Dv), r] -> fp32 W_uk [H, nope, r] and W_uv transposed, [H, r, Dv] (the layout
    the output GEMM reads), both contiguous."""
    w_HXr = kv_b_weight.detach().float().view(num_heads, -1, kv_b_weight.shape[-1])
    return w_HXr[:, :nope].contiguous(), w_HXr[:, nope:].transpose(1, 2).contiguous()


@fp32_op
def mla_decode(
    q_NHD: torch.Tensor,
    latent_NSR: torch.Tensor,
    len_N: torch.Tensor,
    w_uk_HNr: torch.Tensor,
    w_uv_HrV: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [N, H, nope + rope], latents [N, S, R] (sequence n's first len_N[n] positions are real), fp32 W_uk and
    W_uv^T from `absorbed_weights` -> [N, H, Dv] in q's dtype. fp32 math; every product is one bmm (cheaper than
    einsum's dispatch at decode sizes)."""
    nope, r = w_uk_HNr.shape[1], w_uk_HNr.shape[2]
    S = latent_NSR.shape[1]
    latent = latent_NSR.float()
    q = q_NHD.float()
    q_lat_HNr = torch.bmm(q[..., :nope].transpose(0, 1), w_uk_HNr)
    q_NHR = torch.cat([q_lat_HNr.transpose(0, 1), q[..., nope:]], dim=-1) * scale
    scores_NHS = torch.bmm(q_NHR, latent.transpose(1, 2))
    # Replaced, not added to: a padded position's score never enters the softmax, whatever its value.
    pad_N1S = (torch.arange(S, device=latent.device)[None, :] >= len_N.to(latent.device)[:, None])[:, None]
    scores_NHS.masked_fill_(pad_N1S, float("-inf"))
    o_lat_NHr = torch.bmm(torch.softmax(scores_NHS, dim=-1), latent)[..., :r]
    return torch.bmm(o_lat_NHr.transpose(0, 1), w_uv_HrV).transpose(0, 1).to(q_NHD.dtype)


@fp32_op
def mla_decode_ref(
    q_NHD: torch.Tensor, latents: list[torch.Tensor], kv_b_weight: torch.Tensor, nope: int, scale: float
) -> torch.Tensor:
    """The specification: sequence by sequence, unpadded latents [S_i, R], the absorbed weights taken from
    kv_b_proj's weight on the spot. [N, H, Dv] in q's dtype."""
    H = q_NHD.shape[1]
    w_HXr = kv_b_weight.float().view(H, -1, kv_b_weight.shape[-1])
    r = w_HXr.shape[-1]
    outs = []
    for q_HD, latent_SR in zip(q_NHD.float(), latents, strict=True):
        latent_SR = latent_SR.float()
        q_lat_Hr = torch.einsum("hn,hnr->hr", q_HD[:, :nope], w_HXr[:, :nope])
        p_HS = torch.softmax(torch.cat([q_lat_Hr, q_HD[:, nope:]], dim=-1) @ latent_SR.T * scale, dim=-1)
        outs.append(torch.einsum("hr,hvr->hv", (p_HS @ latent_SR)[:, :r], w_HXr[:, nope:]))
    return torch.stack(outs).to(q_NHD.dtype)

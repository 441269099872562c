"""Causal softmax attention for the MLA layers, with a key prefix from a cache or an explicit mask.

Without a mask, queries are the last Tq of the Tk key positions, so query i may see keys j <= Tk - Tq + i. With a
mask [..., Tq, Tk] (True = attend), the mask alone decides: packed documents, context-parallel shards and ragged
cached contexts build theirs where they know the layout (model/mla.py, parallel/cp.py). q, k, v are upcast to
fp32, the softmax is exact, and the output is rounded to v's dtype: the closest CPU match to FlashAttention-2's
bf16-in / fp32-accumulate / bf16-out (spec/model.md §6). `causal_attention` uses PyTorch's SDPA kernel;
`causal_attention_ref` is the same formula written out, the reference the kernel is tested against.

Legend: Tq queries, Tk keys (cached + new), H heads, Dqk query/key head dim, Dv value head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.utils import fp32_op


def _causal_mask(Tq: int, Tk: int, device: torch.device) -> torch.Tensor:
    q_pos = torch.arange(Tk - Tq, Tk, device=device)
    return torch.arange(Tk, device=device)[None, :] <= q_pos[:, None]  # [Tq, Tk], True = attend


@fp32_op
def causal_attention(
    q_TqHD: torch.Tensor, k_TkHD: torch.Tensor, v_TkHV: torch.Tensor, scale: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Leading batch dims are allowed: [..., T, H, D]. `mask` [..., Tq, Tk] bool replaces the causal rule; every
    query row must allow at least one key, and keys it masks must still be finite (0 · NaN is NaN)."""
    Tq, Tk = q_TqHD.shape[-3], k_TkHD.shape[-3]
    q, k, v = (t.float().transpose(-3, -2) for t in (q_TqHD, k_TkHD, v_TkHV))  # [..., H, T, D]
    if mask is not None:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(-3), scale=scale)  # over heads
    elif Tq == Tk:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=_causal_mask(Tq, Tk, q.device), scale=scale)
    return o.transpose(-3, -2).to(v_TkHV.dtype)


@fp32_op
def causal_attention_ref(
    q_TqHD: torch.Tensor, k_TkHD: torch.Tensor, v_TkHV: torch.Tensor, scale: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """One sequence [T, H, D]; `mask` [Tq, Tk] as in `causal_attention`."""
    Tq, Tk = q_TqHD.shape[0], k_TkHD.shape[0]
    allowed = _causal_mask(Tq, Tk, q_TqHD.device) if mask is None else mask
    scores_HTqTk = torch.einsum("qhd,khd->hqk", q_TqHD.float(), k_TkHD.float()) * scale
    p = torch.softmax(torch.where(allowed, scores_HTqTk, float("-inf")), dim=-1)
    return torch.einsum("hqk,khv->qhv", p, v_TkHV.float()).to(v_TkHV.dtype)

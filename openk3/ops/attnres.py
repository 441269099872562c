"""Block Attention Residuals: the depth mix over [bank..., partial] (spec/model.md §4).

    V      = stack(R_0, ..., R_{n-1}, P)                    # sources, bank in append order, partial last
    K      = V * rsqrt(mean_c V^2 + eps)                    # RMSNorm without weight, per source row
    logit  = K . (gamma * w)                                # no temperature
    out    = softmax_over_sources(logit) @ V                # weighted sum of the RAW sources

The whole chain runs in fp32 and is rounded to P's dtype once. With w = 0 it is the plain mean of the sources; with
one source it returns that source exactly. Per token only: no state crosses tokens.

Legend: T tokens, S sources (bank + 1), D hidden.
"""

from __future__ import annotations

import torch

from openk3.utils import fp32_op


@fp32_op
def attn_res_mix(
    bank: list[torch.Tensor], partial_TD: torch.Tensor, norm_weight_D: torch.Tensor, query_D: torch.Tensor, eps: float
) -> torch.Tensor:
    V_TSD = torch.stack([*bank, partial_TD], dim=-2).float()
    K_TSD = V_TSD * torch.rsqrt(V_TSD.pow(2).mean(-1, keepdim=True) + eps)
    q_D = norm_weight_D.float().reshape(-1) * query_D.float().reshape(-1)
    p_TS = torch.softmax(K_TSD @ q_D, dim=-1)
    return (p_TS.unsqueeze(-2) @ V_TSD).squeeze(-2).to(partial_TD.dtype)

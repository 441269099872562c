"""K3's router (`KimiMoEGate`, spec/model.md §7.3): fp32 sigmoid scores, biased top-k for selection only,
renormalised unbiased weights. Also the biased top-(k+1) cutoff used by quantile balancing (spec/balancing.md).

Legend: T tokens, E experts, k experts per token.
"""

from __future__ import annotations

import torch


def router_scores(x_TD: torch.Tensor, weight_ED: torch.Tensor) -> torch.Tensor:
    """s = sigmoid(f32(x) @ f32(W)^T), [T, E] fp32."""
    return torch.sigmoid(x_TD.float() @ weight_ED.float().t())


def route_topk(
    scores_TE: torch.Tensor, bias_E: torch.Tensor, k: int, renormalize: bool = True, scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Select by s + bias, weight by the unbiased s. Returns (indices [T, k] ascending by expert id, weights [T, k]).

    Indices are sorted ascending so the fp32 sum over experts has a fixed order (spec/model.md §16.2).
    """
    choice_TE = scores_TE + bias_E.float()
    idx_Tk = torch.topk(choice_TE, k, dim=-1, sorted=False).indices.sort(dim=-1).values
    w_Tk = scores_TE.gather(-1, idx_Tk)
    if renormalize:
        w_Tk = w_Tk / (w_Tk.sum(-1, keepdim=True) + 1e-20)
    return idx_Tk, w_Tk * scaling

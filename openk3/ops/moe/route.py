"""K3's router (`KimiMoEGate`, spec/model.md §7.3): fp32 sigmoid scores, biased top-k for selection only,
renormalised unbiased weights; routing replay (given experts, recomputed weights; spec/rl.md §3). Also the biased
top-(k+1) cutoff used by quantile balancing (spec/balancing.md).

Legend: T tokens, E experts, k experts per token.
"""

from __future__ import annotations

import torch

from openk3.utils import fp32_op


@fp32_op
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
    return idx_Tk, route_weights(scores_TE, idx_Tk, renormalize, scaling)


def route_replay(
    scores_TE: torch.Tensor, idx_Tk: torch.Tensor, renormalize: bool = True, scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing replay (R3, spec/rl.md §3): the experts are given (recorded at rollout), the weights come from this
    forward's scores at them, so the router still gets gradients. Returns (indices [T, k] int64, sorted ascending
    by expert id like `route_topk`'s so the fp32 combine order is the natural one; weights [T, k]). The given
    indices may be any integer dtype and order; each token's k experts must be distinct and in [0, E)."""
    idx_Tk = idx_Tk.to(device=scores_TE.device, dtype=torch.long).sort(dim=-1).values
    return idx_Tk, route_weights(scores_TE, idx_Tk, renormalize, scaling)


def route_weights(scores_TE: torch.Tensor, idx_Tk: torch.Tensor, renormalize: bool, scaling: float) -> torch.Tensor:
    """The unbiased scores at the chosen experts, renormalised to sum to 1 and scaled: [T, k]. The one weight rule
    of natural (`route_topk`) and replayed (`route_replay`) routing, so the two agree bit for bit on equal idx."""
    w_Tk = scores_TE.gather(-1, idx_Tk)
    if renormalize:
        w_Tk = w_Tk / (w_Tk.sum(-1, keepdim=True) + 1e-20)
    return w_Tk * scaling


def route_topk_cutoff(scores_TE: torch.Tensor, bias_E: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Training-time top-(k+1) of s + bias (spec/balancing.md §2.1 step 1). Returns (indices [T, k] ascending by
    expert id, the same experts `route_topk` selects; cutoff [T], the (k+1)-th largest biased score alpha_i, i.e. what
    an expert's biased score must beat to enter token i's top-k). Computes in the promoted dtype of scores and
    bias: fp32 in the model (also for scores that autocast left in bf16, like `route_topk`), fp64 in offline studies."""
    vals_Tk1, idx_Tk1 = torch.topk(scores_TE + bias_E, k + 1, dim=-1, sorted=True)  # k1 = k+1
    return idx_Tk1[:, :k].sort(dim=-1).values, vals_Tk1[:, k]

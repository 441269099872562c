"""The KDA short convolution: causal, depthwise, kernel W (4 in K3), no bias, SiLU (spec/model.md §5).

    y[t, c] = SiLU( sum_{j=0..W-1} w[c, j] * x[t - W + 1 + j, c] )

Weight index W-1 multiplies the current token (PyTorch Conv1d cross-correlation with left padding W-1). Inputs before
the sequence start are zero, or the cached tail of the previous call. Accumulation and SiLU are fp32 (the weights are
fp32); the output is rounded to the input dtype.

Legend: N sequences, T tokens of one sequence, C channels, W kernel width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.utils import fp32_op


@fp32_op
def short_conv(
    x_NTC: torch.Tensor,
    weight_C1W: torch.Tensor,
    tail_NWC: torch.Tensor | None = None,
    lengths_N: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + SiLU over a batch of sequences.

    `tail_NWC` holds the last W-1 *pre-conv* inputs of each sequence's earlier tokens ([N, W-1, C]; None = zeros).
    `lengths_N` marks right-padded rows: sequence n's real tokens are its first lengths_N[n] (None = all T). The
    outputs of real tokens never see the padding after them (the conv is causal).
    Returns (y [N, T, C] in x's dtype, new tail [N, W-1, C] in x's dtype: the last W-1 real inputs of
    [old tail; x]) so a later call continues exactly.
    """
    N, T, C = x_NTC.shape
    W = weight_C1W.shape[-1]
    if tail_NWC is None:
        tail_NWC = x_NTC.new_zeros(N, W - 1, C)
    if T == 0:
        return x_NTC, tail_NWC.to(x_NTC.dtype).clone()
    full_NSC = torch.cat([tail_NWC.to(x_NTC.dtype), x_NTC], dim=1)  # S = W-1 + T
    y = F.conv1d(full_NSC.float().transpose(1, 2), weight_C1W.float(), groups=C)  # [N, C, T]
    y = F.silu(y).transpose(1, 2).to(x_NTC.dtype)
    if lengths_N is None:
        return y, full_NSC[:, -(W - 1) :].clone()
    idx_NW = lengths_N[:, None] + torch.arange(W - 1, device=x_NTC.device)[None, :]
    return y, full_NSC.gather(1, idx_NW[:, :, None].expand(-1, -1, C))


@fp32_op
def short_conv_few(x_NTC: torch.Tensor, weight_C1W: torch.Tensor, tail_NWC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`short_conv` for a few tokens per sequence (a decode step, a speculative verify), every row real, written as
    a multiply-add over the W taps instead of a conv1d launch: the decode loop runs it three times per KDA layer per
    token, where conv1d's fixed cost dominates. Same fp32 math; agrees with `short_conv` to rounding (tested).
    Returns (y [N, T, C] in x's dtype, new tail [N, W-1, C])."""
    W = weight_C1W.shape[-1]
    full_NSC = torch.cat([tail_NWC.to(x_NTC.dtype), x_NTC], dim=1)  # S = W-1 + T
    windows_NTCW = full_NSC.float().unfold(1, W, 1)
    y_NTC = F.silu((windows_NTCW * weight_C1W[:, 0].float()).sum(-1)).to(x_NTC.dtype)
    return y_NTC, full_NSC[:, -(W - 1) :]


def short_conv_ref(x_TC: torch.Tensor, weight_C1W: torch.Tensor) -> torch.Tensor:
    """Token-loop reference for one sequence from a zero tail (the formula above, read literally)."""
    T, C = x_TC.shape
    W = weight_C1W.shape[-1]
    w_CW = weight_C1W.float()[:, 0]
    x32 = x_TC.float()
    out = []
    for t in range(T):
        acc = torch.zeros(C, dtype=torch.float32)
        for j in range(W):
            src = t - W + 1 + j
            if src >= 0:
                acc = acc + w_CW[:, j] * x32[src]
        out.append(F.silu(acc))
    return torch.stack(out).to(x_TC.dtype) if out else x_TC.new_zeros(0, C)

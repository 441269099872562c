"""Small modules shared by the K3 layers: Linear (the dispatched projection), RMSNorm, the short depthwise convolution, the SiTU dense MLP.

Parameter names match the released checkpoint (`weight`, `gate_proj`, `up_proj`, `down_proj`).
Legend: T tokens, D hidden, F FFN hidden, C channels, W conv width.
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.ops import dispatch
from openk3.ops.norm import rms_norm
from openk3.ops.situ import situ_glu


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, names and init) whose product goes through `ops.dispatch.linear`: on CPU, bf16
    decode-sized inputs run the bf16 GEMV kernel (`ops.cpu_kernels`), bf16 products on a CPU without bf16 arithmetic
    run in fp32 (`ops.widen`), everything else `F.linear` (the reference)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """K3's `KimiRMSNorm` (normalise in fp32, cast, then multiply by the weight)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class ShortConvolution(nn.Module):
    """Holds the depthwise conv weight [C, 1, W] (fp32 in the release); the math is `ops.conv.short_conv`."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))


class DenseMLP(nn.Module):
    """down_proj(SiTU-GLU(gate_proj(x), up_proj(x))): layer 0's FFN and the fused shared experts."""

    def __init__(self, hidden: int, intermediate: int, beta: float, linear_beta: float):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self.beta, self.linear_beta = beta, linear_beta

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        if 0 < x_TD.shape[0] <= 8 and x_TD.dim() == 2:  # decode: the fused CPU kernel (k = 1, unweighted) if it applies
            weights = [self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight]
            fused = dispatch.fused_experts(x_TD[:1], weights)
            if fused is not None:
                rows = [fused(x_TD[t : t + 1], *([w] for w in weights), None, self.beta, self.linear_beta)
                        for t in range(x_TD.shape[0])]  # fmt: skip
                return rows[0] if len(rows) == 1 else torch.cat(rows)
        h_TF = situ_glu(self.gate_proj(x_TD), self.up_proj(x_TD), self.beta, self.linear_beta)
        return self.down_proj(h_TF)

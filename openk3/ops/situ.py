"""SiTU-GLU, K3's soft-capped SwiGLU (spec/model.md §7.2; K3 report Eq. 12):

    SiTU-GLU(a, b) = [b1 * tanh(a / b1) * sigmoid(a)] * [b2 * tanh(b / b2)],    b1 = 4.0, b2 = 25.0

`a` is the gate GEMM output, `b` the up GEMM output. fp32 math, the product rounded to the input dtype. Only the
linear factor of Swish is capped; the sigmoid sees the raw `a`. |gate'| < b1, |up'| < b2.
"""

from __future__ import annotations

import torch


def situ_glu(a: torch.Tensor, b: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    compute = torch.promote_types(a.dtype, torch.float32)  # fp32, or fp64 for fp64 checks
    a32, b32 = a.to(compute), b.to(compute)
    gate = beta * torch.tanh(a32 / beta) * torch.sigmoid(a32)
    up = linear_beta * torch.tanh(b32 / linear_beta)
    return (gate * up).to(a.dtype)

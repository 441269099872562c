"""Normalisations used by K3, each with the released code's rounding order (spec/model.md §3.1, §5, §11).

- `rms_norm`: K3's `KimiRMSNorm`: normalise in fp32, cast back to the input dtype, then multiply by the weight in
  the weight's dtype (the cast comes BEFORE the weight multiply).
- `gated_rms_norm`: the KDA output norm (FLA's FusedRMSNormGated with a sigmoid gate): fp32 math throughout with the
  fp32 weight shared by all heads, rounded to the input dtype once at the end.
- `l2_norm`: the q/k normalisation of KDA: x / sqrt(sum x^2 + eps), eps INSIDE the square root of the sum.

Shapes: x_[..., C] with C the normalised channels; the weight is [C].
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float() * torch.sigmoid(gate.float())).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Returns fp32 (or wider); callers round to the activation dtype where the released path does."""
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    return x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)

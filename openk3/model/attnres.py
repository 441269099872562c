"""Block Attention Residuals' bookkeeping (spec/model.md §4): which sources each depth mix sees, when a finished
block enters the bank, and where the partial sum restarts. The mix itself is `ops.attnres.attn_res_mix`.

There is no plain residual stream. Per layer l (block size B), with P the partial sum of the current block:
    h  = Mix(P, bank; self_attention_res_*) if bank else P       (only layer 0 sees an empty bank)
    if l % B == 0: bank = bank + [P]                             (AFTER the mix: the incoming P, a finished block)
    P  = a if l % B == 0 else P + a                              (a = mixer output; a block restarts the partial)
    h2 = Mix(P, bank; mlp_res_*);   P = P + FFN(h2)
and after the last layer Mix(P, bank; output_attn_res_*) feeds the final norm. Each site's key norm and
pseudo-query stay on the layer under their checkpoint names (`*_res_norm`, `*_res_proj`).

Legend: T tokens, D hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.model.layers import RMSNorm
from openk3.ops import dispatch
from openk3.ops.attnres import attn_res_mix


def mix(bank: list[torch.Tensor], partial_TD: torch.Tensor, norm: RMSNorm, proj: nn.Linear) -> torch.Tensor:
    """Mix(P, bank) with one site's key norm and pseudo-query; P itself when the bank is empty (layer 0's attention
    site, whose parameters then never get a gradient: kept so checkpoints load)."""
    if not bank:
        return partial_TD
    return attn_res_mix(bank, partial_TD, norm.weight, proj.weight, norm.eps)


def mix_norm(bank: list[torch.Tensor], partial_TD: torch.Tensor, norm: RMSNorm, proj: nn.Linear,
             out_norm: RMSNorm) -> torch.Tensor:  # fmt: skip
    """out_norm(mix(bank, partial)): every mix feeds an RMSNorm (the layer's two, the final one). Decode-sized rows on
    CPU take one fused kernel (`ops.cpu_kernels.MixNorm`) with the same math and roundings; this composition is
    its reference."""
    sources = [*bank, partial_TD]
    kernel = dispatch.prepared_kernel("mix_norm", norm, partial_TD.device, lambda: mix_norm_weights(norm, proj, out_norm),
                                      (proj, out_norm))  # fmt: skip
    if kernel is not None and kernel.applies(sources):
        return kernel(sources)
    return out_norm(mix(bank, partial_TD, norm, proj))


def mix_norm_weights(norm: RMSNorm, proj: nn.Linear, out_norm: RMSNorm):
    """The fused mix_norm's weights and how to make it over them (`ops.dispatch.prepared_kernel`)."""
    tensors = [norm.weight, proj.weight, out_norm.weight]
    return tensors, [], lambda cls: cls(norm.weight, proj.weight, norm.eps, out_norm.weight, out_norm.eps)


def close_block(bank: list[torch.Tensor], partial_TD: torch.Tensor, block_start: bool) -> list[torch.Tensor]:
    """The bank after a block start: the incoming partial sum is a finished block and joins it. A new list, never
    an update of `bank` in place (wrappers such as FSDP2 may hand a layer a copy of its arguments)."""
    return [*bank, partial_TD] if block_start else bank


def add_to_partial(partial_TD: torch.Tensor, a_TD: torch.Tensor, block_start: bool) -> torch.Tensor:
    """The partial sum after a mixer output `a`: a block start restarts it at `a`."""
    return a_TD if block_start else partial_TD + a_TD

"""The KDA short convolution: causal, depthwise, kernel W (4 in K3), no bias, SiLU (spec/model.md §5).

    y[t, c] = SiLU( sum_{j=0..W-1} w[c, j] * x[t - W + 1 + j, c] )

Weight index W-1 multiplies the current token (PyTorch Conv1d cross-correlation with left padding W-1). Inputs before
the sequence start are zero, or the cached tail of the previous call. Accumulation and SiLU are fp32 (the weights are
fp32); the output is rounded to the input dtype.

Three forms of one op: `short_conv` on right-padded [N, T, C] rows, `short_conv_varlen` on packed [T, C] tokens
with `cu_seqlens` (no padding: a long prefill chunk beside decodes costs its own length only), and `short_conv_few`
for a decode or verify step. `roll_tail` is the tail update they share with the speculative fold.

Legend: N sequences, T tokens (of one sequence, or packed), S stream length, C channels, W kernel width.
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
    return y, _last_rows(full_NSC, lengths_N, W - 1)


@fp32_op
def short_conv_varlen(
    x_TC: torch.Tensor, weight_C1W: torch.Tensor, cu_seqlens: torch.Tensor, tail_NWC: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`short_conv` on packed sequences: sequence n is x_TC[cu_seqlens[n] : cu_seqlens[n+1]] (any length, 0
    included) continuing from tail_NWC[n] (None = zeros). Returns (y [T, C], new tails [N, W-1, C]), both in x's
    dtype, equal to `short_conv` on the right-padded rows.

    One conv1d runs over a stream that puts each sequence's W-1 tail rows in front of its tokens, so no output
    window crosses a sequence boundary and the cost is T + N*(W-1) positions rather than N * max length; every
    output is the same W-tap fp32 sum as in the padded form (bitwise equal on CPU, tested). Its weight gradient
    sums the same products in another order (equal to rounding), so training keeps the padded form."""
    T, C = x_TC.shape
    W, N = weight_C1W.shape[-1], cu_seqlens.numel() - 1
    device = x_TC.device
    cu_N1 = cu_seqlens.to(device)
    if tail_NWC is None:
        tail_NWC = x_TC.new_zeros(N, W - 1, C)
    if T == 0:
        return x_TC, tail_NWC.to(x_TC.dtype).clone()
    seq_T = torch.repeat_interleave(torch.arange(N, device=device), cu_N1[1:] - cu_N1[:-1], output_size=T)
    token_S = torch.arange(T, device=device) + (seq_T + 1) * (W - 1)  # stream position of every token
    tail_NW = (cu_N1[:-1] + torch.arange(N, device=device) * (W - 1))[:, None] + torch.arange(W - 1, device=device)
    stream_SC = x_TC.new_zeros(T + N * (W - 1), C)
    stream_SC = stream_SC.index_copy(0, tail_NW.reshape(-1), tail_NWC.to(x_TC.dtype).reshape(-1, C))
    stream_SC = stream_SC.index_copy(0, token_S, x_TC)
    y_CS = F.conv1d(stream_SC.float().t()[None], weight_C1W.float(), groups=C)[0]  # output s reads stream s..s+W-1
    y_TC = F.silu(y_CS.index_select(1, token_S - (W - 1)).t()).to(x_TC.dtype)
    # The last W-1 stream rows of sequence n: its tail and tokens [cu[n]+n(W-1), cu[n+1]+(n+1)(W-1)).
    new_tail_NW = tail_NW + (cu_N1[1:] - cu_N1[:-1])[:, None]
    return y_TC, stream_SC.index_select(0, new_tail_NW.reshape(-1)).view(N, W - 1, C)


def roll_tail(tail_NWC: torch.Tensor, x_NTC: torch.Tensor, lengths_N: torch.Tensor) -> torch.Tensor:
    """The conv tail after sequence n takes in its first lengths_N[n] rows of x_NTC: the last W-1 rows of
    [tail; x[:lengths_N[n]]], copied exactly (the speculative fold rolls the accepted prefix with it)."""
    full_NSC = torch.cat([tail_NWC, x_NTC.to(tail_NWC.dtype)], dim=1)
    return _last_rows(full_NSC, lengths_N, tail_NWC.shape[1])


def _last_rows(full_NSC: torch.Tensor, lengths_N: torch.Tensor, count: int) -> torch.Tensor:
    """Rows lengths_N[n] .. lengths_N[n] + count - 1 of each [tail; x] row: its last `count` real rows."""
    idx_NW = lengths_N[:, None] + torch.arange(count, device=full_NSC.device)[None, :]
    return full_NSC.gather(1, idx_NW[:, :, None].expand(-1, -1, full_NSC.shape[-1]))


@fp32_op
def short_conv_few(
    x_NTC: torch.Tensor, weight_C1W: torch.Tensor, tail_NWC: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
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

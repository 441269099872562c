"""StableLatentMoE: K3's routed FFN (spec/model.md §7.3; K3 report Eq. 11).

    s        = sigmoid(f32(x) W_gate^T)                          router scores, fp32 [T, E]
    idx      = top-k of s + e_score_correction_bias              the bias only selects (frozen at inference)
               or, under routing replay, the recorded experts     (spec/rl.md §3; still sorted ascending)
    w        = s[idx] / sum s[idx]                               renormalised unbiased weights
    z        = routed_expert_down_proj(x)                        into the latent width
    y        = bf16( sum_j f32(w_j) * f32(w2_j(SiTU-GLU(w1_j z, w3_j z))) )   ascending expert id
    out      = routed_expert_up_proj(RMSNorm(y)) + shared_experts(x)

Two swap points keep the layer single-device math: `dispatcher` (how latent tokens reach their experts; expert
parallelism swaps in an all-to-all one) and `observer` (training registers it to see router scores and choices for
quantile balancing and load metrics, and serving to record the routes; the model never imports the trainer). The
observer always sees the experts actually used, replayed or not.

Routing replay: `ForwardBatch.routed_experts` [T, M, k] holds, per token, the experts of each of the model's M MoE
layers (`moe_layer_indices`; dense layers have no entry); the decoder layer hands MoE layer `moe_index` its slice.

The experts are stored stacked ([E, ...] per matrix) for grouped GEMMs; model/hf.py maps them to the checkpoint's
`experts.{e}.w{1,2,3}` tensors (w1 = gate, w3 = up, w2 = down).

Legend: T tokens, D hidden, E experts, k experts per token, M MoE layers, Lt latent width, F expert hidden.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from openk3.config import K3TextConfig
from openk3.model.layers import DenseMLP, Linear, RMSNorm
from openk3.ops import dispatch, widen
from openk3.ops.moe.route import route_replay, route_topk, router_scores
from openk3.ops.situ import situ_glu


class MoEGate(nn.Module):
    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        # Updated by load balancing, not by gradients; fp32 in the release.
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, latent: int, hidden: int, beta: float, linear_beta: float):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, latent))  # gate  [E, F, Lt]
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, latent))  # up    [E, F, Lt]
        self.w2 = nn.Parameter(torch.empty(num_experts, latent, hidden))  # down  [E, Lt, F]
        self.beta, self.linear_beta = beta, linear_beta

    def expert_forward(self, e: int, z_nL: torch.Tensor) -> torch.Tensor:
        h = situ_glu(dispatch.linear(z_nL, self.w1[e]), dispatch.linear(z_nL, self.w3[e]), self.beta, self.linear_beta)
        return dispatch.linear(h, self.w2[e])


def combine_topk(out_PL: torch.Tensor, w_Tk: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each token's k expert outputs (rows in (token, slot) order, P = T*k) weighted and added in fp32, slot by slot
    in ascending expert id (the order `route_topk` returns), then rounded to `dtype`: [T, L]. Every dispatcher ends
    here, so the summation order never depends on how tokens reached their experts."""
    T, k = w_Tk.shape
    out_TkL = out_PL.reshape(T, k, -1).float() * w_Tk.unsqueeze(-1)
    y_TL = out_TkL[:, 0]
    for j in range(1, k):
        y_TL = y_TL + out_TkL[:, j]
    return y_TL.to(dtype)


# The most weight bytes `gathered_dispatch` may copy in one call. Gathering copies each pair's three expert matrices:
# a few KiB in the tiny models, where saving ops wins, but 12 MiB per layer per token in a 1024-wide model (4 experts
# x 3 x 512 x 512 fp32), where the copy cost more than the matmuls (issue 17: 46% of a CPU decode step).
GATHER_MAX_BYTES = 2**20
# Up to this many tokens (decode, speculative verify of a few sequences) run the fused CPU kernel per token where it
# applies (`ops.dispatch.fused_experts`); more tokens share experts, which grouping reads once.
FUSED_MAX_TOKENS = 8


def local_dispatch(
    z_TL: torch.Tensor, idx_Tk: torch.Tensor, w_Tk: torch.Tensor, experts: GroupedExperts
) -> torch.Tensor:
    """Group tokens by expert, run each expert once on its rows (the weights as views), then add each token's k
    weighted outputs in fp32, in ascending expert id (the order `route_topk` returns). With fewer (token, expert)
    pairs than experts (decode, speculative verify) and small experts, each pair instead gets its expert's weights
    gathered and all pairs run as one batched matmul: a handful of ops instead of a few per touched expert. The two
    agree to rounding (tested)."""
    if 0 < idx_Tk.shape[0] <= FUSED_MAX_TOKENS:  # decode, small verify batches: the fused CPU kernel if it applies
        fused = dispatch.fused_experts(z_TL[:1], [experts.w1, experts.w3, experts.w2])
        if fused is not None:
            return fused_dispatch(fused, z_TL, idx_Tk, w_Tk, experts)
    w1 = experts.w1
    gather_bytes = idx_Tk.numel() * 3 * w1[0].numel() * w1.element_size()
    if idx_Tk.numel() < w1.shape[0] and gather_bytes <= GATHER_MAX_BYTES:
        return gathered_dispatch(z_TL, idx_Tk, w_Tk, experts)
    return grouped_dispatch(z_TL, idx_Tk, w_Tk, experts)


def fused_dispatch(fused, z_TL, idx_Tk, w_Tk, experts: GroupedExperts) -> torch.Tensor:
    """Token by token, its k experts in one call of `fused` (`ops.cpu_kernels.experts`: the same roundings as
    `expert_forward` + `combine_topk`, the weights read as views, nothing gathered or grouped)."""
    rows = []
    for t, ids in enumerate(idx_Tk.tolist()):
        w1s, w3s, w2s = [experts.w1[e] for e in ids], [experts.w3[e] for e in ids], [experts.w2[e] for e in ids]
        rows.append(fused(z_TL[t : t + 1], w1s, w3s, w2s, w_Tk[t], experts.beta, experts.linear_beta))
    return rows[0] if len(rows) == 1 else torch.cat(rows)


def grouped_dispatch(z_TL, idx_Tk, w_Tk, experts: GroupedExperts) -> torch.Tensor:
    _T, k = idx_Tk.shape
    flat = idx_Tk.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=experts.w1.shape[0]).tolist()
    z_sorted = z_TL[order // k]
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n:
            outs.append(experts.expert_forward(e, z_sorted[start : start + n]))
            start += n
    out_sorted = torch.cat(outs) if outs else z_TL.new_zeros(0, z_TL.shape[-1])
    return combine_topk(out_sorted[torch.argsort(order)], w_Tk, z_TL.dtype)


def gathered_dispatch(z_TL, idx_Tk, w_Tk, experts: GroupedExperts) -> torch.Tensor:
    _T, k = idx_Tk.shape
    flat = idx_Tk.reshape(-1)  # P = T*k pairs
    z_P1L = z_TL.repeat_interleave(k, dim=0)[:, None]
    a = widen.matmul(z_P1L, experts.w1[flat].transpose(1, 2))  # [P, 1, F]
    b = widen.matmul(z_P1L, experts.w3[flat].transpose(1, 2))
    h = situ_glu(a, b, experts.beta, experts.linear_beta)
    return combine_topk(widen.matmul(h, experts.w2[flat].transpose(1, 2)), w_Tk, z_TL.dtype)


Observer = Callable[[nn.Module, torch.Tensor, torch.Tensor], None]


def moe_layer_indices(config: K3TextConfig) -> list[int]:
    """The layer ids of the MoE layers, in order: position m in this list is MoE layer m, the middle axis of
    `ForwardBatch.routed_experts` and of recorded routes (dense layers, such as K3's layer 0, have no entry)."""
    return [i for i in range(config.num_hidden_layers) if config.ffn_kind(i) == "moe"]


class StableLatentMoE(nn.Module):
    def __init__(self, config: K3TextConfig, moe_index: int = 0):
        """`moe_index`: this layer's ordinal m among the model's MoE layers (`moe_layer_indices`), which selects its
        slice of replayed routes; the decoder layer sets it."""
        super().__init__()
        self.moe_index = moe_index
        D, Lt = config.hidden_size, config.routed_expert_hidden_size
        self.top_k, self.renormalize = config.num_experts_per_token, config.moe_renormalize
        self.scaling = config.routed_scaling_factor
        beta, lin = config.activation_situ_beta, config.activation_situ_linear_beta
        self.gate = MoEGate(D, config.num_experts)
        self.routed_expert_down_proj = Linear(D, Lt, bias=False)
        self.experts = GroupedExperts(config.num_experts, Lt, config.moe_intermediate_size, beta, lin)
        self.routed_expert_norm = RMSNorm(Lt, config.rms_norm_eps)
        self.routed_expert_up_proj = Linear(Lt, D, bias=False)
        self.shared_experts = (
            DenseMLP(D, config.shared_intermediate_size, beta, lin) if config.num_shared_experts > 0 else None
        )
        self.dispatcher: Callable[..., torch.Tensor] = local_dispatch
        self.observer: Observer | None = None

    def forward(self, x_TD: torch.Tensor, routes_Tk: torch.Tensor | None = None) -> torch.Tensor:
        """`routes_Tk` [T, k] integer: replay these experts (any order; used sorted) instead of the biased top-k;
        the weights are recomputed from this forward's scores either way."""
        if 0 < x_TD.shape[0] <= FUSED_MAX_TOKENS and self.dispatcher is local_dispatch:
            out = self._decode_fused(x_TD, routes_Tk)
            if out is not None:
                return out
        scores_TE = router_scores(x_TD, self.gate.weight)
        if routes_Tk is None:
            idx_Tk, w_Tk = route_topk(scores_TE, self.gate.e_score_correction_bias, self.top_k, self.renormalize,
                                      self.scaling)  # fmt: skip
        else:
            idx_Tk, w_Tk = route_replay(scores_TE, routes_Tk, self.renormalize, self.scaling)
        if self.observer is not None:
            self.observer(self, scores_TE, idx_Tk)
        y_TL = self.dispatcher(self.routed_expert_down_proj(x_TD), idx_Tk, w_Tk, self.experts)
        out = self.routed_expert_up_proj(self.routed_expert_norm(y_TL))
        return out + self.shared_experts(x_TD) if self.shared_experts is not None else out

    def _decode_fused(self, x_TD: torch.Tensor, routes_Tk: torch.Tensor | None) -> torch.Tensor | None:
        """Decode-sized batches: each token's layer output in one kernel call (`ops.cpu_kernels.MoEDecode`: the
        router, the down projection, its experts read in place, the weighted sum, the latent norm, the up
        projection and the shared experts); the observer sees the kernel's scores and experts. None where the kernel
        does not apply (the caller runs the torch path below, its reference)."""
        kernel = dispatch.prepared_kernel("moe_decode", self, x_TD.device, self._decode_weights)
        if kernel is None or not kernel.applies(x_TD):
            return None
        out, scores_TE, idx_Tk = kernel(x_TD, routes_Tk)
        if self.observer is not None:
            self.observer(self, scores_TE, idx_Tk)
        return out

    def _decode_weights(self):
        """The fused kernel's weights (matrices; the fp32 router bias) and how to make it over them
        (`ops.dispatch.prepared_kernel`); no matrices (the kernel does not apply) with shared experts of another
        SiTU than the routed ones."""
        ex = self.experts
        shared = None
        if self.shared_experts is not None:
            mlp = self.shared_experts
            shared = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
            if (mlp.beta, mlp.linear_beta) != (ex.beta, ex.linear_beta):
                return [], [], None
        w_gate, bias = self.gate.weight, self.gate.e_score_correction_bias
        w_down, w_up = self.routed_expert_down_proj.weight, self.routed_expert_up_proj.weight
        norm = self.routed_expert_norm

        def make(cls):
            return cls(w_gate, bias, self.top_k, self.renormalize, self.scaling, w_down, ex.w1, ex.w3, ex.w2,
                       norm.weight, norm.eps, w_up, shared, ex.beta, ex.linear_beta)  # fmt: skip

        return [w_gate, w_down, ex.w1, ex.w3, ex.w2, norm.weight, w_up, *(shared or ())], [bias], make

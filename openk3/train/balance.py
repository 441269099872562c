"""Training the router bias `e_score_correction_bias`: K3's quantile balancing (QB), the DeepSeek-V3 sign rule and
none, behind `Balancer(model, method=...)`; plus the exact (non-histogram) QB reference and the offline alternating
solver (K3 report App. C) that the tests compare against.

QB, per MoE layer and optimizer step:

    alpha_i = (k+1)-th largest of s_i + b                      token i's cutoff (route_topk_cutoff)
    r_ij    = alpha_i − s_ij                                    expert j wins token i iff b_j > r_ij
    H[j, clamp(floor((r_ij − lo)·B/(hi − lo)), 0, B−1)] += 1    every micro-batch, int32, no communication
    H       = all-reduce SUM over the ranks holding distinct tokens, once per step, all layers in one collective
    b̂_j     = the (k/n)-quantile of H[j], linearly interpolated inside its bin          (recover_quantile_bias)
    b       = b̂ − mean(b̂);  lo, hi = min b − 1, max b + 1;  H = 0
    (optional EMA, default off: b = ema·b_old + (1 − ema)·(b̂ − mean b̂), i.e. the update damped)

The new b overwrites the old one and takes effect at the next step; at inference b is frozen (the observer ignores
eval-mode calls and calls outside `Balancer.collecting()`).
Sign rule, as DeepSeek-V3 writes it: b_j += γ·sign(q̄ − load_j), no centring, no histogram.

Legend: T tokens, E experts (= n), k experts per token, B histogram bins, L MoE layers.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from openk3.ops.moe.route import route_topk_cutoff
from openk3.train.config import BALANCE_METHODS as METHODS
from openk3.train.metrics import expert_loads, max_vio, min_load


def required_bias(
    scores_TE: torch.Tensor, bias_E: torch.Tensor, k: int, exact_thresholds: bool = False
) -> torch.Tensor:
    """r_ij = alpha_i − s_ij [T, E]: the bias expert j needs to enter token i's top-k, with every cutoff alpha_i held
    fixed. The old bias enters only through alpha.

    exact_thresholds (an optional refinement, not K3's rule): for an expert outside token i's top-k use the k-th
    biased score instead of the (k+1)-th, i.e. the exact threshold given the other biases. K3's surrogate puts every
    token whose (k+1)-th choice is j exactly at r_ij = b_j, a point mass of about m/n tokens (q̄/k) that no bias
    inside one bin can split; with few experts per token (tiny: k = 2) that mass is half an expert's target load."""
    if not exact_thresholds:
        _, cutoff_T = route_topk_cutoff(scores_TE, bias_E, k)
        return cutoff_T[:, None] - scores_TE
    vals_Tk1, idx_Tk1 = torch.topk(scores_TE + bias_E, k + 1, dim=-1, sorted=True)
    selected_TE = torch.zeros_like(scores_TE, dtype=torch.bool).scatter_(1, idx_Tk1[:, :k], True)
    threshold_TE = torch.where(selected_TE, vals_Tk1[:, k : k + 1], vals_Tk1[:, k - 1 : k])
    return threshold_TE - scores_TE


def bias_bounds(bias_E: torch.Tensor) -> tuple[float, float]:
    """[lo, hi] = [min b − 1, max b + 1]: exact bounds of r, since s ∈ (0, 1) and alpha_i is some s_il + b_l."""
    return float(bias_E.min()) - 1.0, float(bias_E.max()) + 1.0


@torch.no_grad()
def quantile_histogram(
    scores_TE: torch.Tensor,
    bias_E: torch.Tensor,
    k: int,
    lo: float,
    hi: float,
    num_bins: int,
    token_mask_T: torch.Tensor | None = None,
    exact_thresholds: bool = False,
) -> torch.Tensor:
    """Counts of r_ij per expert in B uniform bins over [lo, hi]: int32 [E, B]. Each kept token adds one count to every
    expert's row. The bin index is computed in fp64 from the fp32 r, so the only rounding is the floor itself and the
    histogram of a concatenation is exactly the sum of the shards' histograms."""
    E = scores_TE.shape[-1]
    r_TE = required_bias(scores_TE, bias_E, k, exact_thresholds)
    if token_mask_T is not None:
        r_TE = r_TE[token_mask_T]
    bin_TE = ((r_TE.double() - lo) * num_bins / (hi - lo)).floor_().clamp_(0, num_bins - 1).long()
    flat = (bin_TE + torch.arange(E, device=bin_TE.device) * num_bins).reshape(-1)
    return torch.bincount(flat, minlength=E * num_bins).view(E, num_bins).int()


def recover_quantile_bias(hist_EB: torch.Tensor, lo: float, hi: float, k: int) -> torch.Tensor:
    """b̂ [E] fp64, not yet centred: per expert the (k/n)-quantile of the binned r, interpolated linearly inside the bin
    that holds the ceil(q)-th smallest value.
    |b̂_j − true quantile| ≤ w = (hi − lo)/B."""
    E, B = hist_EB.shape
    hist = hist_EB.long()
    cum_EB = hist.cumsum(dim=1)
    q_E = cum_EB[:, -1].double() * k / E  # N_j·k/n; may be fractional
    need_E = q_E.ceil().long()
    bin_E = (cum_EB < need_E[:, None]).sum(dim=1)  # first bin whose cumsum reaches ceil(q)
    before_E = torch.where(bin_E > 0, cum_EB.gather(1, (bin_E - 1).clamp(min=0)[:, None])[:, 0], 0)
    in_bin_E = hist.gather(1, bin_E[:, None])[:, 0]
    frac_E = ((q_E - before_E) / in_bin_E).clamp(0.0, 1.0)
    return lo + (bin_E + frac_E) * ((hi - lo) / B)


def quantile_bias_update(hist_EB: torch.Tensor, lo: float, hi: float, k: int, bias_E: torch.Tensor,
                         ema: float = 0.0) -> torch.Tensor:  # fmt: skip
    """The new bias from one step's histogram (recover, centre, and the optional EMA): b = ema·b_old +
    (1 − ema)·(b̂ − mean b̂), in b_old's dtype. ema = 0 is K3's rule."""
    b_hat_E = recover_quantile_bias(hist_EB, lo, hi, k)
    return (ema * bias_E.double() + (1.0 - ema) * (b_hat_E - b_hat_E.mean())).to(bias_E.dtype)


def exact_quantile_bias(scores_TE: torch.Tensor, bias_E: torch.Tensor, k: int) -> torch.Tensor:
    """One exact QB step: b̂_j = midpoint of the q-th and (q+1)-th smallest r_ij over tokens,
    q = round(T·k/n), then mean-centred. The midpoint (not an order statistic) keeps every biased score off its
    cutoff, so the routes survive rounding and common shifts. Returns b [E] in the scores' dtype."""
    T, E = scores_TE.shape
    q = round(T * k / E)
    if not 0 < q < T:
        raise ValueError(f"the exact rule needs 0 < round(T·k/n) < T, got T={T}, k={k}, n={E}")
    r_TE = required_bias(scores_TE, bias_E, k)
    b_hat_E = (r_TE.kthvalue(q, dim=0).values + r_TE.kthvalue(q + 1, dim=0).values) / 2
    return b_hat_E - b_hat_E.mean()


def solve_exact(scores_TE: torch.Tensor, k: int, iters: int, bias_E: torch.Tensor | None = None) -> torch.Tensor:
    """The offline alternating solver (K3 report App. C): `iters` exact QB steps on one fixed score matrix from
    `bias_E` (default 0). Coordinate descent on the LP dual: overloaded experts are corrected exactly, underloaded
    ones under-corrected (for an expert outside a token's top-k, QB's cutoff is below the exact threshold), so it
    converges over several iterations."""
    b_E = torch.zeros(scores_TE.shape[-1], dtype=scores_TE.dtype) if bias_E is None else bias_E.to(scores_TE.dtype)
    for _ in range(iters):
        b_E = exact_quantile_bias(scores_TE, b_E, k)
    return b_E


@torch.no_grad()
def near_ties(
    scores_TE: torch.Tensor, bias_E: torch.Tensor, k: int, width: float, token_mask_T: torch.Tensor | None = None
) -> torch.Tensor:
    """How many tokens have k-th and (k+1)-th biased scores closer than `width` (int64 scalar): router health.
    Those tokens sit on a cutoff, where a bias error of a fraction of a bin moves whole groups of them between
    experts (the hazard when scores saturate near 1 and cutoffs pack densely)."""
    top_Tk1 = torch.topk(scores_TE.float() + bias_E.float(), k + 1, dim=-1, sorted=True).values
    tied_T = (top_Tk1[:, k - 1] - top_Tk1[:, k]) < width
    if token_mask_T is not None:
        tied_T = tied_T[token_mask_T]
    return tied_T.sum()


def moe_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every routed MoE block in model order: a module with gate.e_score_correction_bias and an
    observer hook (duck-typed, so wrapped or subclassed blocks count)."""
    return [(name, m) for name, m in model.named_modules()
            if hasattr(getattr(m, "gate", None), "e_score_correction_bias") and hasattr(m, "observer")]  # fmt: skip


def _read_bias(p: torch.Tensor) -> torch.Tensor:
    # FSDP2 keeps the parameter sharded between steps; the update needs the whole vector.
    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


def _write_bias(p: torch.Tensor, b_E: torch.Tensor) -> None:
    if isinstance(p, DTensor):
        # Every rank holds the same b, so each keeps its own slice without communication.
        b_E = distribute_tensor(b_E, p.device_mesh, p.placements, src_data_rank=None)
    p.copy_(b_E)


class Balancer:
    """Owns the router-bias update of every MoE layer in `model`.

    Registers itself as the `observer` of each layer with a `gate.e_score_correction_bias` (StableLatentMoE).
    Per optimizer step: wrap each micro-batch's forward in `collecting()`, then call `step()` once, on every rank,
    after the last micro-batch's backward (activation checkpointing re-routes with the bias during backward, so an
    earlier update would change the recomputed routes). Before `optimizer.step()` as Megatron and torchtitan do; the
    bias has no gradient, so that order is not load-bearing. `process_group` is the group of ranks holding *distinct*
    tokens of these layers (DP, CP; under PP each stage its own Balancer over the same group).

    State: the histograms and loads (not saved; restart at zero) and per-layer `lo, hi` (`state_dict`); the bias
    itself lives in the model's state dict as `e_score_correction_bias`. Build the Balancer after loading weights, or
    load its state, so that lo/hi match the bias.
    """

    def __init__(
        self,
        model: nn.Module,
        method: str = "quantile",
        num_bins: int = 1000,
        sign_rate: float = 1e-3,
        process_group: dist.ProcessGroup | None = None,
        exact_thresholds: bool = False,
        ema: float = 0.0,
    ):
        if method not in METHODS:
            raise ValueError(f"balance method must be one of {METHODS}, got {method!r}")
        if num_bins < 1:
            raise ValueError(f"num_bins must be positive, got {num_bins}")
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"balance ema must be in [0, 1), got {ema}")
        self.method, self.num_bins, self.sign_rate, self.process_group = method, num_bins, sign_rate, process_group
        self.exact_thresholds, self.ema = exact_thresholds, ema
        found = moe_layers(model)
        self.names, self.layers = [name for name, _ in found], [m for _, m in found]
        if not self.layers:
            raise ValueError("Balancer found no MoE layer (no module with gate.e_score_correction_bias)")
        for i, layer in enumerate(self.layers):
            n = layer.gate.e_score_correction_bias.numel()
            if not 0 < layer.top_k < n:
                raise ValueError(f"{self.names[i]}: quantile balancing needs 0 < k < n, got k={layer.top_k}, n={n}")
            layer.observer = functools.partial(self._observe, i)
        if process_group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            warnings.warn(
                "Balancer: torch.distributed is initialised but no process_group was given, so statistics are not "
                "all-reduced and the ranks' router biases will diverge unless every rank sees the same tokens"
            )
        bounds = [bias_bounds(_read_bias(layer.gate.e_score_correction_bias)) for layer in self.layers]
        self.lo, self.hi = [lo for lo, _ in bounds], [hi for _, hi in bounds]
        self._hist: list[torch.Tensor | None] = [None] * len(self.layers)  # int32 [E, B] per layer
        self._loads: list[torch.Tensor | None] = [None] * len(self.layers)  # int64 [E] per layer
        self._ties: list[torch.Tensor | None] = [None] * len(self.layers)  # int64 [] per layer: near-tied tokens
        self._collecting = False
        self._token_mask_T: torch.Tensor | None = None

    @contextlib.contextmanager
    def collecting(self, token_mask: torch.Tensor | None = None) -> Iterator[None]:
        """Count this micro-batch. Wrap the forward only: observer calls outside (eval, generation, the recompute of
        activation checkpointing during backward) are ignored, so each token is counted once.

        token_mask: optional bool [T] over the packed tokens every MoE layer sees in this forward (the flattened
        input_ids of `model(input_ids)`); False tokens are left out of H and the loads. Packing makes no padding,
        so the trainer normally passes none (K3 does not say how padding counts; we leave it out)."""
        if self._collecting:
            raise RuntimeError("Balancer.collecting() is not re-entrant")
        self._collecting, self._token_mask_T = True, token_mask
        try:
            yield
        finally:
            self._collecting, self._token_mask_T = False, None

    @torch.no_grad()
    def _observe(self, i: int, module: nn.Module, scores_TE: torch.Tensor, idx_Tk: torch.Tensor) -> None:
        if not self._collecting or not module.training:
            return
        mask_T = self._token_mask_T
        if mask_T is not None:
            if mask_T.shape != scores_TE.shape[:1]:
                raise ValueError(
                    f"token_mask has shape {tuple(mask_T.shape)}, the MoE layer sees {scores_TE.shape[0]} tokens"
                )
            idx_Tk = idx_Tk[mask_T]
        loads_E = expert_loads(idx_Tk, scores_TE.shape[-1])
        self._loads[i] = loads_E if self._loads[i] is None else self._loads[i] + loads_E
        ties = near_ties(scores_TE.detach(), module.gate.e_score_correction_bias.detach(), module.top_k,
                         (self.hi[i] - self.lo[i]) / self.num_bins, mask_T)  # fmt: skip
        self._ties[i] = ties if self._ties[i] is None else self._ties[i] + ties
        if self.method == "quantile":
            bias_E = module.gate.e_score_correction_bias
            hist_EB = quantile_histogram(scores_TE.detach(), bias_E.detach(), module.top_k, self.lo[i], self.hi[i],
                                         self.num_bins, mask_T, self.exact_thresholds)  # fmt: skip
            self._hist[i] = hist_EB if self._hist[i] is None else self._hist[i] + hist_EB

    def _reduced_counts(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None], list[int]]:
        """The step's loads, histograms and near-tie counts per layer, summed over micro-batches and (one
        collective) over process_group."""
        parts, shapes = [], []
        for i, layer in enumerate(self.layers):
            p = layer.gate.e_score_correction_bias
            E = p.shape[0]
            # A rank that saw no token this step still joins the collective with zeros.
            loads = self._loads[i] if self._loads[i] is not None else torch.zeros(E, dtype=torch.int64, device=p.device)
            parts.append(loads.int())
            shapes.append((E,))
            ties = self._ties[i] if self._ties[i] is not None else torch.zeros((), dtype=torch.int64, device=p.device)
            parts.append(ties.int().reshape(1))
            shapes.append((1,))
            if self.method == "quantile":
                hist = self._hist[i]
                if hist is None:
                    hist = torch.zeros(E, self.num_bins, dtype=torch.int32, device=p.device)
                parts.append(hist)
                shapes.append((E, self.num_bins))
        flat = torch.cat([t.reshape(-1) for t in parts])
        if self.process_group is not None and dist.is_initialized():
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.process_group)
        out = list(flat.split([math.prod(s) for s in shapes]))
        out = [t.view(s) for t, s in zip(out, shapes)]
        per = 3 if self.method == "quantile" else 2
        ties = [int(t) for t in out[1::per]]
        hists = out[2::3] if self.method == "quantile" else [None] * len(self.layers)
        return out[0::per], hists, ties

    @torch.no_grad()
    def step(self) -> dict:
        """End of an optimizer step: reduce, update every layer's bias per `method`, reset the counts, and return
        the step's metrics from the global-batch loads routed with the *old* bias:
        max_vio (max over layers of MaxVio_batch), max_vio_per_layer, min_load_per_layer, zero_load_experts_per_layer,
        loads (per layer, per expert), bias_std_per_layer, bias_change_per_layer (L2 of the update),
        bin_width_per_layer (w after the update), near_tie_fraction_per_layer (router health: the fraction of
        tokens whose k-th and (k+1)-th biased scores differ by less than the bin width w in use this step),
        tokens_per_step (m), q_bar (m·k/n of the first layer)."""
        loads_LE, hists, ties = self._reduced_counts()
        loads = [t.cpu() for t in loads_LE]
        old, new = [], []
        for i, layer in enumerate(self.layers):
            p = layer.gate.e_score_correction_bias
            b_E = _read_bias(p)
            old.append(b_E.clone())
            k, E = layer.top_k, b_E.numel()
            m = int(loads[i].sum()) // k
            if m > 0 and self.method == "quantile":  # no token this step: keep b
                b_E = quantile_bias_update(hists[i], self.lo[i], self.hi[i], k, b_E, self.ema)
            elif m > 0 and self.method == "sign":
                b_E = b_E + (self.sign_rate * torch.sign(m * k / E - loads_LE[i].double())).to(b_E.dtype)
            if self.method != "none":
                _write_bias(p, b_E)
                self.lo[i], self.hi[i] = bias_bounds(b_E)
            new.append(b_E)
            self._hist[i], self._loads[i], self._ties[i] = None, None, None
        k0 = self.layers[0].top_k
        m = int(loads[0].sum()) // k0
        ks = [layer.top_k for layer in self.layers]
        per_layer = [max_vio(t, k, m) if m > 0 else 0.0 for t, k in zip(loads, ks)]
        return {
            "max_vio": max(per_layer),
            "max_vio_per_layer": per_layer,
            "min_load_per_layer": [min_load(t, k, m) if m > 0 else 0.0 for t, k in zip(loads, ks)],
            "zero_load_experts_per_layer": [int((t == 0).sum()) for t in loads],
            "loads": [t.tolist() for t in loads],
            "bias_std_per_layer": [float(b.double().std()) for b in new],
            "bias_change_per_layer": [float((b.double() - a.double()).norm()) for a, b in zip(old, new)],
            "bin_width_per_layer": [(hi - lo) / self.num_bins for lo, hi in zip(self.lo, self.hi)],
            "near_tie_fraction_per_layer": [t / m if m > 0 else 0.0 for t in ties],
            "tokens_per_step": m,
            "q_bar": m * k0 / loads[0].numel(),
        }

    def discard(self) -> None:
        """Drop this step's counts without touching the biases (a skipped, non-finite step). Purely local: call it on
        every rank or on none, since `step()` is a collective."""
        self._hist, self._loads = [None] * len(self.layers), [None] * len(self.layers)
        self._ties = [None] * len(self.layers)

    def state_dict(self) -> dict:
        """lo/hi per layer (fp64 [L]); the histograms are not saved and restart at zero."""
        return {
            "method": self.method,
            "num_bins": self.num_bins,
            "lo": torch.tensor(self.lo, dtype=torch.float64),
            "hi": torch.tensor(self.hi, dtype=torch.float64),
        }

    def load_state_dict(self, state: dict) -> None:
        if len(state["lo"]) != len(self.layers) or len(state["hi"]) != len(self.layers):
            raise ValueError(f"balancer state has {len(state['lo'])} layers, the model has {len(self.layers)}")
        if state["num_bins"] != self.num_bins:
            raise ValueError(f"balancer state has {state['num_bins']} bins, this Balancer uses {self.num_bins}")
        self.lo, self.hi = [float(x) for x in state["lo"]], [float(x) for x in state["hi"]]
        self.discard()

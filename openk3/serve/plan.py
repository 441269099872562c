"""The serving economics of K3's hybrid cache: bytes per token and per request, the crossover against an all-MLA
model of the same depth, and the allocation unit.

This file owns the arithmetic only, over the layers' `CacheSpec`s (model/cache.py); the pool that allocates these bytes
is `serve/kv/block_pool.py`, built from the same specs. What each layer kind keeps between forwards:

- MLA: one latent per token per MLA layer, `kv_lora_rank + qk_rope_head_dim` values in the activation dtype. It has a
  single "head", so tensor parallelism **replicates** it: every TP rank holds all of it.
- KDA: a recurrent state of H × K × V values per request per KDA layer, always fp32, plus the short-conv tail: the last
  W − 1 pre-conv inputs of q, k and v (3 × H·K channels) in the activation dtype. KDA shards by heads, so both divide
  by TP.
- AttnRes: nothing (its bank lives inside one forward).

Legend: H KDA heads, K = V KDA head dim, W short-conv kernel width, TP tensor-parallel degree. All sizes are bytes;
per-request and per-token sizes are per GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from openk3.config import K3TextConfig
from openk3.model.cache import cache_specs, layer_cache_spec


@dataclass(frozen=True)
class CachePlan:
    """Cache sizes of one config at one activation dtype and TP degree. Build it with `cache_plan`."""

    num_mla_layers: int
    num_kda_layers: int
    act_bytes: int  # bytes per activation value (bf16 2, fp32 4)
    tp: int
    latent_bytes_per_token_layer: int  # one MLA layer's latent for one token (replicated under TP)
    fixed_bytes_per_layer: int  # one KDA layer's state + conv tail for one request, per GPU
    mla_bytes_per_token: int  # all MLA layers' latents for one token
    kda_state_bytes_per_request: int  # all KDA layers' fp32 states, per GPU
    conv_bytes_per_request: int  # all KDA layers' conv tails, per GPU
    fixed_bytes_per_request: int  # state + conv: what a request costs before its first token
    all_mla_bytes_per_token: int  # a model of the same depth with MLA in every layer
    crossover_tokens: float  # context length beyond which the hybrid holds fewer bytes; inf if never

    def request_bytes(self, context: int) -> int:
        """Bytes one request of `context` tokens holds in the hybrid cache."""
        return self.fixed_bytes_per_request + context * self.mla_bytes_per_token

    def all_mla_request_bytes(self, context: int) -> int:
        """Bytes the same request would hold if every layer were MLA."""
        return context * self.all_mla_bytes_per_token

    def allocation_unit(self, hash_unit: int = 512) -> int:
        """Tokens per MLA block such that one layer's MLA page is at least one layer's state page (state + conv),
        rounded up to a multiple of `hash_unit` (6144 / 3072 / 1536 / 1024 at TP 1 / 2 / 4 / 8 for K3: the
        report's 1024-6144 range; the report does not state this rule, it is our reconstruction).
        A model without KDA layers gets one hash unit."""
        if hash_unit <= 0:
            raise ValueError(f"hash_unit must be positive, got {hash_unit}")
        tokens = -(-self.fixed_bytes_per_layer // self.latent_bytes_per_token_layer)
        return max(1, -(-tokens // hash_unit)) * hash_unit


_DTYPE_OF_BYTES = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


def cache_plan(text_config: K3TextConfig, act_bytes: int = 2, tp: int = 1) -> CachePlan:
    """Compute the `CachePlan` of `text_config` with activations of `act_bytes` bytes at tensor parallelism `tp`,
    from the layers' `CacheSpec`s (model/cache.py), the geometry the serving pools are built from."""
    if act_bytes not in _DTYPE_OF_BYTES:
        raise ValueError(f"act_bytes must be one of {sorted(_DTYPE_OF_BYTES)} (bytes per activation), got {act_bytes}")
    dtype = _DTYPE_OF_BYTES[act_bytes]
    mla, kda = (layer_cache_spec(text_config, kind, dtype, tp) for kind in ("mla", "kda"))
    specs = cache_specs(text_config, dtype, tp)
    num_kda, num_mla = sum(s.kind == "kda" for s in specs), sum(s.kind == "mla" for s in specs)
    fixed = sum(s.bytes_per_request for s in specs)
    mla_per_token = sum(s.bytes_per_token for s in specs)
    all_mla_per_token = len(specs) * mla.bytes_per_token
    saving = all_mla_per_token - mla_per_token  # bytes per token the hybrid saves against all-MLA
    return CachePlan(
        num_mla_layers=num_mla,
        num_kda_layers=num_kda,
        act_bytes=act_bytes,
        tp=tp,
        latent_bytes_per_token_layer=mla.bytes_per_token,
        fixed_bytes_per_layer=kda.bytes_per_request,
        mla_bytes_per_token=mla_per_token,
        kda_state_bytes_per_request=num_kda * kda.state_bytes,
        conv_bytes_per_request=num_kda * kda.conv_bytes,
        fixed_bytes_per_request=fixed,
        all_mla_bytes_per_token=all_mla_per_token,
        crossover_tokens=fixed / saving if saving > 0 else math.inf,
    )


def _human(n: float) -> str:
    """Binary units (KiB = 1024 B), as K3's published memory figures use them."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3f} {unit}"
    return f"{n:.0f} B"


def _tokens(n: int) -> str:
    """1K = 1024 tokens, 1M = 1024K (binary, like the byte units)."""
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def format_plan(plan: CachePlan, contexts: list[int], batch: int) -> str:
    """A readable report: per-token and per-request sizes, a table of `batch` requests at each of `contexts` tokens
    (hybrid vs all-MLA), the crossover length and the allocation unit."""
    bad = [c for c in contexts if c <= 0]
    if bad:
        raise ValueError(f"context must be a positive number of tokens, got {bad[0]}")
    if batch <= 0:
        raise ValueError(f"batch must be positive, got {batch}")
    rows = [
        ("MLA latent per token", plan.mla_bytes_per_token, f"{plan.num_mla_layers} MLA layers, replicated under TP"),
        ("KDA state per request", plan.kda_state_bytes_per_request, f"{plan.num_kda_layers} KDA layers, fp32"),
        ("conv tail per request", plan.conv_bytes_per_request, f"{plan.num_kda_layers} KDA layers x 3 projections"),
        ("fixed per request", plan.fixed_bytes_per_request, "state + conv"),
        ("all-MLA per token", plan.all_mla_bytes_per_token, f"{plan.num_mla_layers + plan.num_kda_layers} MLA layers"),
    ]
    lines = [f"hybrid cache per GPU at TP{plan.tp}, {plan.act_bytes}-byte activations (KDA state fp32)"]
    lines += [f"  {name:<22} {_human(n):>12} {n:>16,} B   {note}" for name, n, note in rows]
    lines.append("")
    lines.append(f"  {'context':>8} {f'hybrid x{batch}':>14} {f'all-MLA x{batch}':>14} {'ratio':>6}")
    for context in contexts:
        hybrid, all_mla = batch * plan.request_bytes(context), batch * plan.all_mla_request_bytes(context)
        lines.append(f"  {_tokens(context):>8} {_human(hybrid):>14} {_human(all_mla):>14} {hybrid / all_mla:>6.2f}")
    lines.append("")
    if math.isinf(plan.crossover_tokens):
        lines.append("crossover: none, the hybrid is never smaller than all-MLA")
    else:
        lines.append(f"crossover: the hybrid is smaller than all-MLA beyond {plan.crossover_tokens:,.1f} tokens")
    lines.append(f"allocation unit: {plan.allocation_unit():,} tokens (512-token hash unit)")
    return "\n".join(lines)

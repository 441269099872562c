"""Per-request decoding cache: the contiguous reference that the paged serving cache is tested against.

Per KDA layer and sequence (spec/model.md §5): the last W-1 pre-conv inputs of q, k and v (the conv tails) and the
fp32 recurrent state S [H, K, V] (K-first: rows are key channels). Per MLA layer and sequence: the 576-wide latent
per token of the release, i.e. the normalised c_kv (kv_lora_rank) followed by the raw k_pe (qk_rope_head_dim), never
the expanded per-head keys and values (spec/model.md §6). AttnRes, the FFNs and the router keep no state.

The layers use each entry only through a small interface, which the serving engine's paged views
(serve/kv/views.py) implement over block pools and state slots:
    KDA entry: load() -> (tails, state); store(tails, state); and, for mode VERIFY only, record(steps, pre_conv):
               the ops.kda.KDASteps of the pass and its pre-conv q, k, v rows [N, G, P], instead of a new state;
               decode_in_out() -> KDAInOut: where the fused CPU decode kernel reads and writes (fresh outputs here,
               the pools in place in serving), then its commit()
    MLA entry: append(latents_TR, seq_lens) writes every sequence's new latents at its next positions;
               past(i) -> [S_i, R] what sequence i has written (this call's latents included);
               block() -> ([N, S_max, R], lengths [N]) every sequence at once, right-padded with finite values

`CacheSpec` is the one description of that geometry, per layer: its shapes and dtypes and so its bytes per token
(MLA) and per request (KDA). The contiguous cache here, the serving pools (serve/kv/block_pool.py), the engine's page
size and `k3 plan` (serve/plan.py) are all derived from it.

Legend: N sequences, W conv width, P = H*K projected width, H heads, K/V head dims, S cached tokens, R latent width,
TP tensor-parallel degree.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

CONV_PROJECTIONS = 3  # q, k and v each have their own short conv and so their own tail
STATE_DTYPE = torch.float32  # the KDA recurrent state is fp32 everywhere (STYLE.md §5)


@dataclass(frozen=True)
class CacheSpec:
    """What one layer keeps between forwards, per GPU (spec/serving.md §1.1). MLA: a latent of `latent_width`
    values per token in the activation dtype, with a single "head", so tensor parallelism replicates it. KDA: per
    request, `CONV_PROJECTIONS` conv tails of `conv_shape` (W-1, P) in the activation dtype and the recurrent state
    of `state_shape` (H, K, V) in fp32; both shard by heads under TP. Build them with `layer_cache_spec`."""

    kind: str  # "mla" | "kda"
    dtype: torch.dtype  # activation dtype: MLA latents, KDA conv tails
    latent_width: int = 0  # MLA: R
    conv_shape: tuple[int, int] = (0, 0)  # KDA: (W-1, P / TP) per projection
    state_shape: tuple[int, int, int] = (0, 0, 0)  # KDA: (H / TP, K, V)

    @property
    def bytes_per_token(self) -> int:
        return self.latent_width * self.dtype.itemsize

    @property
    def conv_bytes(self) -> int:
        """All conv tails of one request."""
        return CONV_PROJECTIONS * math.prod(self.conv_shape) * self.dtype.itemsize

    @property
    def state_bytes(self) -> int:
        """The recurrent state of one request."""
        return math.prod(self.state_shape) * STATE_DTYPE.itemsize

    @property
    def bytes_per_request(self) -> int:
        """What a request holds before its first token."""
        return self.conv_bytes + self.state_bytes


def layer_cache_spec(text_config, kind: str, dtype: torch.dtype, tp: int = 1) -> CacheSpec:
    """The CacheSpec of a layer of `kind` ("mla" | "kda") of `text_config` with activations in `dtype` at tensor
    parallelism `tp`, whatever the config's own layer schedule (the plan prices an all-MLA model of the same depth)."""
    if kind == "mla":
        return CacheSpec("mla", dtype, latent_width=text_config.kv_lora_rank + text_config.qk_rope_head_dim)
    la = text_config.linear_attn_config
    if tp <= 0 or la.num_heads % tp:
        raise ValueError(f"tp must be a positive divisor of linear_attn_config.num_heads ({la.num_heads}), got {tp}")
    H, K = la.num_heads // tp, la.head_dim  # K3's KDA uses head_dim for both the key and the value width (K = V)
    return CacheSpec("kda", dtype, conv_shape=(la.short_conv_kernel_size - 1, H * K), state_shape=(H, K, K))


def cache_specs(text_config, dtype: torch.dtype, tp: int = 1) -> list[CacheSpec]:
    """Every layer's CacheSpec, in layer order."""
    kinds = [text_config.layer_kind(i) for i in range(text_config.num_hidden_layers)]
    by_kind = {kind: layer_cache_spec(text_config, kind, dtype, tp) for kind in set(kinds)}
    return [by_kind[kind] for kind in kinds]


class KDAInOut(NamedTuple):
    """Where a fused KDA decode step (`ops.cpu_kernels.KDADecode`) reads and writes one KDA entry: per projection
    q, k, v a [*, W-1, P] tensor of conv tails, a [*, H, K, V] fp32 state tensor, and the row of each sequence in
    them, for the input and for the output; the outputs may be the inputs (an in-place update). `commit()` finishes
    the update (stores freshly allocated outputs; nothing to do in place)."""

    tails_in: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    state_in: torch.Tensor
    rows_in: list[int]
    tails_out: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    state_out: torch.Tensor
    rows_out: list[int]
    commit: Callable[[], None]


@dataclass
class KDAState:
    conv_q_NWP: torch.Tensor  # [N, W-1, P] activation dtype
    conv_k_NWP: torch.Tensor
    conv_v_NWP: torch.Tensor
    recurrent_NHKV: torch.Tensor  # [N, H, K, V] fp32 always

    def load(self) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        return (self.conv_q_NWP, self.conv_k_NWP, self.conv_v_NWP), self.recurrent_NHKV

    def store(self, tails: tuple[torch.Tensor, torch.Tensor, torch.Tensor], state_NHKV: torch.Tensor) -> None:
        self.conv_q_NWP, self.conv_k_NWP, self.conv_v_NWP = tails
        self.recurrent_NHKV = state_NHKV

    def decode_in_out(self) -> KDAInOut:
        """Fresh outputs, stored on commit: tensors a caller holds from before the step keep their values."""
        tails, state = self.load()
        tails_out = tuple(torch.empty_like(t) for t in tails)
        state_out = torch.empty_like(state)
        rows = list(range(state.shape[0]))
        return KDAInOut(tails, state, rows, tails_out, state_out, rows, lambda: self.store(tails_out, state_out))


@dataclass
class MLACache:
    latents: list[torch.Tensor] = field(default_factory=list)  # per sequence [S_i, R], R = kv_lora_rank + rope dim

    def append(self, latents_TR: torch.Tensor, seq_lens: list[int]) -> None:
        for i, new_SR in enumerate(latents_TR.split(seq_lens)):
            self.latents[i] = torch.cat([self.latents[i], new_SR], dim=0)

    def past(self, i: int) -> torch.Tensor:
        return self.latents[i]

    def block(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, S_max, R] zero-padded, and the lengths [N]."""
        lens_N = torch.tensor([t.shape[0] for t in self.latents], device=self.latents[0].device)
        return torch.nn.utils.rnn.pad_sequence(self.latents, batch_first=True), lens_N


class K3Cache:
    """The cache of N sequences for every layer of one model; updated in place by `K3ForCausalLM.forward`."""

    def __init__(self, config, num_seqs: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        text = config.text_config if hasattr(config, "text_config") else config
        self.num_seqs = num_seqs
        self.seen_tokens = [0] * num_seqs
        self.layers: list[KDAState | MLACache] = []
        for spec in cache_specs(text, dtype):
            if spec.kind == "kda":
                conv = [torch.zeros(num_seqs, *spec.conv_shape, dtype=dtype, device=device)
                        for _ in range(CONV_PROJECTIONS)]  # fmt: skip
                state = torch.zeros(num_seqs, *spec.state_shape, dtype=STATE_DTYPE, device=device)
                self.layers.append(KDAState(*conv, state))
            else:
                latents = [torch.zeros(0, spec.latent_width, dtype=dtype, device=device) for _ in range(num_seqs)]
                self.layers.append(MLACache(latents))

    def advance(self, seq_lens: list[int]) -> None:
        if len(seq_lens) != self.num_seqs:
            raise ValueError(f"cache holds {self.num_seqs} sequences, the batch has {len(seq_lens)}")
        self.seen_tokens = [a + b for a, b in zip(self.seen_tokens, seq_lens, strict=True)]

    def nbytes(self) -> int:
        total = 0
        for entry in self.layers:
            tensors = entry.latents if isinstance(entry, MLACache) else vars(entry).values()
            total += sum(t.numel() * t.element_size() for t in tensors)
        return total

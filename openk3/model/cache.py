"""Per-request decoding cache: the contiguous reference that the paged serving cache is tested against.

Per KDA layer and sequence (spec/model.md §5): the last W-1 pre-conv inputs of q, k and v (the conv tails) and the
fp32 recurrent state S [H, K, V] (K-first: rows are key channels). Per MLA layer and sequence: the 576-wide latent
per token of the release, i.e. the normalised c_kv (kv_lora_rank) followed by the raw k_pe (qk_rope_head_dim), never
the expanded per-head keys and values (spec/model.md §6). AttnRes, the FFNs and the router keep no state.

The layers use each entry only through a small interface, which the serving engine's paged views
(serve/kv/views.py) implement over block pools and state slots:
    KDA entry: load() -> (tails, state); store(tails, state); record(step) (verify passes only, serving)
    MLA entry: past(i) -> [S_i, R] latents cached before this call; append(i, latents_TR)

Legend: N sequences, W conv width, P = H*K projected width, H heads, K/V head dims, S cached tokens, R latent width.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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


@dataclass
class VerifyStep:
    """What one verify position fed the KDA state update, recorded so the accepted prefix can be folded onto the
    slot later with the same arithmetic (spec/serving.md §4.3): q^, k^ fp32 [N, H, K], v [N, H, V], the gate g
    fp32 [N, H, K] and beta fp32 [N, H] after their activations, and the pre-conv q, k, v rows [N, P] that roll the
    conv tails. Never recompute these in the fold (spec §4.4)."""

    q_NHK: torch.Tensor
    k_NHK: torch.Tensor
    v_NHV: torch.Tensor
    g_NHK: torch.Tensor
    beta_NH: torch.Tensor
    pre_conv_NP: list[torch.Tensor]


@dataclass
class MLACache:
    latents: list[torch.Tensor] = field(default_factory=list)  # per sequence [S_i, R], R = kv_lora_rank + rope dim

    def past(self, i: int) -> torch.Tensor:
        return self.latents[i]

    def append(self, i: int, latents_TR: torch.Tensor) -> None:
        self.latents[i] = torch.cat([self.latents[i], latents_TR], dim=0)


class K3Cache:
    """The cache of N sequences for every layer of one model; updated in place by `K3ForCausalLM.forward`."""

    def __init__(self, config, num_seqs: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        text = config.text_config if hasattr(config, "text_config") else config
        la = text.linear_attn_config
        P, W = la.num_heads * la.head_dim, la.short_conv_kernel_size
        self.num_seqs = num_seqs
        self.seen_tokens = [0] * num_seqs
        self.layers: list[KDAState | MLACache] = []
        for layer in range(text.num_hidden_layers):
            if text.layer_kind(layer) == "kda":
                conv = [torch.zeros(num_seqs, W - 1, P, dtype=dtype, device=device) for _ in range(3)]
                state = torch.zeros(num_seqs, la.num_heads, la.head_dim, la.head_dim, dtype=torch.float32, device=device)
                self.layers.append(KDAState(*conv, state))
            else:
                self.layers.append(MLACache([torch.zeros(0, text.kv_lora_rank + text.qk_rope_head_dim, dtype=dtype,
                                                         device=device) for _ in range(num_seqs)]))  # fmt: skip

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

"""Per-request decoding cache: the contiguous reference that the paged serving cache is tested against.

Per KDA layer and sequence (spec/model.md §5): the last W-1 pre-conv inputs of q, k and v (the conv tails) and the
fp32 recurrent state S [H, K, V] (K-first: rows are key channels). Per MLA layer and sequence: the 576-wide latent
per token of the release, i.e. the normalised c_kv (kv_lora_rank) followed by the raw k_pe (qk_rope_head_dim), never
the expanded per-head keys and values (spec/model.md §6). AttnRes, the FFNs and the router keep no state.

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


@dataclass
class MLACache:
    latents: list[torch.Tensor] = field(default_factory=list)  # per sequence [S_i, R], R = kv_lora_rank + rope dim


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

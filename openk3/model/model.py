"""K3ForCausalLM: embed -> decoder layers (KDA or MLA mixer, dense or MoE FFN, Block AttnRes between them) ->
output AttnRes mix -> norm -> untied LM head (spec/model.md §3).

Block Attention Residuals (spec/model.md §4) replace the residual stream: each layer mixes a bank of finished
blocks with the current block's partial sum before its mixer and its FFN (the rule is in model/attnres.py).

Construction is cheap and works under `torch.device("meta")`; `init_weights()` is the one place that sets values
(the training recipe), `init_random_weights()` fills every tensor with non-trivial values for tests, and
`from_pretrained` bypasses both. Checkpoint I/O lives in model/hf.py.

Legend: B batch rows, T tokens (packed T_all), D hidden, V vocabulary.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from torch import nn

from openk3.config import K3Config
from openk3.model import attnres
from openk3.model.batch import ForwardBatch, Mode
from openk3.model.cache import K3Cache
from openk3.model.decode_stack import decode_stack
from openk3.model.hf import load_pretrained, save_pretrained
from openk3.model.kda import KimiDeltaAttention
from openk3.model.layers import DenseMLP, Linear, RMSNorm
from openk3.model.mla import GatedMLA
from openk3.model.moe import StableLatentMoE, moe_layer_indices
from openk3.ops.sampling import sample

# Parameters the release stores (and every precision policy keeps) in fp32 (spec/model.md §11).
FP32_PARAM_SUFFIXES = ("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "e_score_correction_bias")


def keeps_fp32(name: str) -> bool:
    return name.endswith(FP32_PARAM_SUFFIXES)


class K3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        text = config
        D, eps = text.hidden_size, text.rms_norm_eps
        self.layer_idx = layer_idx
        self.kind = text.layer_kind(layer_idx)
        self.block_start = text.is_block_start(layer_idx)
        self.input_layernorm = RMSNorm(D, eps)
        self.post_attention_layernorm = RMSNorm(D, eps)
        self.self_attention_res_norm = RMSNorm(D, eps)
        self.self_attention_res_proj = nn.Linear(D, 1, bias=False)
        self.mlp_res_norm = RMSNorm(D, eps)
        self.mlp_res_proj = nn.Linear(D, 1, bias=False)
        self.self_attn = KimiDeltaAttention(text) if self.kind == "kda" else GatedMLA(text)
        if text.ffn_kind(layer_idx) == "dense":
            self.mlp = DenseMLP(D, text.intermediate_size, text.activation_situ_beta, text.activation_situ_linear_beta)
        else:
            self.block_sparse_moe = StableLatentMoE(text, moe_layer_indices(text).index(layer_idx))

    def forward(self, partial_TD: torch.Tensor, bank: list[torch.Tensor], batch: ForwardBatch) -> torch.Tensor:
        """One layer; `bank` is read, never mutated (K3Model appends the finished block after the call): wrappers
        such as FSDP2 may hand the layer a copy of its arguments."""
        x_TD = attnres.mix_norm(bank, partial_TD, self.self_attention_res_norm, self.self_attention_res_proj,
                                self.input_layernorm)  # fmt: skip
        bank = attnres.close_block(bank, partial_TD, self.block_start)
        cache = batch.cache.layers[self.layer_idx] if batch.cache is not None else None
        a = self.self_attn(x_TD, batch, cache)
        partial_TD = attnres.add_to_partial(partial_TD, a, self.block_start)
        x_TD = attnres.mix_norm(bank, partial_TD, self.mlp_res_norm, self.mlp_res_proj, self.post_attention_layernorm)
        if hasattr(self, "mlp"):
            return partial_TD + self.mlp(x_TD)
        moe = self.block_sparse_moe
        routes_Tk = None if batch.routed_experts is None else batch.routed_experts[:, moe.moe_index]  # replay
        return partial_TD + moe(x_TD, routes_Tk)


class K3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        text = config
        D = text.hidden_size
        self.embed_tokens = nn.Embedding(text.vocab_size, D, padding_idx=text.pad_token_id)
        self.layers = nn.ModuleList(K3DecoderLayer(text, i) for i in range(text.num_hidden_layers))
        self.norm = RMSNorm(D, text.rms_norm_eps)
        self.output_attn_res_norm = RMSNorm(D, text.rms_norm_eps)
        self.output_attn_res_proj = nn.Linear(D, 1, bias=False)

    def forward(self, batch: ForwardBatch, embeds_TD: torch.Tensor | None = None) -> torch.Tensor:
        """`embeds_TD` replaces the token embeddings (the multimodal model merges image rows into them)."""
        if batch.routed_experts is not None:
            self._check_routes(batch.routed_experts, batch.input_ids_T.shape[0])
        partial_TD = self.embed_tokens(batch.input_ids_T) if embeds_TD is None else embeds_TD
        if batch.mode is Mode.DECODE and batch.context_parallel is None and batch.cache is not None:
            hidden_TD = decode_stack(self, partial_TD, batch)  # every layer in one kernel call, where it applies
            if hidden_TD is not None:
                return hidden_TD
        bank: list[torch.Tensor] = []
        for layer in self.layers:
            out_TD = layer(partial_TD, bank, batch)
            bank = attnres.close_block(bank, partial_TD, layer.block_start)  # as the layer did inside
            partial_TD = out_TD
        return attnres.mix_norm(bank, partial_TD, self.output_attn_res_norm, self.output_attn_res_proj, self.norm)

    def _check_routes(self, routes_TMk: torch.Tensor, T: int) -> None:
        """Replayed routes must be [T, M, k] integers in [0, E) with k distinct experts per token and layer."""
        moe = [layer.block_sparse_moe for layer in self.layers if hasattr(layer, "block_sparse_moe")]
        E = moe[0].gate.weight.shape[0] if moe else 0
        k = moe[0].top_k if moe else 0
        expected = (T, len(moe), k)
        dtype = routes_TMk.dtype
        integer = not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
        if tuple(routes_TMk.shape) != expected or not integer:
            raise ValueError(f"routed_experts must be an integer tensor of shape (T, M, k) = {expected} (tokens, MoE "
                             f"layers, experts per token), got {routes_TMk.dtype} {tuple(routes_TMk.shape)}")  # fmt: skip
        if routes_TMk.numel() and (int(routes_TMk.min()) < 0 or int(routes_TMk.max()) >= E):
            raise ValueError(f"routed_experts must be expert ids in [0, {E}), got values in "
                             f"[{int(routes_TMk.min())}, {int(routes_TMk.max())}]")  # fmt: skip
        sorted_TMk = routes_TMk.sort(dim=-1).values
        if bool((sorted_TMk[..., 1:] == sorted_TMk[..., :-1]).any()):
            raise ValueError("routed_experts repeats an expert within one token's k experts of a layer")


@dataclass
class CausalLMOutput:
    """`K3ForCausalLM.forward`'s result, with Hugging Face's CausalLMOutputWithPast names."""

    logits: torch.Tensor  # [B, T, V]
    loss: torch.Tensor | None = None  # scalar, fp32
    past_key_values: K3Cache | None = None


class K3ForCausalLM(nn.Module):
    """The K3 text model. `K3ForCausalLM(K3Config.preset("tiny"))`, or `K3ForCausalLM.from_pretrained(dir)`."""

    def __init__(self, config: K3Config | str):
        super().__init__()
        if isinstance(config, str):
            config = K3Config.preset(config)
        config.text_config.validate()
        self.config = config
        text = config.text_config
        self.model = K3Model(text)
        self.lm_head = Linear(text.hidden_size, text.vocab_size, bias=False)

    @property
    def text_config(self):
        return self.config.text_config

    # ---- initialisation -------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """The from-scratch training initialisation (call after `to_empty` when built on meta):

        - every Linear weight, the routed experts and the embedding: N(0, initializer_range); the embedding's
          padding row is zero (as the released code's `_init_weights`);
        - every RMSNorm weight (layer norms, q_a/kv_a norms, AttnRes norms, routed_expert_norm, o_norm): 1;
        - AttnRes pseudo-queries (`*_res_proj`, `output_attn_res_proj`): 0, so each mix starts as the plain mean
          of its sources, as the AttnRes paper trains them;
        - KDA `A_log` = 0 and `dt_bias` = softplus^-1(dt) with dt log-uniform in [1e-3, 1e-1] (FLA's layer default
          for the lower-bound gate; K3's own init is unpublished); the short convs: U(-1/sqrt(W), 1/sqrt(W)),
          PyTorch's Conv1d default;
        - router `e_score_correction_bias`: 0 (quantile balancing moves it during training).
        """
        std = self.text_config.initializer_range
        for name, p in self.named_parameters():
            if name.endswith(("_res_proj.weight", "A_log", "e_score_correction_bias")):
                p.zero_()
            elif name.endswith("dt_bias"):
                dt = torch.exp(torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=generator))
                dt = dt.clamp(min=1e-4)
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1
            elif name.endswith("conv1d.weight"):
                bound = 1.0 / math.sqrt(p.shape[-1])
                p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=generator))
            elif p.dim() == 1:  # every remaining vector is a norm weight
                p.fill_(1.0)
            else:
                p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=generator))
        pad = self.text_config.pad_token_id
        if pad is not None:
            self.model.embed_tokens.weight[pad].zero_()

    @torch.no_grad()
    def init_random_weights(self, seed: int = 0) -> None:
        """Non-trivial values in every tensor (for tests and `k3 init`): unlike `init_weights`, no tensor is zero or
        constant, so no mechanism (AttnRes queries, router bias, KDA gate parameters, norm gains) hides behind a
        zero or a one. Magnitudes keep the forward pass well conditioned."""
        gen = torch.Generator().manual_seed(seed)

        def randn(shape):
            return torch.randn(shape, generator=gen)

        for name, p in self.named_parameters():
            if name.endswith(("A_log", "dt_bias", "conv1d.weight")):
                p.copy_(0.5 * randn(p.shape))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.05 * randn(p.shape))  # the size of real router-score gaps, so it changes choices
            elif name.endswith("_res_proj.weight"):
                p.copy_(randn(p.shape) / math.sqrt(p.shape[-1]))
            elif p.dim() == 1:
                p.copy_(1.0 + 0.1 * randn(p.shape))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(randn(p.shape))
            else:
                p.copy_(randn(p.shape) / math.sqrt(p.shape[-1]))

    def to_dtype(self, dtype: torch.dtype) -> K3ForCausalLM:
        """Cast every parameter to `dtype` except those the release keeps in fp32 (`FP32_PARAM_SUFFIXES`)."""
        for name, p in self.named_parameters():
            p.data = p.data.to(torch.float32 if keeps_fp32(name) else dtype)
        return self

    # ---- forward ---------------------------------------------------------------------------------------------
    def hidden_states(self, batch: ForwardBatch, embeds_TD: torch.Tensor | None = None) -> torch.Tensor:
        """The final-norm hidden states [T, D] of the packed tokens of `batch`, before the LM head (the serving
        runner then takes `logits` of the rows it samples; the caller owns the cache's bookkeeping). `embeds_TD`
        [T, D], if given, replaces the token embeddings (image rows merged in)."""
        return self.model(batch, embeds_TD)

    def logits(self, hidden_TD: torch.Tensor, rows_R: torch.Tensor) -> torch.Tensor:
        """LM-head logits [R, V] of the hidden rows `rows_R` only: a step samples a few rows, and the head is
        the largest matmul of a decode step."""
        return self.lm_head(hidden_TD.index_select(0, rows_R))

    def forward_batch(self, batch: ForwardBatch, embeds_TD: torch.Tensor | None = None) -> torch.Tensor:
        """Packed forward: logits [T, V] for the packed tokens of `batch` (updates `batch.cache` in place);
        `embeds_TD` [T, D], if given, replaces the token embeddings."""
        if batch.cache is not None and batch.cache.num_seqs != batch.num_seqs:
            raise ValueError(f"the cache holds {batch.cache.num_seqs} sequences, the batch has {batch.num_seqs}")
        logits = self.lm_head(self.model(batch, embeds_TD))
        if batch.cache is not None:
            batch.cache.advance(batch.seq_lens)
        return logits

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: K3Cache | None = None,
        labels: torch.Tensor | None = None,
        return_dict: bool = True,
        inputs_embeds: torch.Tensor | None = None,
    ) -> CausalLMOutput | torch.Tensor:
        """input_ids [B, T] -> a `CausalLMOutput` as in Hugging Face: `.logits` [B, T, V] (padded positions,
        attention_mask 0, get zero logits), `.loss` with `labels` [B, T] (the mean cross-entropy of logits[:, t]
        against labels[:, t + 1]; labels equal to config.ignore_index, -100, are ignored: set padding to it), else
        None, and `.past_key_values` (the cache passed in). `return_dict=False` returns the bare logits tensor.

        `attention_mask` covers only the tokens of this call (the cache holds the rest); padding may sit anywhere,
        the released convention is left padding. With a cache, row b continues cached sequence b.
        `inputs_embeds` [B, T, D], if given, replaces the embeddings of `input_ids` (as in Hugging Face; the ids
        still give the shape)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(f"labels shape {tuple(labels.shape)} != input_ids shape {tuple(input_ids.shape)}")
        if labels is not None and not return_dict:
            raise ValueError("labels give a loss, which only the CausalLMOutput carries: leave return_dict=True")
        if inputs_embeds is not None and inputs_embeds.shape[:2] != input_ids.shape:
            raise ValueError(f"inputs_embeds shape {tuple(inputs_embeds.shape)} does not start with input_ids shape "
                             f"{tuple(input_ids.shape)}")  # fmt: skip
        logits = self._logits(input_ids, attention_mask, cache, inputs_embeds)
        if not return_dict:
            return logits
        loss = None
        if labels is not None:
            V = logits.shape[-1]
            loss = nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, V),
                                               labels[:, 1:].reshape(-1).to(logits.device),
                                               ignore_index=self.config.ignore_index)  # fmt: skip
        return CausalLMOutput(logits=logits, loss=loss, past_key_values=cache)

    def _logits(self, input_ids, attention_mask, cache, embeds_BTD=None):
        B, T = input_ids.shape
        if attention_mask is None:
            batch = ForwardBatch.from_lengths(input_ids.reshape(-1), [T] * B, cache)
            embeds_TD = None if embeds_BTD is None else embeds_BTD.flatten(0, 1)
            return self.forward_batch(batch, embeds_TD).view(B, T, -1)
        mask = attention_mask.bool()
        if mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(mask.shape)} != input_ids shape {tuple(input_ids.shape)}")
        lens = mask.sum(-1).tolist()
        if min(lens) == 0:
            raise ValueError("a row of attention_mask has no tokens")
        batch = ForwardBatch.from_lengths(input_ids[mask], lens, cache)
        packed = self.forward_batch(batch, None if embeds_BTD is None else embeds_BTD[mask])
        logits = packed.new_zeros(B, T, packed.shape[-1])
        logits[mask] = packed
        return logits

    def new_cache(self, batch_size: int) -> K3Cache:
        p = self.model.embed_tokens.weight
        return K3Cache(self.config, batch_size, dtype=p.dtype, device=p.device)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        eos_token_id: int | None = None,
        seed: int | None = None,
    ) -> torch.Tensor:
        """Greedy (temperature 0) or sampled continuation with the recurrent cache.

        input_ids [B, T], left-padded when rows differ in length. Returns [B, T + n] with n <= max_new_tokens;
        rows that emitted `eos_token_id` are filled with the pad id afterwards."""
        if attention_mask is not None and not bool(attention_mask[:, -1].all()):
            raise ValueError("generate() needs left padding: the last column of attention_mask must be all ones")
        gen = torch.Generator(device=input_ids.device).manual_seed(seed) if seed is not None else None
        B = input_ids.shape[0]
        cache = self.new_cache(B)
        logits = self.forward(input_ids, attention_mask, cache, return_dict=False)[:, -1]
        pad = self.text_config.pad_token_id
        done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
        out = [input_ids]
        for step in range(max_new_tokens):
            nxt = sample(logits, temperature, top_k, top_p, generator=gen)
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            out.append(nxt[:, None])
            if eos_token_id is not None:
                done |= nxt == eos_token_id
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            logits = self.forward(nxt[:, None], None, cache, return_dict=False)[:, -1]
        return torch.cat(out, dim=1)

    # ---- parameter counts ------------------------------------------------------------------------------------
    def num_parameters(self) -> tuple[int, int]:
        """(total, active per token) counted from the tensors at their logical shapes (spec/model.md §13):
        active excludes the input embedding and the unselected routed experts of every MoE layer."""
        text = self.text_config
        total = sum(p.numel() for p in self.parameters())
        per_expert = 3 * text.moe_intermediate_size * text.routed_expert_hidden_size
        moe_layers = sum(text.ffn_kind(i) == "moe" for i in range(text.num_hidden_layers))
        idle = moe_layers * (text.num_experts - text.num_experts_per_token) * per_expert
        return total, total - self.model.embed_tokens.weight.numel() - idle

    # ---- checkpoints -----------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
    ) -> K3ForCausalLM:
        """Load an official-format checkpoint folder (config.json + safetensors, single file or sharded; routed
        experts plain or MXFP4). dtype=None keeps the stored dtypes (bf16 + the fp32 tensors of spec §11)."""
        return load_pretrained(cls, path, dtype=dtype, device=device)

    def save_pretrained(self, path: str | os.PathLike, max_shard_size: int | None = None) -> None:
        """Write config.json + safetensors under the official names, atomically; sharded past `max_shard_size`
        bytes; routed experts as MXFP4 when the config carries a quantization_config."""
        save_pretrained(self, path, max_shard_size=max_shard_size)

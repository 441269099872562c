"""GGUF export in llama.cpp's `kimi-k3` format, so a model trained or initialised here runs in llama.cpp.

The specification is llama.cpp's own K3 support: `conversion/kimi_k3.py` (HF -> GGUF names and reshapes),
`src/models/kimi-k3.cpp` (the keys `load_arch_hparams` reads, the shapes `load_arch_tensors` creates, the graph) and
`src/llama-model.cpp` (`load_hparams`, the keys every model reads). Tensors, in GGUF's numpy layout (the reverse of
ggml's ne; Linear weights stay [out, in]):

    token_embd.weight [V, D]   output.weight [V, D]   output_norm.weight [D]
    output_res_score.weight [D]          = output_attn_res_norm.weight * output_attn_res_proj.weight
    blk.i.attn_norm / ffn_norm.weight    = input_layernorm / post_attention_layernorm
    blk.i.attn_res_score / ffn_res_score = self_attention_res_norm * _proj, mlp_res_norm * _proj (fused products)
  KDA layers:
    blk.i.attn_q/attn_k/attn_v.weight    = q/k/v_proj                blk.i.attn_output.weight = o_proj
    blk.i.ssm_conv1d_{q,k,v}.weight      = q/k/v_conv1d [P, 1, W] reshaped to [1, P, 1, W]
    blk.i.ssm_f_a / ssm_f_b / ssm_beta / ssm_g.weight = f_a_proj / f_b_proj / b_proj / g_proj (the full-rank gate)
    blk.i.ssm_a [H]                      = -exp(A_log)   (folded; unpadded)
    blk.i.ssm_dt.bias [P]                = dt_bias       blk.i.ssm_norm.weight [K] = o_norm
  MLA layers:
    blk.i.attn_q_a / attn_q_b / attn_kv_a_mqa.weight = q_a_proj / q_b_proj / kv_a_proj_with_mqa
    blk.i.attn_q_a_norm / attn_kv_a_norm.weight      = q_a_layernorm / kv_a_layernorm
    blk.i.attn_k_b.weight [H, r, nope]   = kv_b_proj's per-head key rows, transposed (absorbed form)
    blk.i.attn_v_b.weight [H, Dv, r]     = kv_b_proj's per-head value rows
    blk.i.attn_gate.weight               = g_proj (the sigmoid output gate)     blk.i.attn_output.weight = o_proj
  FFN: dense layers (i < first_k_dense_replace) blk.i.ffn_gate/ffn_up/ffn_down.weight = mlp.gate/up/down_proj;
    MoE layers blk.i.ffn_gate_inp.weight = gate.weight, blk.i.exp_probs_b.bias = e_score_correction_bias,
    blk.i.ffn_{gate,up,down}_exps.weight = experts.w1/w3/w2 stacked [E, out, in], blk.i.ffn_routed_down/up/norm =
    routed_expert_down_proj/up_proj/norm, blk.i.ffn_{gate,up,down}_shexp.weight = shared_experts.*_proj.

One deliberate difference from llama.cpp's converter: every llama.cpp RMSNorm uses `rms_norm_eps`, but K3's
q_a/kv_a norms use 1e-6 (model/mla.py). RMSNorm is scale-invariant up to eps, RMSNorm(s x; s^2 e) = RMSNorm(x; e),
so q_a_proj and the latent rows of kv_a_proj_with_mqa are multiplied by s = sqrt(rms_norm_eps / 1e-6): llama.cpp
then computes K3's norms exactly. (The KDA q/k L2 norm's eps, 1e-6 in K3 and rms_norm_eps in llama.cpp, sits behind
a SiLU and cannot be folded; its effect is below fp32 noise for non-tiny q/k.)

`outtype="bf16"` stores the matrices in bf16 and keeps in fp32 what the converter keeps in fp32: 1-D tensors, `*_norm`
weights, tensors without a `.weight` suffix (ssm_a, biases), the router and the KDA convs.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import gguf  # llama.cpp's gguf-py (this module's own name does not shadow it: imports are absolute)
import torch

from openk3.export.gguf_vocab import GGUFVocabError, gguf_vocab
from openk3.model.mla import MLA_LORA_NORM_EPS

log = logging.getLogger("openk3")

ARCH = "kimi-k3"
OUTTYPES = ("f32", "bf16")
# llama.cpp's limits (src/llama-hparams.h) and its general.file_type values (LLAMA_FTYPE_ALL_F32, _MOSTLY_BF16).
MAX_LAYERS, MAX_EXPERTS = 512, 1024
FILE_TYPES = {"f32": 0, "bf16": 32}
GATING_SIGMOID = 2  # LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
QUANT_VERSION = 2  # GGML_QNT_VERSION


class GGUFExportError(ValueError):
    """The model has a feature llama.cpp's kimi-k3 graph does not implement, so its GGUF would compute something
    else."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    data: torch.Tensor  # fp32, contiguous, GGUF's numpy layout

    @property
    def keeps_f32(self) -> bool:
        """Stored in fp32 whatever the outtype (the converter's rule)."""
        return (self.data.dim() <= 1 or self.name.endswith("_norm.weight") or not self.name.endswith(".weight")
                or ".ffn_gate_inp." in self.name or ".ssm_conv1d_" in self.name)  # fmt: skip


def check_exportable(text) -> None:
    """Raise GGUFExportError naming the first feature of `text` (a K3TextConfig) that llama.cpp computes differently."""
    la = text.linear_attn_config
    if la.num_heads != text.num_attention_heads:
        raise GGUFExportError(f"linear_attn_config.num_heads ({la.num_heads}) != num_attention_heads "
                              f"({text.num_attention_heads}): llama.cpp's kimi-k3 sizes KDA and MLA layers with one "
                              f"head count")  # fmt: skip
    for layer in range(text.num_hidden_layers):
        if text.ffn_kind(layer) != ("dense" if layer < text.first_k_dense_replace else "moe"):
            raise GGUFExportError(f"layer {layer} is {text.ffn_kind(layer)} (moe_layer_freq {text.moe_layer_freq}): "
                                  f"llama.cpp's kimi-k3 has dense FFNs exactly in the first first_k_dense_replace "
                                  f"({text.first_k_dense_replace}) layers")  # fmt: skip
    if text.activation_situ_linear_beta <= 0:
        raise GGUFExportError(f"activation_situ_linear_beta ({text.activation_situ_linear_beta}) <= 0: llama.cpp then "
                              f"skips the up-branch tanh cap that openk3 applies")  # fmt: skip
    if text.routed_scaling_factor == 0:
        raise GGUFExportError("routed_scaling_factor is 0: llama.cpp treats 0 as 'no scaling'")
    kinds = {text.layer_kind(layer) for layer in range(text.num_hidden_layers)}
    if kinds != {"kda", "mla"}:
        raise GGUFExportError(f"every layer is {kinds.pop().upper()}: llama.cpp's kimi-k3 needs at least one KDA and "
                              f"one MLA layer (with either cache empty it aborts creating its context)")  # fmt: skip
    if not text.rms_norm_eps > 0:
        raise GGUFExportError(f"rms_norm_eps ({text.rms_norm_eps}) must be positive")
    if text.num_hidden_layers > MAX_LAYERS or text.num_experts > MAX_EXPERTS:
        raise GGUFExportError(f"llama.cpp holds at most {MAX_LAYERS} layers and {MAX_EXPERTS} experts, the model has "
                              f"{text.num_hidden_layers} and {text.num_experts}")  # fmt: skip


def gguf_metadata(text, vocab_size: int) -> dict[str, tuple[str, object]]:
    """The `kimi-k3.*` hyperparameters as {key: (type, value)}, type one of "u32", "f32", "bool", "i32[]"; the keys
    llama.cpp's converter writes for K3 (conversion/kimi_k3.py and TextModel.set_gguf_parameters)."""
    la = text.linear_attn_config
    mla_layers = set(la.full_attn_layers)  # 1-based
    kv_heads = [1 if i + 1 in mla_layers else 0 for i in range(text.num_hidden_layers)]
    a = ARCH
    return {
        f"{a}.context_length": ("u32", text.max_position_embeddings),
        f"{a}.embedding_length": ("u32", text.hidden_size),
        f"{a}.block_count": ("u32", text.num_hidden_layers),
        f"{a}.feed_forward_length": ("u32", text.intermediate_size),
        f"{a}.vocab_size": ("u32", vocab_size),
        f"{a}.attention.head_count": ("u32", text.num_attention_heads),
        # MLA runs as MQA over the latent (one kv head); 0 marks a KDA (recurrent) layer.
        f"{a}.attention.head_count_kv": ("i32[]", kv_heads),
        f"{a}.attention.layer_norm_rms_epsilon": ("f32", text.rms_norm_eps),
        f"{a}.attention.q_lora_rank": ("u32", text.q_lora_rank),
        f"{a}.attention.kv_lora_rank": ("u32", text.kv_lora_rank),
        f"{a}.attention.key_length": ("u32", text.kv_lora_rank + text.qk_rope_head_dim),
        f"{a}.attention.value_length": ("u32", text.kv_lora_rank),
        f"{a}.attention.key_length_mla": ("u32", text.qk_nope_head_dim + text.qk_rope_head_dim),
        f"{a}.attention.value_length_mla": ("u32", text.v_head_dim),
        f"{a}.rope.dimension_count": ("u32", text.qk_rope_head_dim),
        f"{a}.expert_count": ("u32", text.num_experts),
        f"{a}.expert_used_count": ("u32", text.num_experts_per_token),
        f"{a}.expert_group_used_count": ("u32", text.topk_group),
        f"{a}.expert_shared_count": ("u32", text.num_shared_experts),
        f"{a}.expert_feed_forward_length": ("u32", text.moe_intermediate_size),
        f"{a}.expert_latent_length": ("u32", text.routed_expert_hidden_size),
        f"{a}.leading_dense_block_count": ("u32", text.first_k_dense_replace),
        f"{a}.expert_weights_scale": ("f32", text.routed_scaling_factor),
        f"{a}.expert_weights_norm": ("bool", text.moe_renormalize),
        f"{a}.expert_gating_func": ("u32", GATING_SIGMOID),
        f"{a}.ssm.conv_kernel": ("u32", la.short_conv_kernel_size),
        f"{a}.kda.head_dim": ("u32", la.head_dim),
        f"{a}.kda.gate_lower_bound": ("f32", la.gate_lower_bound),
        f"{a}.activation.situ_beta": ("f32", text.activation_situ_beta),
        f"{a}.activation.situ_linear_beta": ("f32", text.activation_situ_linear_beta),
        f"{a}.attn_res.block_size": ("u32", text.attn_res_block_size),
    }  # fmt: skip


def _f32(t: torch.Tensor) -> torch.Tensor:
    """fp32 on the CPU; may be the parameter's own storage, so never modified in place."""
    return t.detach().to("cpu", torch.float32).contiguous()


def _res_score(norm, proj) -> torch.Tensor:
    return _f32(norm.weight).reshape(-1) * _f32(proj.weight).reshape(-1)


def _kda(i: int, attn) -> Iterator[GGUFTensor]:
    b = f"blk.{i}"
    for name, lin in (("attn_q", attn.q_proj), ("attn_k", attn.k_proj), ("attn_v", attn.v_proj),
                      ("ssm_f_a", attn.f_a_proj), ("ssm_f_b", attn.f_b_proj), ("ssm_beta", attn.b_proj),
                      ("ssm_g", attn.g_proj), ("attn_output", attn.o_proj)):  # fmt: skip
        yield GGUFTensor(f"{b}.{name}.weight", _f32(lin.weight))
    for x in "qkv":
        w = _f32(getattr(attn, f"{x}_conv1d").weight)  # [P, 1, W]
        yield GGUFTensor(f"{b}.ssm_conv1d_{x}.weight", w.reshape(1, w.shape[0], 1, w.shape[-1]))
    yield GGUFTensor(f"{b}.ssm_a", -torch.exp(_f32(attn.A_log)))
    yield GGUFTensor(f"{b}.ssm_dt.bias", _f32(attn.dt_bias))
    yield GGUFTensor(f"{b}.ssm_norm.weight", _f32(attn.o_norm.weight))


def _mla(i: int, attn, eps_scale: float) -> Iterator[GGUFTensor]:
    b, H, r = f"blk.{i}", attn.num_heads, attn.kv_rank
    kv_a = _f32(attn.kv_a_proj_with_mqa.weight)
    kv_a = torch.cat([kv_a[:r] * eps_scale, kv_a[r:]])  # only the latent rows feed kv_a_layernorm (module docstring)
    yield GGUFTensor(f"{b}.attn_q_a.weight", _f32(attn.q_a_proj.weight) * eps_scale)
    yield GGUFTensor(f"{b}.attn_q_a_norm.weight", _f32(attn.q_a_layernorm.weight))
    yield GGUFTensor(f"{b}.attn_q_b.weight", _f32(attn.q_b_proj.weight))
    yield GGUFTensor(f"{b}.attn_kv_a_mqa.weight", kv_a)
    yield GGUFTensor(f"{b}.attn_kv_a_norm.weight", _f32(attn.kv_a_layernorm.weight))
    kv_b_HXr = _f32(attn.kv_b_proj.weight).view(H, attn.nope + attn.v_dim, r)  # X = nope + v per head
    yield GGUFTensor(f"{b}.attn_k_b.weight", kv_b_HXr[:, : attn.nope].transpose(1, 2).contiguous())  # [H, r, nope]
    yield GGUFTensor(f"{b}.attn_v_b.weight", kv_b_HXr[:, attn.nope :].contiguous())  # [H, Dv, r]
    yield GGUFTensor(f"{b}.attn_gate.weight", _f32(attn.g_proj.weight))
    yield GGUFTensor(f"{b}.attn_output.weight", _f32(attn.o_proj.weight))


def _moe(i: int, moe) -> Iterator[GGUFTensor]:
    b = f"blk.{i}"
    yield GGUFTensor(f"{b}.ffn_gate_inp.weight", _f32(moe.gate.weight))
    yield GGUFTensor(f"{b}.exp_probs_b.bias", _f32(moe.gate.e_score_correction_bias))
    for name, w in (("gate", moe.experts.w1), ("up", moe.experts.w3), ("down", moe.experts.w2)):
        yield GGUFTensor(f"{b}.ffn_{name}_exps.weight", _f32(w))
    yield GGUFTensor(f"{b}.ffn_routed_down.weight", _f32(moe.routed_expert_down_proj.weight))
    yield GGUFTensor(f"{b}.ffn_routed_norm.weight", _f32(moe.routed_expert_norm.weight))
    yield GGUFTensor(f"{b}.ffn_routed_up.weight", _f32(moe.routed_expert_up_proj.weight))
    if moe.shared_experts is not None:
        for name in ("gate", "up", "down"):
            yield GGUFTensor(f"{b}.ffn_{name}_shexp.weight", _f32(getattr(moe.shared_experts, f"{name}_proj").weight))


def gguf_tensors(model) -> Iterator[GGUFTensor]:
    """Every tensor of the text model `model` (a K3ForCausalLM) under its GGUF name, fp32, in GGUF's layout."""
    text = model.config.text_config
    check_exportable(text)
    eps_scale = math.sqrt(text.rms_norm_eps / MLA_LORA_NORM_EPS)
    body = model.model
    yield GGUFTensor("token_embd.weight", _f32(body.embed_tokens.weight))
    for i, layer in enumerate(body.layers):
        b = f"blk.{i}"
        yield GGUFTensor(f"{b}.attn_norm.weight", _f32(layer.input_layernorm.weight))
        yield GGUFTensor(f"{b}.attn_res_score.weight", _res_score(layer.self_attention_res_norm,
                                                                   layer.self_attention_res_proj))  # fmt: skip
        yield from _kda(i, layer.self_attn) if layer.kind == "kda" else _mla(i, layer.self_attn, eps_scale)
        yield GGUFTensor(f"{b}.ffn_norm.weight", _f32(layer.post_attention_layernorm.weight))
        yield GGUFTensor(f"{b}.ffn_res_score.weight", _res_score(layer.mlp_res_norm, layer.mlp_res_proj))
        if hasattr(layer, "mlp"):
            for name in ("gate", "up", "down"):
                yield GGUFTensor(f"{b}.ffn_{name}.weight", _f32(getattr(layer.mlp, f"{name}_proj").weight))
        else:
            yield from _moe(i, layer.block_sparse_moe)
    yield GGUFTensor("output_res_score.weight", _res_score(body.output_attn_res_norm, body.output_attn_res_proj))
    yield GGUFTensor("output_norm.weight", _f32(body.norm.weight))
    yield GGUFTensor("output.weight", _f32(model.lm_head.weight))


def _stored(tensor: GGUFTensor, outtype: str):
    """(GGML type name, numpy array) as written: bf16 is torch's round-to-nearest-even, as raw [..., 2n] bytes."""
    if outtype == "bf16" and not tensor.keeps_f32:
        return "BF16", tensor.data.to(torch.bfloat16).view(torch.uint8).numpy()
    return "F32", tensor.data.numpy()


def _text_model(model):
    """The text model of `model`; a multimodal model's vision tower and projector are not exported (notice)."""
    text_model = getattr(model, "language_model", model)
    if text_model is not model or model.config.vision_config is not None:
        log.warning("GGUF export: writing the text model only; llama.cpp's kimi-k3 has no vision tower, so "
                    "vision_tower.* and mm_projector.* are not exported")  # fmt: skip
    return text_model


def export_gguf(model, tokenizer, path: str | os.PathLike, outtype: str = "f32", name: str = "openk3") -> str:
    """Write `model` (K3ForCausalLM; a K3ForConditionalGeneration exports its text model) and `tokenizer` (from
    `openk3.data.tokenizer.load_tokenizer`) as one llama.cpp `kimi-k3` GGUF file at `path`, atomically (temp file +
    rename). `outtype`: "f32", or "bf16" for the matrices. Returns the path. Raises GGUFExportError (a ValueError)
    for a model or tokenizer llama.cpp would run differently."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {OUTTYPES}, got {outtype!r}")
    model = _text_model(model)
    text = model.config.text_config
    check_exportable(text)
    try:
        vocab = gguf_vocab(tokenizer, text.vocab_size)
    except GGUFVocabError as err:
        raise GGUFExportError(str(err)) from err
    path = os.fspath(path)
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.tmp")
    gguf_log = logging.getLogger("gguf")
    level = gguf_log.level
    gguf_log.setLevel(logging.WARNING)  # its INFO lines name the temp file
    writer = gguf.GGUFWriter(tmp, ARCH)
    try:
        writer.add_type("model")
        writer.add_name(name)
        writer.add_file_type(FILE_TYPES[outtype])
        writer.add_quantization_version(QUANT_VERSION)
        types = {"u32": gguf.GGUFValueType.UINT32, "f32": gguf.GGUFValueType.FLOAT32, "bool": gguf.GGUFValueType.BOOL}
        for key, (kind, value) in gguf_metadata(text, text.vocab_size).items():
            if kind == "i32[]":
                writer.add_array(key, [int(v) for v in value])  # ints pack as INT32, as the converter writes
            else:
                writer.add_key_value(key, value, types[kind])
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(vocab.pre)
        writer.add_token_list(vocab.tokens)
        writer.add_token_types(vocab.token_types)
        writer.add_token_merges(vocab.merges)
        for role in ("bos", "eos", "pad"):
            token = getattr(text, f"{role}_token_id")
            if token is not None:
                writer.add_uint32(f"tokenizer.ggml.{'padding' if role == 'pad' else role}_token_id", token)
        writer.add_add_bos_token(False)  # openk3 encodes without bos (`encode(add_bos=False)`)
        writer.add_add_eos_token(False)
        for tensor in gguf_tensors(model):
            kind, data = _stored(tensor, outtype)
            writer.add_tensor(tensor.name, data, raw_dtype=gguf.GGMLQuantizationType[kind])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    finally:
        writer.close()
        gguf_log.setLevel(level)
        if os.path.exists(tmp):
            os.remove(tmp)
    return path

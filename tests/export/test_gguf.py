"""GGUF export in llama.cpp's kimi-k3 format: every tensor reads back with the name, shape, type and bytes that
llama.cpp's converter and loader specify (computed here from the parameters by name, independently of the exporter's
walk over the modules), the loader's metadata keys hold the config's values, bf16 keeps the converter's fp32 tensors,
the tokenizers become byte-level BPE vocabularies, the CLI writes one, and unsupported features are named errors.
With llama-cpp-python installed, llama.cpp's logits match openk3's and its tokenizer matches ours."""

from __future__ import annotations

import base64
import collections
import inspect
import json
import logging
import math
import re
import textwrap

import pytest
import torch
from config_edit import edited_preset
from fixture_paths import PLAIN
from gguf import GGUFReader, GGUFValueType

from openk3 import K3Config, K3ForCausalLM
from openk3.cli import main
from openk3.data.tokenizer import ByteTokenizer, load_tokenizer, train_bpe
from openk3.export import GGUFExportError, export_gguf
from openk3.export.gguf_vocab import CONTROL, KIMI_PATTERN, NORMAL, UNUSED, byte_symbols, gguf_vocab

# Metadata llama.cpp reads for a kimi-k3 GGUF (llama-cpp-python 0.3.36's vendored llama.cpp). Required ones (a
# `get_key` without `false`): `llama_model_base::load_hparams` in src/llama-model.cpp (context_length,
# embedding_length, block_count), `llama_model_kimi_k3::load_arch_hparams` in src/models/kimi-k3.cpp (the rest of
# this list) and `llama_vocab::impl::load` in src/llama-vocab.cpp (tokenizer.ggml.model, .tokens; .merges for a
# non-"kimi-k2" gpt2 vocabulary).
REQUIRED = [
    "general.architecture", "kimi-k3.context_length", "kimi-k3.embedding_length", "kimi-k3.block_count",
    "kimi-k3.attention.layer_norm_rms_epsilon", "kimi-k3.attention.key_length_mla",
    "kimi-k3.attention.value_length_mla", "kimi-k3.attention.kv_lora_rank", "kimi-k3.ssm.conv_kernel",
    "kimi-k3.kda.head_dim", "kimi-k3.expert_feed_forward_length", "kimi-k3.expert_shared_count",
    "kimi-k3.expert_gating_func", "kimi-k3.attn_res.block_size", "kimi-k3.activation.situ_beta",
    "kimi-k3.activation.situ_linear_beta", "tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
]  # fmt: skip


def expected_metadata(text) -> dict:
    """key -> value for the tiny model; optional keys too, where a default would compute something else (the head
    counts, the MLA lengths, the expert routing, the KDA gate bound)."""
    la = text.linear_attn_config
    return {
        "general.architecture": "kimi-k3", "general.file_type": 0, "kimi-k3.context_length": 1048576,
        "kimi-k3.embedding_length": 192, "kimi-k3.block_count": 9, "kimi-k3.feed_forward_length": 512,
        "kimi-k3.vocab_size": 1024, "kimi-k3.attention.head_count": 3,
        "kimi-k3.attention.head_count_kv": [0, 0, 0, 1, 0, 0, 0, 1, 1],  # MLA at 0-based 3, 7, 8
        "kimi-k3.attention.layer_norm_rms_epsilon": pytest.approx(1e-5), "kimi-k3.attention.q_lora_rank": 96,
        "kimi-k3.attention.kv_lora_rank": 64, "kimi-k3.attention.key_length": 64 + 32,
        "kimi-k3.attention.value_length": 64, "kimi-k3.attention.key_length_mla": 64 + 32,
        "kimi-k3.attention.value_length_mla": 64, "kimi-k3.rope.dimension_count": 32, "kimi-k3.expert_count": 8,
        "kimi-k3.expert_used_count": 2, "kimi-k3.expert_shared_count": 2, "kimi-k3.expert_feed_forward_length": 128,
        "kimi-k3.expert_latent_length": 96, "kimi-k3.leading_dense_block_count": 1,
        "kimi-k3.expert_weights_scale": 1.0, "kimi-k3.expert_weights_norm": True, "kimi-k3.expert_gating_func": 2,
        "kimi-k3.ssm.conv_kernel": la.short_conv_kernel_size, "kimi-k3.kda.head_dim": 64,
        "kimi-k3.kda.gate_lower_bound": -5.0, "kimi-k3.activation.situ_beta": 4.0,
        "kimi-k3.activation.situ_linear_beta": 25.0, "kimi-k3.attn_res.block_size": 3,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.bos_token_id": 768,
        "tokenizer.ggml.eos_token_id": 770, "tokenizer.ggml.padding_token_id": 1023,
        "tokenizer.ggml.add_bos_token": False,
    }  # fmt: skip


# Our parameter name (the release's HF name without `language_model.`) -> GGUF name, as conversion/kimi_k3.py and
# gguf-py's tensor_mapping.py map them ({} is the layer; "gate" is resolved by the layer kind).
SIMPLE = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.f_a_proj.weight": "ssm_f_a.weight", "self_attn.f_b_proj.weight": "ssm_f_b.weight",
    "self_attn.b_proj.weight": "ssm_beta.weight", "self_attn.o_norm.weight": "ssm_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.dt_bias": "ssm_dt.bias",
    "self_attn.q_b_proj.weight": "attn_q_b.weight", "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.e_score_correction_bias": "exp_probs_b.bias",
    "block_sparse_moe.experts.w1": "ffn_gate_exps.weight", "block_sparse_moe.experts.w3": "ffn_up_exps.weight",
    "block_sparse_moe.experts.w2": "ffn_down_exps.weight",
    "block_sparse_moe.routed_expert_down_proj.weight": "ffn_routed_down.weight",
    "block_sparse_moe.routed_expert_up_proj.weight": "ffn_routed_up.weight",
    "block_sparse_moe.routed_expert_norm.weight": "ffn_routed_norm.weight",
    "block_sparse_moe.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "block_sparse_moe.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "block_sparse_moe.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}  # fmt: skip
RES = {"self_attention_res": "attn_res_score.weight", "mlp_res": "ffn_res_score.weight"}


def expected_tensors(model: K3ForCausalLM) -> dict[str, torch.Tensor]:
    """GGUF name -> fp32 array in GGUF's numpy layout, from the parameters by name."""
    text = model.text_config
    params = {n: p.detach().float() for n, p in model.named_parameters()}
    s = math.sqrt(text.rms_norm_eps / 1e-6)  # folds K3's 1e-6 q_a/kv_a norm eps into llama.cpp's rms_norm_eps
    out = {"output_res_score.weight": params.pop("model.output_attn_res_norm.weight")
           * params.pop("model.output_attn_res_proj.weight")[0]}  # fmt: skip
    for name, t in params.items():
        if name in SIMPLE:
            out[SIMPLE[name]] = t
            continue
        i, rest = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name).groups()
        blk = f"blk.{i}."
        if rest in SIMPLE:
            out[blk + SIMPLE[rest]] = t
        elif rest.endswith("_res_norm.weight"):
            site = rest.removesuffix("_norm.weight")
            out[blk + RES[site]] = t * params[f"model.layers.{i}.{site}_proj.weight"][0]
        elif rest.endswith("_res_proj.weight"):
            continue
        elif rest == "self_attn.A_log":
            out[blk + "ssm_a"] = -torch.exp(t)
        elif rest.endswith("_conv1d.weight"):
            out[blk + f"ssm_conv1d_{rest[len('self_attn.')]}.weight"] = t.reshape(1, t.shape[0], 1, t.shape[2])
        elif rest == "self_attn.g_proj.weight":
            out[blk + ("ssm_g.weight" if text.layer_kind(int(i)) == "kda" else "attn_gate.weight")] = t
        elif rest == "self_attn.q_a_proj.weight":
            out[blk + "attn_q_a.weight"] = t * s
        elif rest == "self_attn.kv_a_proj_with_mqa.weight":
            r = text.kv_lora_rank
            out[blk + "attn_kv_a_mqa.weight"] = torch.cat([t[:r] * s, t[r:]])
        elif rest == "self_attn.kv_b_proj.weight":
            H, nope = text.num_attention_heads, text.qk_nope_head_dim
            kv = t.view(H, nope + text.v_head_dim, text.kv_lora_rank)
            out[blk + "attn_k_b.weight"] = kv[:, :nope].transpose(1, 2)
            out[blk + "attn_v_b.weight"] = kv[:, nope:]
        else:
            raise AssertionError(f"no GGUF name for {name}")
    return {k: v.contiguous() for k, v in out.items()}


def keeps_f32(name: str, t: torch.Tensor) -> bool:
    """The converter's fp32 set: 1-D tensors, *_norm, no .weight suffix, the router, the KDA convs."""
    return (t.dim() == 1 or name.endswith("_norm.weight") or not name.endswith(".weight")
            or "ffn_gate_inp" in name or "ssm_conv1d" in name)  # fmt: skip


@pytest.fixture(scope="module")
def tiny():
    model = K3ForCausalLM(K3Config.preset("tiny"))
    model.init_random_weights(0)
    return model


def _fields(reader: GGUFReader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


@pytest.mark.parametrize("outtype", ["f32", "bf16"])
def test_tensors_read_back(tiny, tmp_path, outtype):
    path = export_gguf(tiny, ByteTokenizer(1024, 768, 770, 1023), tmp_path / "m.gguf", outtype=outtype)
    reader = GGUFReader(path)
    expected = expected_tensors(tiny)
    assert sorted(t.name for t in reader.tensors) == sorted(expected)
    assert len(reader.tensors) == 242
    bf16 = 0
    for t in reader.tensors:
        want = expected[t.name]
        assert tuple(reversed(t.shape.tolist())) == tuple(want.shape), t.name  # GGUF stores ggml's ne order
        if outtype == "bf16" and not keeps_f32(t.name, want):
            assert t.tensor_type.name == "BF16", t.name
            assert t.data.tobytes() == want.to(torch.bfloat16).view(torch.int16).numpy().tobytes(), t.name
            bf16 += 1
        else:
            assert t.tensor_type.name == "F32", t.name
            assert t.data.tobytes() == want.numpy().tobytes(), t.name
    # 6 KDA layers x 8 matrices, 3 MLA x 7, 1 dense FFN x 3, 8 MoE x 8 (the router stays fp32), embedding + head
    assert bf16 == (0 if outtype == "f32" else 6 * 8 + 3 * 7 + 3 + 8 * 8 + 2)
    assert _fields(reader)["general.file_type"] == (0 if outtype == "f32" else 32)


def test_metadata_llama_cpp_requires(tiny, tmp_path):
    reader = GGUFReader(export_gguf(tiny, ByteTokenizer(1024, 768, 770, 1023), tmp_path / "m.gguf"))
    fields = _fields(reader)
    missing = [k for k in REQUIRED if k not in fields]
    assert not missing
    for key, value in expected_metadata(tiny.text_config).items():
        assert fields[key] == value, key
    # llama.cpp checks the types: u32 counts, f32 floats, a bool, an INT32 array for the per-layer kv heads.
    assert reader.fields["kimi-k3.block_count"].types == [GGUFValueType.UINT32]
    assert reader.fields["kimi-k3.kda.gate_lower_bound"].types == [GGUFValueType.FLOAT32]
    assert reader.fields["kimi-k3.expert_weights_norm"].types == [GGUFValueType.BOOL]
    assert reader.fields["kimi-k3.attention.head_count_kv"].types == [GGUFValueType.ARRAY, GGUFValueType.INT32]
    assert reader.fields["tokenizer.ggml.token_type"].types == [GGUFValueType.ARRAY, GGUFValueType.INT32]
    # The byte vocabulary: ids 0-255 are GPT-2's byte symbols, the specials CONTROL, the rest UNUSED fillers.
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert len(tokens) == 1024 and tokens[:256] == byte_symbols() and tokens[ord("a")] == "a"
    assert tokens[32] == "Ġ" and tokens[10] == "Ċ"
    assert (tokens[768], tokens[770], tokens[1023]) == ("[BOS]", "<|end_of_msg|>", "[PAD]")
    assert [i for i, t in enumerate(types) if t == CONTROL] == [768, 770, 1023]
    assert types[:256] == [NORMAL] * 256 and types[300] == UNUSED
    assert len(fields["tokenizer.ggml.merges"]) == 1  # the one merge that never fires


def test_bpe_and_tiktoken_vocabularies(tmp_path, caplog):
    texts = ["the cat sat on the mat 12345 " * 20, "def f(x):\n    return x + 1\n" * 20]
    bpe = train_bpe(texts, 1024, {"bos": 768, "eos": 770, "pad": 1023})
    vocab = gguf_vocab(bpe, 1024)
    data = json.loads(bpe._tok.to_str())
    assert vocab.pre == "gpt-2" and len(vocab.tokens) == 1024
    assert vocab.tokens[:300] == [bpe._tok.id_to_token(i) for i in range(300)]
    assert vocab.merges[:5] == [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"][:5]]
    assert vocab.tokens[770] == "<|end_of_msg|>" and vocab.token_types[770] == CONTROL
    assert vocab.token_types[767] == UNUSED and vocab.tokens[767].startswith("<|unused_base_")  # corpus too small
    digits = train_bpe(texts, 1024, {"bos": 768, "eos": 770, "pad": 1023}, split_digits=True)
    assert gguf_vocab(digits, 1024).pre == "starcoder"

    # A tiktoken-format tokenizer: token bytes by rank, merges recovered from the ranks, 256 CONTROL specials.
    ranks = [bytes([i]) for i in range(256)] + [b"th", b"the", b"in", b"  ", b" the", b"\xe4\xb8"]
    (tmp_path / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in
                                                     enumerate(ranks)), encoding="utf-8")  # fmt: skip
    config = {"pat_str": r"\S+|\s+", "added_tokens_decoder": {"262": {"content": "[BOS]"}},
              "bos_token": "[BOS]"}  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    text = K3Config.from_dict(
        edited_preset(
            "tiny",
            text_config__vocab_size=518,
            text_config__bos_token_id=262,
            text_config__eos_token_id=264,
            text_config__pad_token_id=517,
        )
    ).text_config
    with caplog.at_level(logging.WARNING, logger="openk3"):
        vocab = gguf_vocab(load_tokenizer(tmp_path, text), 518)
    assert "not Kimi's" in caplog.text
    sym = byte_symbols()
    assert vocab.pre == "kimi-k2"
    assert vocab.tokens[256:262] == ["th", "the", "in", "ĠĠ", "Ġthe", sym[0xE4] + sym[0xB8]]
    assert vocab.merges == ["t h", "th e", "i n", "Ġ Ġ", "Ġ the", f"{sym[0xE4]} {sym[0xB8]}"]
    assert vocab.tokens[262] == "[BOS]" and vocab.tokens[263] == "<|reserved_token_263|>"
    assert vocab.token_types[262:] == [CONTROL] * 256 and vocab.token_types[:262] == [NORMAL] * 262


def test_unsupported_features_are_named_errors(tmp_path):
    def export(**changes):
        model = K3ForCausalLM(K3Config.from_dict(edited_preset("tiny", **changes)))
        return export_gguf(model, ByteTokenizer(1024, 768, 770, 1023), tmp_path / "x.gguf")

    with pytest.raises(GGUFExportError, match="moe_layer_freq"):
        export(text_config__moe_layer_freq=2)
    with pytest.raises(GGUFExportError, match="num_heads"):
        export(text_config__linear_attn_config__num_heads=2)
    with pytest.raises(GGUFExportError, match="at least one KDA and one MLA"):
        export(text_config__linear_attn_config__full_attn_layers=[],
               text_config__linear_attn_config__kda_layers=list(range(1, 10)))  # fmt: skip
    with pytest.raises(GGUFExportError, match="activation_situ_linear_beta"):
        export(text_config__activation_situ_linear_beta=-1.0)
    with pytest.raises(ValueError, match="outtype"):
        export_gguf(K3ForCausalLM("tiny"), ByteTokenizer(1024), tmp_path / "x.gguf", outtype="f16")
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_cli_export_gguf(tmp_path, capsys):
    ckpt, out = tmp_path / "ckpt", tmp_path / "tiny.gguf"
    assert main(["init", "--preset", "tiny", "--out", str(ckpt)]) == 0
    assert main(["export", "--ckpt", str(ckpt), "--format", "gguf", "--out", str(out), "--outtype", "bf16"]) == 0
    assert "kimi-k3 GGUF, bf16" in capsys.readouterr().out
    reader = GGUFReader(out)
    assert len(reader.tensors) == 242 and _fields(reader)["general.file_type"] == 32
    assert main(["export", "--ckpt", str(ckpt), "--out", str(tmp_path / "st"), "--outtype", "bf16"]) == 2
    assert "--outtype is for --format gguf" in capsys.readouterr().err
    assert main(["export", "--ckpt", str(ckpt), "--format", "gguf", "--out", str(out), "--dtype", "float32"]) == 2
    assert "--format safetensors" in capsys.readouterr().err
    assert main(["export", "--ckpt", str(ckpt), "--format", "gguf", "--out", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_vision_checkpoint_exports_text_model(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="openk3"):
        assert main(["export", "--ckpt", PLAIN, "--format", "gguf", "--out", str(tmp_path / "v.gguf")]) == 0
    assert "text model only" in caplog.text
    names = [t.name for t in GGUFReader(tmp_path / "v.gguf").tensors]
    assert len(names) == 242 and not any("vision" in n or "mm_" in n for n in names)


def _tokenizers(kind: str, tmp_path):
    """A tokenizer for the tiny model's 1024 ids: bytes, our BPE (plain or digit-split), or a tiktoken-format one
    with Kimi's split pattern (its ranks taken from our BPE)."""
    if kind == "byte":
        return ByteTokenizer(1024, 768, 770, 1023)
    texts = [inspect.getsource(m) for m in (json, textwrap, collections)]  # enough text to fill 768 base ranks
    bpe = train_bpe(texts, 1024, {"bos": 768, "eos": 770, "pad": 1023}, split_digits=kind == "bpe-digits")
    if kind != "tiktoken":
        return bpe
    inv = {c: b for b, c in enumerate(byte_symbols())}
    ranks = [bytes(inv[c] for c in bpe._tok.id_to_token(i)) for i in range(768)]
    (tmp_path / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in
                                                     enumerate(ranks)), encoding="utf-8")  # fmt: skip
    names = {"bos_token": "[BOS]", "eos_token": "<|end_of_msg|>", "pad_token": "[PAD]"}
    config = {"pat_str": KIMI_PATTERN, **names,
              "added_tokens_decoder": {"768": {"content": "[BOS]"}, "770": {"content": "<|end_of_msg|>"},
                                       "1023": {"content": "[PAD]"}}}  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return load_tokenizer(tmp_path, K3Config.preset("tiny").text_config)


@pytest.mark.parametrize("kind", ["byte", "bpe", "bpe-digits", "tiktoken"])
def test_llama_cpp_tokenizes_like_openk3(tiny, tmp_path, kind):
    """llama.cpp's tokenizer on the exported vocabulary (pre gpt-2, starcoder, kimi-k2) gives our ids and text."""
    llama_cpp = pytest.importorskip("llama_cpp")
    tok = _tokenizers(kind, tmp_path)
    path = export_gguf(tiny, tok, tmp_path / "m.gguf")
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    samples = ["Hello, world! 12345 + 67 = 12412", "def f(x):\n    return x ** 2  # square\n\n\n",
               "naïve café — 北京欢迎你 🙂 x", "   spaces and\ttabs\r\nlines", "it's we've THEY'LL don't",
               "[BOS] <|end_of_msg|> typed as text"]  # fmt: skip
    for text in samples:
        ids = tok.encode(text)
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == ids, text
        assert llm.detokenize(ids).decode() == text


def test_llama_cpp_matches_openk3(tmp_path):
    """llama.cpp runs the export of a tiny `k3 init` checkpoint with openk3's logits (fp32, fp32 caches)."""
    pytest.importorskip("llama_cpp")
    from bench_scripts import load

    logits_rel_rms = load("cpu").logits_rel_rms  # benchmarks/cpu.py's fidelity check
    assert main(["init", "--preset", "tiny", "--out", str(tmp_path)]) == 0
    result = logits_rel_rms(str(tmp_path), n_tokens=64, seed=0)
    assert result["rel_rms"] <= 1e-5, result

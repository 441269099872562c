"""Checkpoint compatibility with the official K3 code: fixture logits, byte-exact re-save, MXFP4, loud errors."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch
from fixture_paths import LOGITS, MXFP4, PLAIN
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from openk3 import K3Config, K3ForCausalLM
from openk3.utils import rel_rms


def _tensors(folder):
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 - safe_open is not iterable
    return out


@pytest.mark.parametrize("folder", [PLAIN, MXFP4])
def test_fixture_reproduces_official_logits(folder):
    ref = load_file(LOGITS)
    model = K3ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model(ref["input_ids"]).logits
    err = rel_rms(logits, ref["logits"])
    print(f"{os.path.basename(folder)}: relative RMS vs official fp32 logits = {err:.3e}")
    assert err <= 1e-4  # STYLE.md §5; about 1e-6 observed
    assert torch.equal(logits.argmax(-1), ref["logits"].argmax(-1))


def test_stored_dtypes_are_kept_and_fp32_extras_stay_fp32():
    model = K3ForCausalLM.from_pretrained(PLAIN)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["model.layers.0.self_attn.A_log"] == torch.float32
    assert dtypes["model.layers.0.self_attn.q_conv1d.weight"] == torch.float32
    assert dtypes["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"] == torch.float32
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16
    assert model.model.layers[0].self_attn.A_log.shape == (2,)  # unpadded from the stored [32]
    bf16 = K3ForCausalLM.from_pretrained(PLAIN, dtype=torch.bfloat16)
    assert bf16.model.layers[0].self_attn.dt_bias.dtype == torch.float32


def test_bf16_model_tracks_fp32_reference():
    ref = load_file(LOGITS)
    model = K3ForCausalLM.from_pretrained(PLAIN)  # stored dtypes: bf16 with the fp32 extras
    with torch.no_grad():
        logits = model(ref["input_ids"]).logits
    assert logits.dtype == torch.bfloat16
    # Each bf16 layer adds ~1e-2 relative error (bf16 ops are checked at <= 1e-2 in tests/ops); nine random layers
    # accumulate 2.4e-2 with identical expert choices. A wrong rounding order or an fp32 tensor cast to bf16
    # shows up as a larger error or a changed prediction.
    assert rel_rms(logits.float(), ref["logits"]) <= 4e-2
    assert (logits.float().argmax(-1) == ref["logits"].argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("folder, shard", [(PLAIN, None), (MXFP4, 1_100_000)])
def test_resave_gives_identical_text_tensors(folder, shard, tmp_path):
    model = K3ForCausalLM.from_pretrained(folder)
    model.save_pretrained(tmp_path, max_shard_size=shard)
    original = {k: v for k, v in _tensors(folder).items() if k.startswith("language_model.")}
    saved = _tensors(tmp_path)
    assert set(saved) == set(original)
    for key, tensor in original.items():
        assert saved[key].dtype == tensor.dtype, key
        assert saved[key].shape == tensor.shape, key
        assert torch.equal(saved[key].view(torch.uint8), tensor.view(torch.uint8)), key
    if shard is not None:
        with open(tmp_path / "model.safetensors.index.json") as f:
            index = json.load(f)
        assert set(index["weight_map"]) == set(original)
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in original.values())
    again = K3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ref = load_file(LOGITS)
    with torch.no_grad():
        assert rel_rms(again(ref["input_ids"]).logits, ref["logits"]) <= 1e-4


def test_plain_model_saved_as_mxfp4_loads_identically(tmp_path):
    model = K3ForCausalLM.from_pretrained(PLAIN)
    model.config = K3Config.from_pretrained(MXFP4)  # same model, quantized layout
    model.save_pretrained(tmp_path)
    assert any(k.endswith("weight_packed") for k in _tensors(tmp_path))
    again = K3ForCausalLM.from_pretrained(tmp_path)
    for (n, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), n


def test_vision_tensors_are_skipped_with_a_notice(caplog):
    with caplog.at_level(logging.WARNING, logger="openk3"):
        K3ForCausalLM.from_pretrained(PLAIN)
    notices = [r.getMessage() for r in caplog.records if "vision" in r.getMessage()]
    assert len(notices) == 1 and "12 vision tensors" in notices[0]


def _copy_with(tmp_path, edit):
    dst = tmp_path / "ckpt"
    shutil.copytree(PLAIN, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_missing_tensor_is_named(tmp_path):
    dst = _copy_with(tmp_path, lambda t: t.pop("language_model.model.layers.2.self_attn.dt_bias"))
    with pytest.raises(ValueError, match=r"missing tensors: language_model\.model\.layers\.2\.self_attn\.dt_bias"):
        K3ForCausalLM.from_pretrained(dst)


def test_missing_expert_is_named(tmp_path):
    dst = _copy_with(tmp_path, lambda t: t.pop("language_model.model.layers.4.block_sparse_moe.experts.5.w2.weight"))
    with pytest.raises(ValueError, match=r"layers\.4\.block_sparse_moe\.experts\.5\.w2"):
        K3ForCausalLM.from_pretrained(dst)


def test_unexpected_tensor_is_named(tmp_path):
    def edit(t):
        t["language_model.model.layers.0.self_attn.extra_thing"] = torch.zeros(3)

    with pytest.raises(ValueError, match=r"unexpected tensors: .*extra_thing"):
        K3ForCausalLM.from_pretrained(_copy_with(tmp_path, edit))


def test_wrong_shape_is_named(tmp_path):
    def edit(t):
        t["language_model.model.layers.3.self_attn.q_b_proj.weight"] = torch.zeros(47, 32, dtype=torch.bfloat16)

    with pytest.raises(
        ValueError, match=r"wrongly shaped tensors: .*q_b_proj\.weight \(47, 32\) \(expected \(48, 32\)\)"
    ):
        K3ForCausalLM.from_pretrained(_copy_with(tmp_path, edit))


def test_nonzero_a_log_padding_fails_loudly(tmp_path):
    def edit(t):
        t["language_model.model.layers.1.self_attn.A_log"][7] = 0.5

    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.A_log.*exactly zero"):
        K3ForCausalLM.from_pretrained(_copy_with(tmp_path, edit))


def test_nan_mxfp4_scale_is_rejected(tmp_path):
    dst = tmp_path / "q"
    shutil.copytree(MXFP4, dst)
    with open(dst / "model.safetensors.index.json") as f:
        key = "language_model.model.layers.2.block_sparse_moe.experts.3.w1.weight_scale"
        shard = json.load(f)["weight_map"][key]
    tensors = load_file(dst / shard)
    tensors[key][0, 0] = 255
    save_file(tensors, dst / shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts\.3\.w1\.weight_scale.*NaN"):
        K3ForCausalLM.from_pretrained(dst)


def test_pickle_files_are_refused_without_unpickling(tmp_path):
    dst = tmp_path / "pkl"
    dst.mkdir()
    shutil.copy(os.path.join(PLAIN, "config.json"), dst)
    # A file that would run code if it were ever unpickled.
    (dst / "pytorch_model.bin").write_bytes(b"cos\nsystem\n(S'touch /tmp/openk3-pwned'\ntR.")
    with pytest.raises(ValueError, match="never unpickles"):
        K3ForCausalLM.from_pretrained(dst)
    assert not os.path.exists("/tmp/openk3-pwned")


def test_missing_folder_and_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        K3ForCausalLM.from_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    shutil.copy(os.path.join(PLAIN, "config.json"), tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        K3ForCausalLM.from_pretrained(tmp_path / "empty")


def test_our_checkpoint_round_trips_and_replaces_stale_shards(tmp_path):
    model = K3ForCausalLM(K3Config.preset("tiny"))
    model.init_random_weights(3)
    model.save_pretrained(tmp_path, max_shard_size=2_000_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    model.save_pretrained(tmp_path)  # re-save as one file: the old shards and index must go
    names = sorted(os.listdir(tmp_path))
    assert names == ["config.json", "model.safetensors"]
    again = K3ForCausalLM.from_pretrained(tmp_path)
    for (n, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), n

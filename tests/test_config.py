"""K3Config: the official config.json round trip, the layer schedule, presets and validation errors."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from config_edit import edited_preset
from fixture_paths import MXFP4, PLAIN

from openk3.config import K3Config, K3TextConfig, LinearAttnConfig
from openk3.model.model import K3ForCausalLM


@pytest.mark.parametrize("folder", [PLAIN, MXFP4])
def test_official_config_round_trips_byte_for_byte(folder, tmp_path):
    cfg = K3Config.from_pretrained(folder)
    cfg.save_pretrained(tmp_path)
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        original = f.read()
    with open(tmp_path / "config.json", encoding="utf-8") as f:
        assert f.read() == original
    assert K3Config.from_pretrained(tmp_path) == cfg


def test_unknown_keys_survive_round_trip(tmp_path):
    data = K3Config.preset("tiny").to_dict()
    data["some_future_key"] = {"a": 1}
    data["text_config"]["rope_theta"] = 10000.0  # transformers 5.x adds these; the model must ignore them
    data["text_config"]["head_dim"] = 74
    data["text_config"]["linear_attn_config"]["new_flag"] = True
    cfg = K3Config.from_dict(data)
    assert cfg.to_dict() == data
    assert cfg.text_config.qk_head_dim == cfg.text_config.qk_nope_head_dim + cfg.text_config.qk_rope_head_dim


def test_release_schedule():
    text = K3Config.preset("k3").text_config
    mla = [i for i in range(93) if text.layer_kind(i) == "mla"]
    assert mla == [*range(3, 92, 4), 92]
    assert sum(text.layer_kind(i) == "kda" for i in range(93)) == 69
    assert [i for i in range(93) if text.is_block_start(i)] == [0, 12, 24, 36, 48, 60, 72, 84]
    assert text.ffn_kind(0) == "dense" and all(text.ffn_kind(i) == "moe" for i in range(1, 93))
    assert text.shared_intermediate_size == 6144 and text.qk_head_dim == 192


def test_fixture_schedule_matches_readme():
    text = K3Config.from_pretrained(PLAIN).text_config
    assert [i for i in range(9) if text.layer_kind(i) == "mla"] == [3, 7, 8]
    assert [i for i in range(9) if text.is_block_start(i)] == [0, 3, 6]


@pytest.mark.parametrize("name", ["tiny", "small", "medium", "k3"])
def test_presets_keep_every_mechanism(name):
    text = K3Config.preset(name).text_config
    L = text.num_hidden_layers
    assert text.ffn_kind(0) == "dense" and text.ffn_kind(1) == "moe"
    assert text.num_experts >= 8 and text.num_shared_experts >= 1 and text.routed_expert_hidden_size < text.hidden_size
    assert text.num_attn_res_blocks >= 2
    assert text.layer_kind(L - 1) == "mla" and all(text.layer_kind(i) == "mla" for i in range(3, L, 4))
    assert all(text.layer_kind(i) == "kda" for i in range(L) if (i + 1) % 4 and i != L - 1)


def test_medium_preset_is_the_cpu_comparison_shape():
    """`k3 bench cpu`'s llama.cpp comparison checkpoint: 418M total / 243M active, 1024 wide, 16 layers, 16 experts
    top-4."""
    config = K3Config.preset("medium")
    with torch.device("meta"):
        total, active = K3ForCausalLM(config).num_parameters()
    text = config.text_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_experts, text.num_experts_per_token) == (1024, 16, 16, 4)
    assert (round(total / 1e6), round(active / 1e6)) == (418, 243)


def _bad(**changes):
    return edited_preset("tiny", **changes)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"text_config__num_experts_per_token": 9}, "num_experts_per_token"),
        ({"text_config__routed_expert_hidden_size": None}, "routed_expert_hidden_size"),
        ({"text_config__linear_attn_config__kda_layers": [1, 2, 3, 5, 6]}, "neither"),  # layer 7 uncovered
        ({"text_config__linear_attn_config__kda_layers": [1, 2, 3, 4, 5, 6, 7]}, "both"),  # layer 4 twice
        ({"text_config__linear_attn_config__full_attn_layers": [4, 8, 9, 12]}, "full_attn_layers"),
        ({"text_config__linear_attn_config__gate_lower_bound": -6.0}, "gate_lower_bound"),
        ({"text_config__hidden_size": 0}, "hidden_size"),
        ({"text_config__num_key_value_heads": 1}, "num_key_value_heads"),
        ({"text_config__mla_use_nope": False}, "mla_use_nope"),
        ({"text_config__pad_token_id": 5000}, "pad_token_id"),
        ({"text_config__hidden_act": "silu"}, "hidden_act"),
        ({"text_config__num_expert_group": 4}, "num_expert_group"),
    ],
)
def test_inconsistent_config_names_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        K3Config.from_dict(_bad(**changes))


def test_bad_top_level():
    with pytest.raises(ValueError, match="text_config"):
        K3Config.from_dict({"model_type": "kimi_k3"})
    with pytest.raises(ValueError, match="model_type"):
        K3Config.from_dict({**K3Config.preset("tiny").to_dict(), "model_type": "llama"})
    with pytest.raises(ValueError, match="preset"):
        K3Config.preset("huge")


def test_dataclasses_mirror_release_keys():
    """Every key of the released text_config (the fixture's config.json) is a field, not an `extra`."""
    names = {f.name for f in dataclasses.fields(K3TextConfig)}
    with open(os.path.join(PLAIN, "config.json"), encoding="utf-8") as f:
        text = json.load(f)["text_config"]
    assert set(text) <= names
    assert set(text["linear_attn_config"]) <= {f.name for f in dataclasses.fields(LinearAttnConfig)}

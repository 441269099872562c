"""`serve/plan.py` and `k3 plan`: the k3 preset reproduces K3's cache arithmetic to the byte (27,648 B of latent per
token, 449,372,160 B of state + conv per request, allocation units 6144 / 3072 / 1536 / 1024 at TP 1 / 2 / 4 / 8),
the tiny preset matches a hand computation from its config fields, and the CLI prints the table or exits 2 on bad
input."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from fixture_paths import PLAIN

from openk3.cli import main
from openk3.config import K3Config
from openk3.serve.plan import cache_plan, format_plan

GIB = 2**30  # the table below is in binary GiB: 1K tokens of hybrid = 477,683,712 B = 0.445 GiB (0.478 GB)


@pytest.fixture
def k3_text():
    return K3Config.preset("k3").text_config


def test_k3_matches_spec_1_2(k3_text):
    plan = cache_plan(k3_text)
    assert (plan.num_mla_layers, plan.num_kda_layers) == (24, 69)
    assert plan.latent_bytes_per_token_layer == 1_152
    assert plan.mla_bytes_per_token == 27_648 == 27 * 1024
    assert plan.kda_state_bytes_per_request == 434_110_464 == 414 * 2**20
    assert plan.conv_bytes_per_request == 15_261_696
    assert plan.fixed_bytes_per_request == 449_372_160
    assert plan.all_mla_bytes_per_token == 107_136
    assert plan.crossover_tokens == pytest.approx(5_653.3, abs=0.05)
    # One KDA layer's state alone equals 5,461 tokens of one MLA layer's latent.
    assert 6 * 2**20 // plan.latent_bytes_per_token_layer == 5_461


# (context, hybrid GiB, all-MLA GiB, ratio) for the full K3 model, derived by hand; 1K = 1024 tokens.
SPEC_TABLE = [
    (2**10, 0.445, 0.102, 4.35),
    (2**12, 0.524, 0.409, 1.28),
    (2**13, 0.629, 0.817, 0.77),
    (2**15, 1.262, 3.270, 0.39),
    (2**17, 3.794, 13.078, 0.29),
    (2**20, 27.419, 104.625, 0.26),
]


@pytest.mark.parametrize("context, hybrid_gib, all_mla_gib, ratio", SPEC_TABLE)
def test_k3_context_table(k3_text, context, hybrid_gib, all_mla_gib, ratio):
    plan = cache_plan(k3_text)
    hybrid, all_mla = plan.request_bytes(context), plan.all_mla_request_bytes(context)
    assert hybrid == 449_372_160 + context * 27_648 and all_mla == context * 107_136
    assert round(hybrid / GIB, 3) == hybrid_gib
    assert round(all_mla / GIB, 3) == all_mla_gib
    assert round(hybrid / all_mla, 2) == ratio


@pytest.mark.parametrize("tp, per_layer, unit", [(1, 6_512_640, 6144), (2, 3_256_320, 3072), (4, 1_628_160, 1536),
                                                 (8, 814_080, 1024)])  # fmt: skip
def test_k3_allocation_unit_spec_1_3(k3_text, tp, per_layer, unit):
    plan = cache_plan(k3_text, tp=tp)
    assert plan.fixed_bytes_per_layer == per_layer
    assert plan.allocation_unit() == unit
    # KDA state and conv shard by heads; the MLA latent is replicated on every rank.
    assert plan.fixed_bytes_per_request == 449_372_160 // tp
    assert plan.mla_bytes_per_token == 27_648 and plan.all_mla_bytes_per_token == 107_136


def test_tiny_by_hand():
    text = K3Config.preset("tiny").text_config
    la = text.linear_attn_config
    num_mla = len(la.full_attn_layers)
    num_kda = len(la.kda_layers)
    latent = (text.kv_lora_rank + text.qk_rope_head_dim) * 2
    state = la.num_heads * la.head_dim * la.head_dim * 4
    conv = 3 * (la.short_conv_kernel_size - 1) * la.num_heads * la.head_dim * 2
    # The tiny preset: 9 layers (MLA at 4, 8, 9), 3 KDA heads of 64, kv_lora_rank 64 + rope 32, conv width 4.
    assert (num_mla, num_kda, latent, state, conv) == (3, 6, 192, 49_152, 3_456)
    plan = cache_plan(text)
    assert dataclasses.astuple(plan) == (
        3, 6, 2, 1, 192, 52_608, 576, 294_912, 20_736, 315_648, 1_728, 315_648 / (1_728 - 576),
    )  # fmt: skip
    assert plan.crossover_tokens == 274.0
    assert plan.allocation_unit() == 512  # 52,608 / 192 = 274 tokens, rounded up to one hash unit
    assert plan.allocation_unit(hash_unit=16) == 288
    assert plan.request_bytes(1000) == 315_648 + 576_000


def test_fp32_activations_and_tp(k3_text):
    plan = cache_plan(k3_text, act_bytes=4, tp=8)
    assert plan.mla_bytes_per_token == 2 * 27_648
    assert plan.kda_state_bytes_per_request == 434_110_464 // 8  # the state is fp32 whatever the activations
    assert plan.conv_bytes_per_request == 2 * 15_261_696 // 8


def test_no_kda_layers_never_crosses_over():
    config = K3Config.preset("tiny")
    la = config.text_config.linear_attn_config
    text = dataclasses.replace(config.text_config, linear_attn_config=dataclasses.replace(
        la, full_attn_layers=list(range(1, 10)), kda_layers=[]))  # fmt: skip
    plan = cache_plan(text)
    assert plan.fixed_bytes_per_request == 0 and plan.mla_bytes_per_token == plan.all_mla_bytes_per_token
    assert math.isinf(plan.crossover_tokens)
    assert plan.allocation_unit() == 512
    assert "never smaller" in format_plan(plan, [1024], 1)


def test_bad_arguments_name_the_field(k3_text):
    with pytest.raises(ValueError, match="tp"):
        cache_plan(k3_text, tp=5)  # 96 KDA heads do not split 5 ways
    with pytest.raises(ValueError, match="tp"):
        cache_plan(k3_text, tp=0)
    with pytest.raises(ValueError, match="act_bytes"):
        cache_plan(k3_text, act_bytes=0)
    plan = cache_plan(k3_text)
    with pytest.raises(ValueError, match="context"):
        format_plan(plan, [1024, 0], 1)
    with pytest.raises(ValueError, match="batch"):
        format_plan(plan, [1024], 0)
    with pytest.raises(ValueError, match="hash_unit"):
        plan.allocation_unit(0)


def test_format_plan_scales_with_batch(k3_text):
    text = format_plan(cache_plan(k3_text), [1024, 2**20], batch=4)
    assert "27,648 B" in text and "449,372,160 B" in text and "107,136 B" in text
    assert "1.780 GiB" in text  # 4 x 477,683,712 B
    assert "5,653.3 tokens" in text and "6,144 tokens" in text
    lines = text.splitlines()
    assert any(line.split()[0] == "1K" and line.split()[-1] == "4.35" for line in lines if line.strip())
    assert any(line.split()[0] == "1M" and line.split()[-1] == "0.26" for line in lines if line.strip())


def test_cli_plan(capsys):
    assert main(["plan", "--preset", "k3"]) == 0
    out = capsys.readouterr().out
    assert "449,372,160 B" in out and "6,144 tokens" in out
    assert [line.split()[0] for line in out.splitlines() if line.strip().endswith(("4.35", "0.29"))] == ["1K", "128K"]
    assert main(["plan", "--preset", "k3", "--tp", "8", "--context", "8192", "--batch", "2", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    # fp32 doubles the latent, so one state page fits in half as many tokens: 814,080 / 2,304 -> 512.
    assert "TP8" in out and "512 tokens" in out and "55,296 B" in out and "8K" in out


def test_cli_plan_from_checkpoint(capsys):
    # The official-format tiny fixture: 2 KDA heads of 32, kv_lora_rank 32 + rope 8, MLA at layers 4, 8, 9.
    assert main(["plan", "--ckpt", PLAIN, "--context", "100"]) == 0
    out = capsys.readouterr().out
    assert "240 B" in out  # 3 x (32 + 8) x 2
    assert "56,064 B" in out  # 6 x (2*32*32*4 + 3*3*64*2)


def test_cli_plan_bad_input(tmp_path, capsys):
    for argv in (["plan"], ["plan", "--preset", "tiny", "--ckpt", str(tmp_path)]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        assert "--ckpt" in capsys.readouterr().err
    assert main(["plan", "--preset", "tiny", "--context", "0"]) == 2
    assert "context" in capsys.readouterr().err
    assert main(["plan", "--ckpt", str(tmp_path / "missing")]) == 2
    assert "config.json" in capsys.readouterr().err
    assert main(["plan", "--preset", "tiny", "--tp", "2"]) == 2
    assert "tp" in capsys.readouterr().err


@pytest.mark.parametrize("preset, dtype", [("k3", torch.bfloat16), ("tiny", torch.bfloat16), ("tiny", torch.float32)])
def test_allocated_pools_and_cache_measure_the_plan(preset, dtype):
    """The serving pools and the contiguous cache are built from the same CacheSpecs the plan prices: their
    allocated bytes (on meta for k3: no memory) match the plan to the byte."""
    from openk3.model.cache import K3Cache
    from openk3.serve.kv.block_pool import HybridPools

    text = K3Config.preset(preset).text_config
    plan = cache_plan(text, act_bytes=dtype.itemsize)
    pools = HybridPools(text, num_blocks=3, block_size=5, num_slots=2, dtype=dtype, device="meta")
    assert pools.mla_bytes_per_token() == plan.mla_bytes_per_token
    assert pools.slot_bytes() == plan.fixed_bytes_per_request
    assert pools.nbytes() == 3 * 5 * plan.mla_bytes_per_token + 2 * plan.fixed_bytes_per_request
    cache = K3Cache(text, num_seqs=2, dtype=dtype, device="meta")
    assert cache.nbytes() == 2 * plan.fixed_bytes_per_request
    if preset == "k3":
        assert (pools.mla_bytes_per_token(), pools.slot_bytes()) == (27_648, 449_372_160)  # K3: the docstring figures

"""vLLM's dtype convention: `LLM(..., dtype=...)` and `k3 serve/generate/chat --dtype` take what vLLM takes."""

from __future__ import annotations

import json

import pytest
import torch
from serve_helpers import tiny_model

from openk3.cli import build_parser
from openk3.ops.cpu_features import features
from openk3.serve.config import DTYPE_CHOICES, checkpoint_dtype, resolve_dtype
from openk3.serve.engine import LLM
from openk3.serve.request import SamplingParams

# vLLM's `_STR_DTYPE_TO_TORCH_DTYPE` (vllm/config), written out here so a change on our side shows up as a failure.
VLLM_TABLE = {"half": torch.float16, "float16": torch.float16, "float": torch.float32, "float32": torch.float32,
              "bfloat16": torch.bfloat16}  # fmt: skip


@pytest.mark.parametrize("name", sorted(VLLM_TABLE))
def test_names_map_as_vllm(name):
    assert resolve_dtype(name) is VLLM_TABLE[name]
    assert resolve_dtype(name.upper()) is VLLM_TABLE[name]  # vLLM lower-cases the string


def test_torch_dtypes_and_none_pass_through():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert resolve_dtype(dtype) is dtype
    assert resolve_dtype(None) is None  # openk3's default: the stored dtypes


@pytest.mark.parametrize(
    "config_dtype, expected",
    [("bfloat16", torch.bfloat16), ("float16", torch.float16), ("float32", torch.bfloat16),
     ("torch.float32", torch.bfloat16), (None, torch.bfloat16), ("float8_e4m3", torch.bfloat16)],
)  # fmt: skip
def test_auto_follows_the_config_with_fp32_as_bf16(config_dtype, expected):
    assert resolve_dtype("auto", config_dtype) is expected
    assert resolve_dtype("AUTO", config_dtype) is expected


@pytest.mark.parametrize("bad", ["fp8", "bf16", "float64", "", "int8"])
def test_bad_names_are_named_errors(bad):
    with pytest.raises(ValueError, match="dtype") as err:
        resolve_dtype(bad)
    assert "bfloat16" in str(err.value)  # the message lists what is accepted


@pytest.mark.parametrize("bad", [torch.float64, torch.int32, 3])
def test_bad_objects_are_named_errors(bad):
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype(bad)


def test_checkpoint_dtype_reads_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"torch_dtype": "float16"}}))
    assert checkpoint_dtype(tmp_path) == "float16"
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16", "text_config": {"dtype": "float16"}}))
    assert checkpoint_dtype(tmp_path) == "bfloat16"  # the top level wins
    assert checkpoint_dtype(tmp_path / "missing") is None


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_model().save_pretrained(path)  # fp32 tensors; config.json declares bfloat16 (the release's value)
    return path


def _matrix_dtype(llm: LLM) -> torch.dtype:
    return llm.engine.model.lm_head.weight.dtype


@pytest.mark.parametrize("dtype, expected", [("bfloat16", torch.bfloat16), ("float", torch.float32),
                                             ("auto", "auto"), (None, torch.float32),
                                             (torch.bfloat16, torch.bfloat16)])  # fmt: skip
def test_llm_from_a_checkpoint(tiny_ckpt, dtype, expected):
    if expected == "auto":  # bf16 as vLLM resolves it, computed in fp32 on a CPU without bf16 arithmetic (ops/widen)
        expected = torch.bfloat16 if features().bf16_native else torch.float32
    llm = LLM(str(tiny_ckpt), dtype=dtype)
    assert _matrix_dtype(llm) is expected
    # The release keeps some tensors in fp32 whatever the dtype (A_log, dt_bias, the router's bias, ...).
    kda = next(layer.self_attn for layer in llm.engine.model.model.layers if hasattr(layer.self_attn, "A_log"))
    assert kda.A_log.dtype is torch.float32
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_llm_half_runs(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), dtype="half")
    assert _matrix_dtype(llm) is torch.float16
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_llm_converts_a_model_object():
    assert _matrix_dtype(LLM(tiny_model(), dtype="BFloat16")) is torch.bfloat16
    assert _matrix_dtype(LLM(tiny_model(), dtype="auto")) is torch.float32  # auto leaves an object as it is
    with pytest.raises(ValueError, match="dtype 'fp8'"):
        LLM(tiny_model(), dtype="fp8")


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
def test_cli_flag_takes_vllm_names(command):
    parser = build_parser()
    for name in DTYPE_CHOICES:
        assert parser.parse_args([command, "--ckpt", "x", "--dtype", name.upper()]).dtype == name
    with pytest.raises(SystemExit):
        parser.parse_args([command, "--ckpt", "x", "--dtype", "fp8"])

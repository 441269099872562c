"""MoonViT-V2 + projector + K3ForConditionalGeneration against the official code's outputs (tests/fixtures/README.md,
"Vision reference outputs"), both placeholder conventions, checkpoint round trip, release counts, init, gradients."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from fixture_paths import FIXTURES, PLAIN
from safetensors import safe_open
from safetensors.torch import load_file

from openk3 import K3Config, K3ForCausalLM, K3ForConditionalGeneration
from openk3.model.vision import MoonViT3d, PatchMergerMLPV2, VisionConfig
from openk3.utils import rel_rms

REFERENCE = os.path.join(FIXTURES, "k3-official-tiny-vision", "reference.safetensors")
TOKEN = 277  # the tiny config's media_placeholder_token_id


@pytest.fixture(scope="module")
def ref():
    return load_file(REFERENCE)


@pytest.fixture(scope="module")
def model():
    return K3ForConditionalGeneration.from_pretrained(PLAIN, dtype=torch.float32).eval()


def _rows(ref) -> list[int]:
    return [t * (h // 2) * (w // 2) for t, h, w in ref["grid_thws"].tolist()]


def _repeat_placeholders(ids_1T: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The prompt with the k-th placeholder written counts[k] times (the vLLM/SGLang convention)."""
    out, k = [], 0
    for tok in ids_1T[0].tolist():
        if tok == TOKEN:
            out += [TOKEN] * counts[k]
            k += 1
        else:
            out.append(tok)
    return torch.tensor([out])


def test_tower_and_projector_match_official(model, ref):
    n = ref["grid_thws"].shape[0]
    with torch.no_grad():
        merged = model.vision_tower(ref["pixel_values"], ref["grid_thws"])
        projected = model.encode_images(ref["pixel_values"], ref["grid_thws"])
    assert len(merged) == len(projected) == n == 3
    for i in range(n):
        e_tower = rel_rms(merged[i], ref[f"tower_features.{i}"])
        e_proj = rel_rms(projected[i], ref[f"projected.{i}"])
        print(f"image {i}: tower {e_tower:.2e}, projector {e_proj:.2e}")
        assert merged[i].shape == ref[f"tower_features.{i}"].shape
        assert projected[i].shape == ref[f"projected.{i}"].shape
        assert e_tower <= 1e-5 and e_proj <= 1e-5  # STYLE.md §5; 0 observed (the same fp32 ops)


def test_multimodal_logits_match_official(model, ref):
    with torch.no_grad():
        logits = model(ref["input_ids"], ref["pixel_values"], ref["grid_thws"]).logits
    assert logits.shape == ref["logits"].shape == (1, 31, 512)
    err = rel_rms(logits, ref["logits"])
    print(f"multimodal logits vs official fp32: relative RMS {err:.2e}")
    assert err <= 1e-4  # spec bound; about 1.5e-6 observed
    assert torch.equal(logits.argmax(-1), ref["logits"].argmax(-1))


def test_repeated_and_mixed_placeholders_match_expanded(model, ref):
    rows = _rows(ref)
    with torch.no_grad():
        expanded = model(ref["input_ids"], ref["pixel_values"], ref["grid_thws"], return_dict=False)
        for counts in (rows, [rows[0], 1, rows[2]]):
            ids = _repeat_placeholders(ref["input_ids"], counts)
            logits = model(ids, ref["pixel_values"], ref["grid_thws"], return_dict=False)
            assert logits.shape == expanded.shape
            assert rel_rms(logits, expanded) <= 1e-6, counts


@pytest.mark.parametrize("counts, message", [
    ([1, 2, 1], r"image 1 has 4 rows but 2 consecutive placeholder tokens \(id 277\)"),
    ([1, 0, 1], r"2 placeholder tokens \(id 277\) in 2 runs for 3 images of \[12, 4, 8\] rows"),
])  # fmt: skip
def test_wrong_placeholder_count_is_a_named_error(model, ref, counts, message):
    ids = _repeat_placeholders(ref["input_ids"], counts)
    with pytest.raises(ValueError, match=message):
        model(ids, ref["pixel_values"], ref["grid_thws"])


def test_padded_batch_rows_match_single_rows(model, ref):
    """A text-only row beside the image row: the grown image row and the left-padded text row each match their
    unbatched forward (images go to placeholders in reading order, rows right-aligned as the release does)."""
    text = torch.tensor([[1, 5, 9, 13, 17, 21]])
    T = ref["input_ids"].shape[1]
    pad = model.text_config.pad_token_id
    ids = torch.cat([ref["input_ids"], torch.cat([torch.full((1, T - 6), pad), text], 1)])
    mask = torch.cat([torch.ones(1, T, dtype=torch.long), (ids[1:] != pad).long()])
    with torch.no_grad():
        batched = model(ids, ref["pixel_values"], ref["grid_thws"], attention_mask=mask, return_dict=False)
        alone = model(ref["input_ids"], ref["pixel_values"], ref["grid_thws"], return_dict=False)
        text_alone = model(text, return_dict=False)
    assert batched.shape == (2, 31, 512)
    assert rel_rms(batched[0], alone[0]) <= 1e-5
    assert rel_rms(batched[1, -6:], text_alone[0]) <= 1e-5
    assert bool((batched[1, :-6] == 0).all())  # padding gets zero logits, as K3ForCausalLM


def _tensors(folder):
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (safe_open is not iterable)
    return out


def test_checkpoint_round_trip_is_byte_identical(tmp_path):
    loaded = K3ForConditionalGeneration.from_pretrained(PLAIN)  # stored dtypes: the vision tensors stay bf16
    assert loaded.vision_tower.patch_embed.proj.weight.dtype == torch.bfloat16
    loaded.save_pretrained(tmp_path)
    original, saved = _tensors(PLAIN), _tensors(tmp_path)
    assert set(saved) == set(original)
    assert sum(k.startswith(("vision_tower.", "mm_projector.")) for k in saved) == 12
    for key, tensor in original.items():
        assert saved[key].dtype == tensor.dtype and saved[key].shape == tensor.shape, key
        assert torch.equal(saved[key].view(torch.uint8), tensor.view(torch.uint8)), key
    with open(os.path.join(PLAIN, "config.json"), "rb") as a, open(tmp_path / "config.json", "rb") as b:
        assert a.read() == b.read()


def test_text_only_checkpoint_is_a_clear_error_and_still_loads_as_text(tmp_path):
    dst = tmp_path / "text"
    shutil.copytree(PLAIN, dst)
    with open(dst / "config.json") as f:
        config = json.load(f)
    del config["vision_config"]
    with open(dst / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="no vision_config.*K3ForCausalLM"):
        K3ForConditionalGeneration.from_pretrained(dst)
    K3ForCausalLM.from_pretrained(dst)  # the text model skips the vision tensors with its notice


def test_release_build_on_meta_counts_spec_parameters():
    with torch.device("meta"):
        model = K3ForConditionalGeneration(K3Config.preset("k3"))
    tower = sum(p.numel() for p in model.vision_tower.parameters())
    projector = sum(p.numel() for p in model.mm_projector.parameters())
    block = sum(p.numel() for p in model.vision_tower.encoder.blocks[0].parameters())
    print(f"release vision: tower {tower:,}, projector {projector:,}, block {block:,}")
    assert block == 14_682_112  # spec/vision.md §2
    assert tower == 401_214_464
    assert projector == 46_144_512
    assert model.num_vision_parameters() == 447_358_976
    assert model.num_parameters()[0] == 2_779_484_476_000 + 447_358_976
    assert model.vision_tower.encoder.blocks[0].wqkv.weight.shape == (4608, 1024)
    assert model.vision_tower.patch_embed.pos_emb.weight.shape == (64, 64, 1024)


def test_init_weights_on_meta_fills_every_tensor():
    config = K3Config.from_pretrained(PLAIN)
    with torch.device("meta"):
        model = K3ForConditionalGeneration(config)
    model.to_empty(device="cpu")
    for p in model.parameters():
        p.data.fill_(math.nan)  # whatever init leaves unset stays NaN
    model.init_weights(torch.Generator().manual_seed(0))
    for name, p in model.named_parameters():
        assert bool(torch.isfinite(p).all()), name
    tower = model.vision_tower
    assert bool((tower.encoder.final_layernorm.weight == 1).all())
    assert bool((model.mm_projector.post_norm.weight == 1).all())
    pos = tower.patch_embed.pos_emb.weight
    assert 0.5 < pos.std().item() < 1.5  # N(0, 1)
    fc0 = tower.encoder.blocks[0].mlp.fc0.weight
    assert abs(fc0.std().item() / math.sqrt(2 / fc0.shape[1]) - 1) < 0.2


def test_text_loss_sends_gradients_into_the_tower(model, ref):
    model.zero_grad(set_to_none=True)
    ids = ref["input_ids"]
    out = model(ids, ref["pixel_values"], ref["grid_thws"], labels=ids)
    assert out.logits.shape[1] == 31 and torch.isfinite(out.loss)
    out.loss.backward()
    for name, p in [*model.vision_tower.named_parameters(), *model.mm_projector.named_parameters()]:
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()), name
        assert p.grad.abs().sum().item() > 0, name
    model.zero_grad(set_to_none=True)


def test_unimplemented_vision_options_are_refused():
    d = K3Config.from_pretrained(PLAIN).vision_config
    for key, value in [("merge_type", "avgpool"), ("norm_type", "layernorm"), ("mm_projector_type", "mlp")]:
        with pytest.raises(ValueError, match=f"vision_config.{key}"):
            VisionConfig.from_dict({**d, key: value})
    cfg = VisionConfig.from_dict(d)
    tower = MoonViT3d(cfg)
    with pytest.raises(ValueError, match="frames"):
        tower(torch.zeros(5 * 4, 3, 14, 14), torch.tensor([[5, 2, 2]]))
    assert isinstance(PatchMergerMLPV2(cfg).proj[1], torch.nn.GELU)

"""The image processor against the release: the golden cases from public ports' tests exactly, the official processor's
`pixel_values` / `grid_thws` for the fixture images bit-exactly, compositing of transparent images on the chessboard,
mode conversion, the per-side limit and the patch budget at their edges, the config reader, and bad inputs."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from openk3.data.vision import (
    RELEASE_MEDIA_PROC_CFG,
    ResizePlan,
    image_prompt,
    load_media_proc_cfg,
    num_image_tokens,
    open_image,
    plan_resize,
    preprocess,
)

FIXTURE = Path(__file__).parents[1] / "fixtures" / "k3-official-tiny-vision"
P = 14
NO_BG = {"transparent_bg_config": None}


def _unpatchify(pv_L3PP: torch.Tensor, grid) -> torch.Tensor:
    """[t*h*w, 3, p, p] in (t, row, col) order -> [3, h*p, w*p] (t = 1)."""
    t, h, w = (int(v) for v in grid)
    assert t == 1
    return pv_L3PP.view(h, w, 3, P, P).permute(2, 0, 3, 1, 4).reshape(3, h * P, w * P)


def _norm(v: int) -> float:
    """The reference normalisation of one uint8 value with mean = std = 0.5, in its float order."""
    x = np.float32(np.float64(v) / 255.0)
    return float(np.float32((x - np.float64(0.5)) * np.float64(2.0)))


def _noise(w: int, h: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    bands = len(mode)
    arr = rng.integers(0, 256, (h, w, bands), dtype=np.uint8)
    return Image.fromarray(arr[:, :, 0] if bands == 1 else arr, mode)


# Golden cases from public K3 ports' tests: (w, h, cfg overrides) -> resized size, padding, grid (t, h, w), tokens.
GOLDEN = [
    ((225, 223), {}, (225, 223), (27, 1), (1, 16, 18), 72),
    ((3585, 3585), {"in_patch_limit": 65536}, (3585, 3585), (27, 27), (1, 258, 258), 16641),
    ((28, 28), {"in_patch_limit": 3}, (24, 24), (4, 4), (1, 2, 2), 1),
    ((4000, 3000), {}, (4000, 3000), (4, 24), (1, 216, 286), 15444),
    ((100, 100), {}, (100, 100), (12, 12), (1, 8, 8), 16),
    ((30, 16), {}, (30, 16), (26, 12), (1, 2, 4), 2),
]


@pytest.mark.parametrize(("size", "cfg", "new", "pad", "grid", "tokens"), GOLDEN)
def test_golden_resize_rule(size, cfg, new, pad, grid, tokens):
    plan = plan_resize(*size, cfg)
    assert plan == ResizePlan(new[0], new[1], pad[0], pad[1], tokens)
    assert num_image_tokens(grid) == tokens


@pytest.mark.parametrize(("size", "cfg", "new", "pad", "grid", "tokens"), GOLDEN)
def test_golden_preprocess(size, cfg, new, pad, grid, tokens):
    image = _noise(*size, seed=size[0])
    pv, grids = preprocess(image, cfg)
    assert grids.dtype == torch.int64 and grids.tolist() == [list(grid)]
    assert pv.dtype == torch.float32 and pv.shape == (grid[1] * grid[2], 3, P, P)
    assert num_image_tokens(grids[0]) == tokens
    img = _unpatchify(pv, grid)
    assert img.shape == (3, new[1] + pad[1], new[0] + pad[0])
    # Padding is black before normalisation: exactly -1 on the right and bottom, and the content starts inside.
    assert (img[:, new[1] :, :] == -1).all() and (img[:, :, new[0] :] == -1).all()
    if new == size:  # no resize: the pixels are the input's, normalised
        expected = (np.asarray(image) / 255.0).astype(np.float32)
        expected -= np.array([0.5, 0.5, 0.5])
        expected *= 1.0 / np.array([0.5, 0.5, 0.5])
        assert torch.equal(img[:, : new[1], : new[0]], torch.from_numpy(expected).permute(2, 0, 1))


def test_golden_red_blue():
    arr = np.zeros((16, 30, 3), dtype=np.uint8)
    arr[:, :15] = (255, 0, 0)
    arr[:, 15:] = (0, 0, 255)
    pv, grids = preprocess(Image.fromarray(arr))
    assert grids.tolist() == [[1, 2, 4]] and pv.shape == (8, 3, P, P) and num_image_tokens(grids[0]) == 2
    red = pv[0]  # top-left patch: x, y in [0, 14) is all red
    assert (red[0] == 1.0).all() and (red[1:] == -1.0).all()
    img = _unpatchify(pv, grids[0])
    assert (img[2, :16, 15:30] == 1.0).all() and (img[:2, :16, 15:30] == -1.0).all()  # blue
    assert img.shape == (3, 28, 56) and (img[:, 16:] == -1).all() and (img[:, :, 30:] == -1).all()


def test_official_fixture_exact():
    """Bit-exact (torch.equal, not a tolerance) with the official processor's stored output."""
    from safetensors.torch import load_file

    ref = load_file(str(FIXTURE / "reference.safetensors"))
    meta = json.loads((FIXTURE / "reference.json").read_text())
    images = [Image.open(FIXTURE / name) for name in meta["images"]]
    assert images[0].mode == "RGBA"
    pv, grids = preprocess(images, meta["media_proc_cfg"])
    assert grids.dtype == ref["grid_thws"].dtype and torch.equal(grids, ref["grid_thws"])
    assert pv.dtype == ref["pixel_values"].dtype and torch.equal(pv, ref["pixel_values"])
    # The release defaults are the fixture's config.
    pv_default, _ = preprocess(images)
    assert torch.equal(pv_default, ref["pixel_values"])
    # Compositing matters for image0: without it (plain RGB conversion) the pixels differ.
    pv_plain, _ = preprocess(images, {**meta["media_proc_cfg"], **NO_BG})
    n0 = int(grids[0].prod())
    assert not torch.equal(pv_plain[:n0], ref["pixel_values"][:n0])
    assert torch.equal(pv_plain[n0:], ref["pixel_values"][n0:])


@pytest.mark.parametrize("stage", ["before_resize", "after_resize"])
def test_transparent_composited_on_chessboard(stage):
    # 56 x 28 needs no resize or padding: the output is the background where alpha is 0, the colour where it is 255.
    arr = np.zeros((28, 56, 4), dtype=np.uint8)
    arr[:, :, :3] = (10, 20, 30)
    arr[20:, :, 3] = 255
    pv, grids = preprocess(Image.fromarray(arr, "RGBA"), {"transparent_bg_fill_stage": stage})
    img = _unpatchify(pv, grids[0])
    white, gray = _norm(255), _norm(180)
    # 8-px squares, white at the top-left, gray where (y // 8 + x // 8) is odd.
    for y, x, v in [
        (0, 0, white),
        (0, 8, gray),
        (8, 0, gray),
        (8, 8, white),
        (7, 15, gray),
        (16, 47, gray),
        (16, 48, white),
    ]:
        assert (img[:, y, x] == v).all(), (y, x)
    assert img[:, 20:, :].tolist() == [[[_norm(c)] * 56] * 8 for c in (10, 20, 30)]


def test_transparency_partial_alpha_and_other_modes():
    # alpha 51 of red over white 255: uint8(0.2 * 255 + 0.8 * 255) for R, uint8(0.8 * 255) for G and B.
    arr = np.zeros((28, 28, 4), dtype=np.uint8)
    arr[:, :, 0] = 255
    arr[:, :, 3] = 51
    pv, g = preprocess(Image.fromarray(arr, "RGBA"))
    a = np.float32(51) / np.float32(255.0)
    r = int(np.uint8(a * np.float32(255) + (np.float32(1) - a) * np.float32(255)))
    gb = int(np.uint8((np.float32(1) - a) * np.float32(255)))
    assert _unpatchify(pv, g[0])[:, 0, 0].tolist() == [_norm(r), _norm(gb), _norm(gb)]
    # LA (gray + alpha) fully transparent -> chessboard; palette with a transparent index -> chessboard.
    la = Image.new("LA", (28, 28), (90, 0))
    pv, g = preprocess(la)
    assert _unpatchify(pv, g[0])[:, 0, 8].tolist() == [_norm(180)] * 3
    pal = Image.new("P", (28, 28), 3)
    pal.putpalette([0, 0, 0, 1, 1, 1, 2, 2, 2, 200, 100, 50] + [0] * 756)
    pal.info["transparency"] = 3
    pv, g = preprocess(pal)
    assert _unpatchify(pv, g[0])[:, 0, 0].tolist() == [_norm(255)] * 3
    del pal.info["transparency"]
    pv, g = preprocess(pal)
    assert _unpatchify(pv, g[0])[:, 0, 0].tolist() == [_norm(200), _norm(100), _norm(50)]


def test_grayscale_converted_and_bicubic_is_pillows():
    gray = _noise(700, 50, seed=3, mode="L")
    cfg = {"patch_limit_on_one_side": 16}  # 700 px > 16 * 14 = 224: resized to 224 x 16
    plan = plan_resize(700, 50, cfg)
    assert (plan.new_width, plan.new_height) == (224, 16)
    pv, g = preprocess(gray, cfg)
    img = _unpatchify(pv, g[0])
    assert torch.equal(img[0], img[1]) and torch.equal(img[0], img[2])
    resized = np.asarray(gray.resize((224, 16), resample=Image.Resampling.BICUBIC))
    expected = (resized / 255.0).astype(np.float32)
    expected -= 0.5
    expected *= 2.0
    assert torch.equal(img[0, :16, :224], torch.from_numpy(expected))


# Release cfg (per-side limit 512 patches = 7168 px, budget 65536 patches): at, just under and just over.
@pytest.mark.parametrize(
    ("size", "new"),
    [
        ((7168, 28), (7168, 28)),  # exactly at the per-side limit
        ((7167, 28), (7167, 28)),
        ((7169, 28), (7168, 27)),  # just over: scale 7168/7169, and int() truncates 27.996 to 27
        ((20000, 10), (7168, 3)),
        ((3584, 3584), (3584, 3584)),  # 256 x 256 = 65536 patches: exactly the budget
        ((3597, 3584), (3597, 3584)),  # 3597 // 14 is still 256
        ((3598, 3584), (3590, 3577)),  # 257 x 256 patches: scaled by sqrt(65536 / 65792)
        ((3570, 3584), (3570, 3584)),
        ((10000, 10000), (3585, 3585)),  # the budget counts floor patches before padding: 258 x 258 after it
    ],
)
def test_release_limits_at_edges(size, new):
    plan = plan_resize(*size)
    assert (plan.new_width, plan.new_height) == new
    assert (new[0] + plan.pad_width) % 28 == 0 and (new[1] + plan.pad_height) % 28 == 0
    assert (new[0] + plan.pad_width) // P <= 512 and (new[1] + plan.pad_height) // P <= 512


@pytest.mark.parametrize(
    ("size", "cfg", "grid"),
    [
        ((56, 14), {"patch_limit_on_one_side": 4}, (1, 2, 4)),  # at the side limit (4 patches)
        ((55, 14), {"patch_limit_on_one_side": 4}, (1, 2, 4)),
        ((57, 14), {"patch_limit_on_one_side": 4}, (1, 2, 4)),  # resized to 56 x 13
        ((28, 28), {"in_patch_limit": 4}, (1, 2, 2)),  # at the budget (2 x 2 patches)
        ((41, 28), {"in_patch_limit": 4}, (1, 2, 4)),  # 41 // 14 = 2: kept, padded to 56
        ((42, 28), {"in_patch_limit": 4}, (1, 2, 4)),  # 3 x 2 patches: scaled to 34 x 22
    ],
)
def test_small_limits_through_preprocess(size, cfg, grid):
    image = _noise(*size, seed=1)
    plan = plan_resize(*size, cfg)
    pv, g = preprocess(image, cfg)
    assert g.tolist() == [list(grid)] and pv.shape[0] == grid[1] * grid[2]
    img = _unpatchify(pv, grid)
    assert (img[:, plan.new_height :] == -1).all() and (img[:, :, plan.new_width :] == -1).all()
    assert not (img[:, : plan.new_height, plan.new_width - 1] == -1).all()
    expected_new = {(57, 14): (56, 13), (42, 28): (34, 22)}.get(size, size)
    assert (plan.new_width, plan.new_height) == expected_new


def test_several_images_concatenate_in_order():
    a, b = _noise(60, 30, seed=5), _noise(20, 90, seed=6, mode="RGBA")
    pa, ga = preprocess(a)
    pb, gb = preprocess([b])
    pv, g = preprocess([a, b])
    assert torch.equal(pv, torch.cat([pa, pb])) and torch.equal(g, torch.cat([ga, gb]))
    assert g.shape == (2, 3)


def test_prompt_and_token_count():
    image = Image.new("RGB", (640, 480))
    assert image_prompt(image) == "<|media_begin|>image 640x480<|media_content|><|media_pad|><|media_end|>"
    assert image_prompt((7, 9)) == "<|media_begin|>image 7x9<|media_content|><|media_pad|><|media_end|>"
    assert num_image_tokens(torch.tensor([1, 16, 18])) == 72
    assert num_image_tokens((4, 8, 8)) == 16  # frames are pooled by the merge
    with pytest.raises(ValueError, match="divisible"):
        num_image_tokens((1, 3, 4))


def test_bad_images_raise():
    with pytest.raises(ValueError, match="PIL.Image"):
        preprocess("not an image")
    with pytest.raises(ValueError, match="PIL.Image"):
        preprocess(np.zeros((28, 28, 3), dtype=np.uint8))
    with pytest.raises(ValueError, match="at least one"):
        preprocess([])
    with pytest.raises(ValueError, match="zero size"):
        preprocess(Image.new("RGB", (0, 5)))
    with pytest.raises(ValueError, match="exceeds the limit of 1000000 pixels"):
        preprocess(Image.new("L", (1001, 1000)), max_pixels=1_000_000)
    preprocess(Image.new("L", (1000, 1000)), max_pixels=1_000_000)  # exactly at the limit is fine

    with pytest.raises(ValueError, match="not a recognised image"):
        open_image(b"definitely not an image")
    buf = io.BytesIO()
    Image.new("RGB", (2000, 2000)).save(buf, "PNG")
    png = buf.getvalue()
    with pytest.raises(ValueError, match="exceeds the limit"):  # from the header, before decoding
        open_image(png, max_pixels=1_000_000)
    assert open_image(png).size == (2000, 2000)
    with pytest.raises(ValueError, match="cannot decode|cannot open"):
        open_image(png[: len(png) // 2])


def test_load_media_proc_cfg(tmp_path):
    assert load_media_proc_cfg(tmp_path) == RELEASE_MEDIA_PROC_CFG  # no file: the release values
    meta = json.loads((FIXTURE / "reference.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": meta["media_proc_cfg"]}))
    cfg = load_media_proc_cfg(tmp_path)
    assert {k: cfg[k] for k in meta["media_proc_cfg"]} == meta["media_proc_cfg"]

    bad = [
        ("patch_size", 0),
        ("in_patch_limit", "65536"),
        ("image_std", [0.5, 0.5]),
        ("image_std", [0.5, 0.0, 0.5]),
        ("transparent_bg_fill_stage", "during_resize"),
        ("transparent_bg_config", {"pattern": "stripes"}),
        ("transparent_bg_config", {"chessboard_gray_value": 300}),
        ("fixed_output_tokens", -1),
    ]
    for key, value in bad:
        (tmp_path / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": {key: value}}))
        with pytest.raises(ValueError, match=key):
            load_media_proc_cfg(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_media_proc_cfg(tmp_path)

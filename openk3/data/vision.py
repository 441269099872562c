"""The K3 image processor: PIL images -> `pixel_values` and `grid_thws` for the MoonViT-V2 tower.

Integer-exact with the released `KimiK3VisionProcessor` (`kimi_k3_vision_processing.py`, `media_utils.py`). Per image,
with the `media_proc_cfg` of the checkpoint's `preprocessor_config.json` (p = patch_size, m = merge_kernel_size):

1. Resize rule (`plan_resize`): with integer width w and height h,
   `scale = min(1, sqrt(in_patch_limit / (max(1, w // p) * max(1, h // p))), limit * p / w, limit * p / h)`
   (limit = patch_limit_on_one_side), `new = max(1, int(side * scale))` capped at `limit * p`. The float64
   expression is evaluated in the reference's order, because `int()` truncates and edge cases depend on the last bit.
2. Pixels: `before_resize` converts to RGB (compositing transparency) and then resizes; `after_resize` (the release)
   resizes the image in its own mode with Pillow's BICUBIC (Pillow premultiplies alpha for RGBA/LA and uses NEAREST
   for palette and 1-bit images), then composites it. Compositing: images with an alpha band or a `transparency`
   entry are blended over a background (chessboard of square `s` px starting white at the top-left, gray where
   `(y // s + x // s)` is odd when `chessboard_square_on_top_left`) as `uint8(a * rgb + (1 - a) * bg)` in float32
   with `a = alpha / 255`; others are converted to RGB. With `transparent_bg_config` None: plain `convert("RGB")`.
3. Zero (black) padding on the right and bottom to a multiple of m * p = 28 px.
4. Normalise: `float32(x / 255) - mean`, `* (1 / std)` (per channel; float64 constants, float32 result).
5. Patchify: `[1, H, W, 3] -> [1, H/p, p, W/p, p, 3] -> (0, 1, 3, 5, 2, 4) -> [-1, 3, p, p]`: patches in row-major
   (t, row, col) order, each channel-first. `grid_thw = (1, H/p, W/p)`.

The LM sees (h/m)(w/m) rows per image after the tower's 2×2 merge (frames pooled) (`num_image_tokens`), placed where the chat
encoder put `image_prompt(image)`'s single `<|media_pad|>`.

Legend: L patches over all images, p patch size (14), n images, t/h/w the grid in frames/patch rows/patch columns.
"""

from __future__ import annotations

import io
import json
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

# Pillow's own DecompressionBombWarning threshold (about 89.5 megapixels); callers (the server) pass their own.
DEFAULT_MAX_PIXELS = 89_478_485

# `preprocessor_config.json`'s `media_proc_cfg` as released (identical in the public K3 ports). The video keys
# (in_patch_limit_each_frame, sample_fps, temporal_merge_kernel_size) are kept for round trips only.
RELEASE_MEDIA_PROC_CFG: dict[str, Any] = {
    "patch_size": 14,
    "merge_kernel_size": 2,
    "in_patch_limit": 65536,
    "patch_limit_on_one_side": 512,
    "fixed_output_tokens": None,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "in_patch_limit_each_frame": 16384,
    "sample_fps": 8.0,
    "temporal_merge_kernel_size": 4,
    "transparent_bg_config": {
        "pattern": "chessboard",
        "chessboard_square_size": 8,
        "chessboard_square_on_top_left": True,
        "chessboard_white_value": 255,
        "chessboard_gray_value": 180,
    },
    "transparent_bg_fill_stage": "after_resize",
}

# The released code's defaults for keys missing inside `transparent_bg_config` (its TransparentBgConfig dataclass).
_BG_DEFAULTS: dict[str, Any] = {
    "pattern": "black",
    "chessboard_square_size": 16,
    "chessboard_square_on_top_left": True,
    "chessboard_white_value": 255,
    "chessboard_gray_value": 200,
}
_BG_PATTERNS = ("white", "black", "gray", "chessboard")
_FILL_STAGES = ("before_resize", "after_resize")


@dataclass(frozen=True)
class ResizePlan:
    """The resize rule's result for one image: resized size, right/bottom padding, LM token count."""

    new_width: int
    new_height: int
    pad_width: int
    pad_height: int
    num_tokens: int


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_cfg(cfg: dict[str, Any]) -> dict[str, Any]:
    """Fill missing keys with the release values and validate; a bad value raises ValueError naming its key."""
    if not isinstance(cfg, dict):
        raise ValueError(f"media_proc_cfg must be a dict, got {type(cfg).__name__}")
    out = {**RELEASE_MEDIA_PROC_CFG, **cfg}
    for key in ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side"):
        if not _is_int(out[key]) or out[key] < 1:
            raise ValueError(f"media_proc_cfg[{key!r}] must be a positive int, got {out[key]!r}")
    fixed = out["fixed_output_tokens"]
    if fixed is not None and (not _is_int(fixed) or fixed < 1):
        raise ValueError(f"media_proc_cfg['fixed_output_tokens'] must be None or a positive int, got {fixed!r}")
    for key in ("image_mean", "image_std"):
        v = out[key]
        if (
            not isinstance(v, (list, tuple))
            or len(v) != 3
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v)
        ):
            raise ValueError(f"media_proc_cfg[{key!r}] must be 3 finite numbers, got {v!r}")
    if any(x == 0 for x in out["image_std"]):
        raise ValueError(f"media_proc_cfg['image_std'] must be non-zero, got {out['image_std']!r}")
    if out["transparent_bg_fill_stage"] not in _FILL_STAGES:
        raise ValueError(
            f"media_proc_cfg['transparent_bg_fill_stage'] must be one of {_FILL_STAGES}, "
            f"got {out['transparent_bg_fill_stage']!r}"
        )
    bg = out["transparent_bg_config"]
    if bg is not None:
        if not isinstance(bg, dict):
            raise ValueError(f"media_proc_cfg['transparent_bg_config'] must be a dict or None, got {bg!r}")
        unknown = sorted(set(bg) - set(_BG_DEFAULTS))
        if unknown:
            raise ValueError(f"media_proc_cfg['transparent_bg_config'] has unknown keys {unknown}")
        bg = {**_BG_DEFAULTS, **bg}
        if bg["pattern"] not in _BG_PATTERNS:
            raise ValueError(
                f"media_proc_cfg['transparent_bg_config']['pattern'] must be one of {_BG_PATTERNS}, "
                f"got {bg['pattern']!r}"
            )
        if not _is_int(bg["chessboard_square_size"]) or bg["chessboard_square_size"] < 1:
            raise ValueError(
                "media_proc_cfg['transparent_bg_config']['chessboard_square_size'] must be a positive int, "
                f"got {bg['chessboard_square_size']!r}"
            )
        for key in ("chessboard_white_value", "chessboard_gray_value"):
            if not _is_int(bg[key]) or not 0 <= bg[key] <= 255:
                raise ValueError(
                    f"media_proc_cfg['transparent_bg_config'][{key!r}] must be an int in [0, 255], got {bg[key]!r}"
                )
        if not isinstance(bg["chessboard_square_on_top_left"], bool):
            raise ValueError(
                "media_proc_cfg['transparent_bg_config']['chessboard_square_on_top_left'] must be a bool, "
                f"got {bg['chessboard_square_on_top_left']!r}"
            )
        out["transparent_bg_config"] = bg
    return out


def load_media_proc_cfg(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """The `media_proc_cfg` of `checkpoint_dir/preprocessor_config.json`, completed with the release values (all of
    them when the file or the key is absent). Raises ValueError naming the key on a bad value or malformed JSON."""
    path = os.path.join(os.fspath(checkpoint_dir), "preprocessor_config.json")
    if not os.path.isfile(path):
        return _check_cfg({})
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    cfg = data.get("media_proc_cfg", {})
    if cfg is None:
        cfg = {}
    return _check_cfg(cfg)


def plan_resize(width: int, height: int, media_proc_cfg: dict[str, Any] | None = None) -> ResizePlan:
    """The release's resize rule (module docstring, step 1) for an image of `width` x `height` pixels."""
    cfg = _check_cfg({} if media_proc_cfg is None else media_proc_cfg)
    p, m = cfg["patch_size"], cfg["merge_kernel_size"]
    limit, budget = cfg["patch_limit_on_one_side"], cfg["in_patch_limit"]
    if not (_is_int(width) and _is_int(height)) or width < 1 or height < 1:
        raise ValueError(f"image size must be positive ints, got {width!r} x {height!r}")
    # Same operands and order as the reference (float max with the integer patch counts), so int() agrees.
    s_budget = math.sqrt(budget / (max(1.0, width // p) * max(1.0, height // p)))
    s_width = limit * p / width
    s_height = limit * p / height
    scale = min(1.0, s_budget, s_width, s_height)
    new_w = min(max(1, int(width * scale)), limit * p)
    new_h = min(max(1, int(height * scale)), limit * p)
    factor = m * p
    pad_w = (factor - new_w % factor) % factor
    pad_h = (factor - new_h % factor) % factor
    rows, cols = (new_h + pad_h) // factor, (new_w + pad_w) // factor
    if cfg["fixed_output_tokens"] is not None:
        num_tokens = cfg["fixed_output_tokens"]
    else:
        # Only reachable with a per-side limit that is not a multiple of m (the reference asserts here).
        if rows * m > limit or cols * m > limit:
            raise ValueError(
                f"padded grid {rows * m} x {cols * m} patches exceeds patch_limit_on_one_side {limit}; "
                "patch_limit_on_one_side must be a multiple of merge_kernel_size"
            )
        num_tokens = rows * cols
    return ResizePlan(new_w, new_h, pad_w, pad_h, num_tokens)


def _chessboard(height: int, width: int, bg: dict[str, Any]) -> np.ndarray:
    s = bg["chessboard_square_size"]
    ys = np.arange(height)[:, None] // s
    xs = np.arange(width)[None, :] // s
    odd = (ys + xs) % 2 == (1 if bg["chessboard_square_on_top_left"] else 0)
    out = np.full((height, width, 3), bg["chessboard_white_value"], dtype=np.uint8)
    out[odd] = bg["chessboard_gray_value"]
    return out


def _to_rgb(image: Image.Image, bg: dict[str, Any] | None) -> Image.Image:
    """Composite transparency over the configured background (or plain RGB conversion when `bg` is None)."""
    if bg is None:
        return image.convert("RGB")
    if image.mode == "RGB":
        return image
    if "A" not in image.getbands() and "transparency" not in image.info:
        return image.convert("RGB")
    rgba = np.asarray(image.convert("RGBA"))
    h, w = rgba.shape[:2]
    if bg["pattern"] == "chessboard":
        back = _chessboard(h, w, bg)
    else:
        back = np.full((h, w, 3), {"white": 255, "black": 0, "gray": 128}[bg["pattern"]], dtype=np.uint8)
    # float32 blend then truncation to uint8, as the reference does (not Pillow's rounding alpha_composite).
    a = (rgba[:, :, 3].astype(np.float32) / 255.0)[:, :, None]
    blended = a * rgba[:, :, :3] + (1 - a) * back
    return Image.fromarray(blended.astype(np.uint8))


def _validate_image(image: Any, max_pixels: int) -> Image.Image:
    if not isinstance(image, Image.Image):
        raise ValueError(f"expected a PIL.Image.Image, got {type(image).__name__}")
    w, h = image.size
    if w < 1 or h < 1:
        raise ValueError(f"image has zero size ({w} x {h})")
    if w * h > max_pixels:
        raise ValueError(f"image of {w} x {h} = {w * h} pixels exceeds the limit of {max_pixels} pixels")
    return image


def open_image(data: bytes | str | os.PathLike, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Decode image bytes (or a file path), checking the header's size against `max_pixels` before decoding any
    pixels. Raises ValueError for data that is not an image, a zero-size image, a too-large image or a broken file."""
    src = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    try:
        with warnings.catch_warnings():
            # The size check below replaces Pillow's global bomb threshold.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(src)
    except UnidentifiedImageError as e:
        raise ValueError("data is not a recognised image") from e
    except Image.DecompressionBombError as e:
        raise ValueError(f"image exceeds the pixel limit (decompression bomb): {e}") from e
    except OSError as e:
        raise ValueError(f"cannot open image: {e}") from e
    _validate_image(image, max_pixels)
    try:
        image.load()
    except (OSError, ValueError, SyntaxError) as e:  # truncated or corrupt data
        raise ValueError(f"cannot decode image: {e}") from e
    return image


def _image_to_array(image: Image.Image, plan: ResizePlan, cfg: dict[str, Any]) -> np.ndarray:
    """[H, W, 3] uint8: composited, resized with Pillow BICUBIC and zero-padded to multiples of m * p."""
    bg = cfg["transparent_bg_config"]
    after = cfg["transparent_bg_fill_stage"] == "after_resize"
    if not after:
        image = _to_rgb(image, bg)
    try:
        image = image.resize((plan.new_width, plan.new_height), resample=Image.Resampling.BICUBIC)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot resize image of mode {image.mode!r}: {e}") from e
    if after:
        image = _to_rgb(image, bg)
    pixels = np.asarray(image)
    if pixels.ndim != 3 or pixels.shape[2] != 3 or pixels.dtype != np.uint8:
        raise ValueError(f"image of mode {image.mode!r} did not convert to 8-bit RGB")
    return np.pad(pixels, ((0, plan.pad_height), (0, plan.pad_width), (0, 0)), mode="constant", constant_values=0)


def preprocess(
    images: Image.Image | list[Image.Image],
    media_proc_cfg: dict[str, Any] | None = None,
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PIL image(s) -> (`pixel_values` [L, 3, p, p] float32, `grid_thws` [n, 3] int64 (t, h, w in patches)).

    `media_proc_cfg`: the release's keys (None or missing keys: `RELEASE_MEDIA_PROC_CFG`). Images are
    concatenated in order, L = Σ t·h·w. Raises ValueError for a non-image, a zero-size image, or one of more than
    `max_pixels` pixels (checked before any work)."""
    if isinstance(images, (list, tuple)):
        images = list(images)
    else:
        images = [images]
    if not images:
        raise ValueError("preprocess needs at least one image")
    cfg = _check_cfg({} if media_proc_cfg is None else media_proc_cfg)
    for image in images:
        _validate_image(image, max_pixels)
    p = cfg["patch_size"]
    mean = np.array(cfg["image_mean"], dtype=np.float64)
    std_inv = 1.0 / np.array(cfg["image_std"], dtype=np.float64)
    patches, grids = [], []
    for image in images:
        plan = plan_resize(image.size[0], image.size[1], cfg)
        x_HW3 = _image_to_array(image, plan, cfg)
        # Reference order: float64 divide, cast to float32, then float64 constants applied into the float32 array.
        x = (x_HW3 / 255.0).astype(np.float32)
        x -= mean
        x *= std_inv
        H, W = x.shape[:2]
        x = x.reshape(1, H // p, p, W // p, p, 3).transpose(0, 1, 3, 5, 2, 4).reshape(-1, 3, p, p)
        patches.append(torch.from_numpy(np.ascontiguousarray(x)))
        grids.append((1, H // p, W // p))
    return torch.cat(patches), torch.tensor(grids, dtype=torch.int64)


def image_prompt(image: Image.Image | tuple[int, int]) -> str:
    """The text the chat encoder puts in place of `<|kimi_image_placeholder|>` (W x H = original size): one
    `<|media_pad|>` per image, which the model expands to `num_image_tokens` rows."""
    w, h = image.size if isinstance(image, Image.Image) else image
    return f"<|media_begin|>image {w}x{h}<|media_content|><|media_pad|><|media_end|>"


def num_image_tokens(grid_thw: Any, merge_kernel_size: int = 2) -> int:
    """LM rows of one image: (h / m) * (w / m). The tower's `sd2_tpool` merge averages the t frames, so the count
    does not grow with t (the processor's images have t = 1)."""
    t, h, w = (int(v) for v in grid_thw)
    if t < 1 or h < 1 or w < 1 or h % merge_kernel_size or w % merge_kernel_size:
        raise ValueError(
            f"grid_thw {(t, h, w)} must be positive with h, w divisible by the merge kernel {merge_kernel_size}"
        )
    return (h // merge_kernel_size) * (w // merge_kernel_size)

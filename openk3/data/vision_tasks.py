"""Embedded image-text tasks for training the vision tower from scratch: rendered with Pillow and the DejaVu fonts that
matplotlib ships, so nothing is downloaded.

Task definition. Every example is an image, a prompt (a caption request or a question) and the answer, a short
string read off the image; a model is scored on the answer only. Three kinds:

- `text` (rendered text): a common English word, two of them, or a random code of 3-6 capital letters and digits,
  drawn in one of the DejaVu Sans faces at 12-30 px on a random background colour, in a contrasting colour, at a
  random position, rotated by up to +-8 degrees, with Gaussian pixel noise; prompt one of `TEXT_PROMPTS`;
  answer = the text exactly.
- `count` (simple scene): 1-6 shapes (circle, square, triangle; colours from `COLOURS`) in distinct cells of a 3 x 3
  grid over the image (they never overlap or touch), light background, mild noise; "How many shapes are
  there?" -> the number of shapes, or "How many circles are there?" -> the number of circles (may be 0); answers are
  digits.
- `colour` (simple scene): as `count`, with exactly one shape of the asked kind: "What colour is the triangle?" ->
  its colour name.

Image sides are 56-112 px (at most 4 x 4 = 16 LM tokens after the processor's 28-px padding and 2 x 2 merge), so
the tiny tower (`K3Config.preset("tiny-vl")`) stays cheap. Example i of a stream is drawn from its own
`random.Random` keyed by (split, seed, i): a (split, seed, i) triple always gives the same pixels and strings, in
any process and in any order. `train_heldout_split` draws the two sets from different streams and drops any
held-out example whose image or (prompt, answer, text) also occurs in training.

Metrics (the answer and the prediction are normalised by `normalise`: strip, case-fold): `exact_match` and
`character_error_rate` (Levenshtein distance / len(answer)); `blank_like` gives the same-size blank image that the
"can only guess" baseline is fed.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import random
from dataclasses import dataclass, field
from typing import Any

import matplotlib
import numpy as np
from PIL import Image, ImageDraw, ImageFont

KINDS = ("text", "count", "colour")
SHAPES = ("circle", "square", "triangle")
COLOURS = {
    "red": (220, 30, 30), "green": (30, 150, 40), "blue": (30, 60, 220),
    "yellow": (230, 200, 0), "purple": (140, 40, 170), "orange": (245, 125, 15),
}  # fmt: skip
FONT_FILES = ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSans-Oblique.ttf", "DejaVuSansMono.ttf",
              "DejaVuSansMono-Bold.ttf")  # fmt: skip
TEXT_PROMPTS = ("What does the text in the image say?", "Read the text in the image.",
                "Write down the text shown.", "Caption:")  # fmt: skip
_WORD_LIST = """
the of and to in is you that it he was for on are as with his they at be this have from or one had by word but not
what all were we when your can said there use an each which she do how their if will up other about out many then
them these so some her would make like him into time has look two more write go see number no way could people my
than first water been call who oil its now find long down day did get come made may part over new sound take only
little work know place year live me back give most very after thing our just name good sentence man think say great
where help through much before line right too mean old any same tell boy follow came want show also around form three
small set put end does another well large must big even such because turn here why ask went men read need land
different home us move try kind hand picture again change off play spell air away animal house point page letter
mother answer found study still learn should world high every near add food between own below country plant last
school father keep tree never start city earth eye light thought head under story saw left few while along might close
something seem next hard open example begin life always those both paper together got group often run
"""
WORDS = tuple(_WORD_LIST.split())  # 246 of the most common English words
CODE_ALPHABET = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"  # no I/1, O/0: ambiguous in some faces
MIN_SIDE, MAX_SIDE = 56, 112
_KIND_WEIGHTS = {"text": 2.0, "count": 1.0, "colour": 1.0}


@dataclass
class VisionExample:
    image: Image.Image  # RGB
    prompt: str
    answer: str
    kind: str  # one of KINDS
    spec: dict[str, Any] = field(default_factory=dict, compare=False)  # what was drawn (see the samplers)


def font_path(name: str = "DejaVuSans.ttf") -> str:
    """A DejaVu font file that matplotlib ships."""
    path = os.path.join(matplotlib.get_data_path(), "fonts", "ttf", name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: matplotlib's bundled DejaVu fonts are needed for the vision tasks")
    return path


@functools.lru_cache(maxsize=256)
def _font(name: str, size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.truetype(font_path(name), size)


def _luma(rgb: tuple[int, int, int]) -> float:
    return 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]


def _add_noise(image: Image.Image, sigma: float, rng: random.Random) -> Image.Image:
    if sigma <= 0:
        return image
    noise_rng = np.random.default_rng(rng.getrandbits(64))
    x_HWC = np.asarray(image, dtype=np.float32) + noise_rng.normal(0.0, sigma, size=(image.height, image.width, 3))
    return Image.fromarray(np.clip(np.rint(x_HWC), 0, 255).astype(np.uint8), "RGB")


def _sample_text(rng: random.Random) -> str:
    u = rng.random()
    if u < 0.6:
        return rng.choice(WORDS)
    if u < 0.8:
        return f"{rng.choice(WORDS)} {rng.choice(WORDS)}"
    return "".join(rng.choice(CODE_ALPHABET) for _ in range(rng.randint(3, 6)))


def render_text(text: str, rng: random.Random) -> tuple[Image.Image, dict[str, Any]]:
    """`text` drawn as the module docstring says; returns (image, spec) with spec the drawn parameters."""
    face = rng.choice(FONT_FILES)
    size = rng.randint(12, 30)
    angle = rng.uniform(-8.0, 8.0)
    bg = tuple(rng.randint(0, 255) for _ in range(3))
    while True:
        fg = tuple(rng.randint(0, 255) for _ in range(3))
        if abs(_luma(fg) - _luma(bg)) >= 100:
            break
    while True:
        # Text on a transparent layer, rotated (bicubic); shrink the font until it fits the largest image with a
        # 4 px margin on each side.
        left, top, right, bottom = _font(face, size).getbbox(text)
        layer = Image.new("RGBA", (right - left + 4, bottom - top + 4), (*fg, 0))
        ImageDraw.Draw(layer).text((2 - left, 2 - top), text, font=_font(face, size), fill=(*fg, 255))
        layer = layer.rotate(angle, resample=Image.Resampling.BICUBIC, expand=True)
        if layer.width <= MAX_SIDE - 8 or size <= 8:
            break
        size -= 1
    width = rng.randint(max(MIN_SIDE, layer.width + 8), MAX_SIDE)
    height = rng.randint(max(MIN_SIDE, layer.height + 8), MAX_SIDE)
    x = rng.randint(4, width - layer.width - 4)
    y = rng.randint(4, height - layer.height - 4)
    image = Image.new("RGB", (width, height), bg)
    image.paste(layer, (x, y), layer)
    noise = rng.uniform(0.0, 12.0)
    image = _add_noise(image, noise, rng)
    spec = {"text": text, "font": face, "size": size, "angle": angle, "xy": (x, y), "fg": fg, "bg": bg,
            "noise": noise}  # fmt: skip
    return image, spec


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], rgb) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=rgb)
    elif shape == "square":
        draw.rectangle(box, fill=rgb)
    else:
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=rgb)


def render_scene(shapes: list[tuple[str, str]], rng: random.Random) -> tuple[Image.Image, dict[str, Any]]:
    """[(shape, colour name)] drawn in distinct cells of a 3 x 3 grid (non-overlapping, separated by >= 2 px);
    returns (image, spec) with spec["shapes"] = [(shape, colour, box)] and the background."""
    if not 1 <= len(shapes) <= 9:
        raise ValueError(f"a scene holds 1-9 shapes, got {len(shapes)}")
    width, height = rng.randint(72, MAX_SIDE), rng.randint(72, MAX_SIDE)
    cw, ch = width / 3, height / 3
    bg = tuple(rng.randint(200, 255) for _ in range(3))
    image = Image.new("RGB", (width, height), bg)
    draw = ImageDraw.Draw(image)
    drawn = []
    for (shape, colour), cell in zip(shapes, rng.sample(range(9), len(shapes))):
        cx0, cy0 = math.ceil((cell % 3) * cw) + 1, math.ceil((cell // 3) * ch) + 1
        cx1, cy1 = math.floor((cell % 3 + 1) * cw) - 2, math.floor((cell // 3 + 1) * ch) - 2
        side = rng.randint(10, min(cx1 - cx0, cy1 - cy0))
        x0, y0 = rng.randint(cx0, cx1 - side), rng.randint(cy0, cy1 - side)
        box = (x0, y0, x0 + side, y0 + side)
        _draw_shape(draw, shape, box, COLOURS[colour])
        drawn.append((shape, colour, box))
    noise = rng.uniform(0.0, 6.0)
    return _add_noise(image, noise, rng), {"shapes": drawn, "bg": bg, "noise": noise}


def _plural(shape: str) -> str:
    return shape + "s"


def _scene_example(kind: str, rng: random.Random) -> VisionExample:
    colours = list(COLOURS)
    if kind == "colour":
        target = rng.choice(SHAPES)
        others = [s for s in SHAPES if s != target]
        n = rng.randint(1, 6)
        shapes = [(target, rng.choice(colours))] + [(rng.choice(others), rng.choice(colours)) for _ in range(n - 1)]
        rng.shuffle(shapes)
        image, spec = render_scene(shapes, rng)
        answer = next(c for s, c in shapes if s == target)
        return VisionExample(image, f"What colour is the {target}?", answer, kind, {**spec, "question": "colour"})
    n = rng.randint(1, 6)
    shapes = [(rng.choice(SHAPES), rng.choice(colours)) for _ in range(n)]
    image, spec = render_scene(shapes, rng)
    if rng.random() < 0.5:
        return VisionExample(image, "How many shapes are there?", str(n), kind, {**spec, "question": "count_all"})
    target = rng.choice(SHAPES)
    count = sum(s == target for s, _ in shapes)
    prompt = f"How many {_plural(target)} are there?"
    return VisionExample(image, prompt, str(count), kind, {**spec, "question": "count_shape", "target": target})


def example(index: int, seed: int = 0, split: str = "train", kinds: tuple[str, ...] = KINDS) -> VisionExample:
    """Example `index` of the (split, seed) stream; `kinds` restricts the mix (default weights text 2 : count 1 :
    colour 1)."""
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"unknown vision task kind {kind!r}; choose from {KINDS}")
    rng = random.Random(f"openk3.vision_tasks:{split}:{seed}:{index}")
    kind = rng.choices(kinds, weights=[_KIND_WEIGHTS[k] for k in kinds])[0]
    if kind == "text":
        text = _sample_text(rng)
        prompt = rng.choice(TEXT_PROMPTS)
        image, spec = render_text(text, rng)
        return VisionExample(image, prompt, text, kind, {**spec, "question": "read"})
    return _scene_example(kind, rng)


def generate(n: int, seed: int = 0, split: str = "train", kinds: tuple[str, ...] = KINDS) -> list[VisionExample]:
    """Examples 0..n-1 of the (split, seed) stream."""
    return [example(i, seed, split, kinds) for i in range(n)]


def caption(ex: VisionExample) -> str:
    """What the image shows, for contrastive pre-training (train/contrastive.py): the text read off a `text` image;
    a scene's shapes as "colour shape" items sorted and counted ("2 red circle, 1 blue square")."""
    if ex.kind == "text":
        return ex.spec["text"]
    counts: dict[str, int] = {}
    for shape, colour, _ in ex.spec["shapes"]:
        counts[f"{colour} {shape}"] = counts.get(f"{colour} {shape}", 0) + 1
    return ", ".join(f"{n} {item}" for item, n in sorted(counts.items()))


def _image_key(ex: VisionExample) -> str:
    return hashlib.sha1(repr(ex.image.size).encode() + ex.image.tobytes()).hexdigest()


def train_heldout_split(
    num_train: int, num_heldout: int, seed: int = 0, kinds: tuple[str, ...] = KINDS
) -> tuple[list[VisionExample], list[VisionExample]]:
    """(train, held-out): the first `num_train` examples of the ("train", seed) stream and `num_heldout` of the
    ("heldout", seed) stream, skipping any held-out example whose pixels equal a training image. Answers may recur
    (the same word in a new rendering); images never do."""
    train = generate(num_train, seed, "train", kinds)
    seen = {_image_key(ex) for ex in train}
    heldout, i = [], 0
    while len(heldout) < num_heldout:
        ex = example(i, seed, "heldout", kinds)
        i += 1
        if _image_key(ex) not in seen:
            heldout.append(ex)
    return train, heldout


def blank_like(image: Image.Image, fill: tuple[int, int, int] = (255, 255, 255)) -> Image.Image:
    """A one-colour RGB image of `image`'s size: the input of the "can only guess" baseline."""
    return Image.new("RGB", image.size, fill)


def normalise(text: str) -> str:
    return text.strip().casefold()


def exact_match(pred: str, answer: str) -> bool:
    return normalise(pred) == normalise(answer)


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions all cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def character_error_rate(pred: str, answer: str) -> float:
    """edit_distance(pred, answer) / len(answer) after `normalise`; an empty answer gives 0.0 for an empty
    prediction and 1.0 otherwise (the error is total, not infinite)."""
    pred, answer = normalise(pred), normalise(answer)
    if not answer:
        return 0.0 if not pred else 1.0
    return edit_distance(pred, answer) / len(answer)

"""The embedded image-text tasks (openk3/data/vision_tasks.py) and the `tiny-vl` preset they train: determinism,
disjoint splits, coverage of every kind and question, answers checked against the pixels (connected shapes counted,
colours sampled), ink in the text images, the metrics on known pairs, generation speed; and one forward/backward of
`K3ForConditionalGeneration(K3Config.preset("tiny-vl"))` on two generated images."""

from __future__ import annotations

import random
import time
from collections import Counter

import numpy as np
import pytest
import torch

from openk3 import K3Config
from openk3.data import vision_tasks as vt
from openk3.data.vision import image_prompt, num_image_tokens, preprocess
from openk3.model.multimodal import K3ForConditionalGeneration


def _pixels(image) -> np.ndarray:
    return np.asarray(image, dtype=np.int16)


def _components(mask_HW: np.ndarray) -> int:
    """4-connected components of a boolean mask."""
    seen = np.zeros_like(mask_HW)
    H, W = mask_HW.shape
    count = 0
    for y0, x0 in zip(*np.nonzero(mask_HW)):
        if seen[y0, x0]:
            continue
        count += 1
        stack = [(y0, x0)]
        seen[y0, x0] = True
        while stack:
            y, x = stack.pop()
            for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if 0 <= ny < H and 0 <= nx < W and mask_HW[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
    return count


def test_same_seed_same_examples_and_different_seed_different():
    a, b = vt.generate(40, seed=3), vt.generate(40, seed=3)
    for x, y in zip(a, b):
        assert (x.kind, x.prompt, x.answer) == (y.kind, y.prompt, y.answer)
        assert x.image.size == y.image.size and x.image.tobytes() == y.image.tobytes()
    # An example depends only on (split, seed, index), not on what was drawn before it.
    assert vt.example(17, seed=3).image.tobytes() == a[17].image.tobytes()
    c = vt.generate(40, seed=4)
    assert sum(x.image.tobytes() == y.image.tobytes() for x, y in zip(a, c)) == 0


def test_split_is_disjoint_and_reproducible():
    train, held = vt.train_heldout_split(300, 100, seed=0)
    assert len(train) == 300 and len(held) == 100
    train_images = {ex.image.tobytes() for ex in train}
    assert not any(ex.image.tobytes() in train_images for ex in held)
    # The training set is the plain train stream, and the split does not depend on anything else.
    assert [ex.answer for ex in train] == [ex.answer for ex in vt.generate(300, seed=0)]
    _, held2 = vt.train_heldout_split(300, 100, seed=0)
    assert [ex.image.tobytes() for ex in held2] == [ex.image.tobytes() for ex in held]

    # Random codes (3-6 chars from 32 symbols) of the held-out set are new.
    def codes(examples):
        return {
            ex.answer for ex in examples if ex.kind == "text" and ex.answer not in vt.WORDS and " " not in ex.answer
        }

    assert codes(held) and not (codes(held) & codes(train))


def test_every_kind_and_question_appears_and_kinds_restrict():
    examples = vt.generate(400, seed=1)
    assert set(Counter(ex.kind for ex in examples)) == set(vt.KINDS)
    questions = Counter(ex.spec["question"] for ex in examples)
    assert set(questions) == {"read", "count_all", "count_shape", "colour"}
    assert {ex.prompt for ex in examples if ex.kind == "text"} == set(vt.TEXT_PROMPTS)
    assert {ex.prompt for ex in examples if ex.kind == "colour"} == {f"What colour is the {s}?" for s in vt.SHAPES}
    # Words, two-word lines and codes all occur; answers of scenes are digits and colour names.
    texts = [ex.answer for ex in examples if ex.kind == "text"]
    assert any(" " in t for t in texts) and any(t in vt.WORDS for t in texts) and any(t.isupper() for t in texts)
    assert {ex.answer for ex in examples if ex.kind == "colour"} == set(vt.COLOURS)
    assert {int(ex.answer) for ex in examples if ex.spec["question"] == "count_all"} == set(range(1, 7))
    assert all(vt.MIN_SIDE <= s <= vt.MAX_SIDE for ex in examples for s in ex.image.size)
    assert all(ex.image.mode == "RGB" for ex in examples)
    assert {ex.kind for ex in vt.generate(50, seed=1, kinds=("text",))} == {"text"}
    with pytest.raises(ValueError, match="unknown vision task kind"):
        vt.example(0, kinds=("ocr",))


def test_scene_answers_match_the_drawn_scene():
    examples = [ex for ex in vt.generate(200, seed=2) if ex.kind != "text"]
    assert len(examples) > 60
    for ex in examples:
        shapes = ex.spec["shapes"]
        x_HWC = _pixels(ex.image)
        ink_HW = np.abs(x_HWC - np.array(ex.spec["bg"], dtype=np.int16)).max(-1) > 60
        # Every drawn shape is one separate blob: the number of blobs is the number of shapes in the spec.
        assert _components(ink_HW) == len(shapes), ex.spec
        for shape, colour, (x0, y0, x1, y1) in shapes:
            # The shape's colour at a point inside it (a triangle's centroid), up to the noise (sigma <= 6).
            cx, cy = (x0 + x1) // 2, (y0 + 2 * y1) // 3 if shape == "triangle" else (y0 + y1) // 2
            assert np.abs(x_HWC[cy, cx] - np.array(vt.COLOURS[colour])).max() <= 40, (ex.spec, shape, colour)
        q = ex.spec["question"]
        if q == "count_all":
            assert ex.answer == str(len(shapes)) and 1 <= len(shapes) <= 6
        elif q == "count_shape":
            target = ex.spec["target"]
            assert ex.prompt == f"How many {target}s are there?"
            assert ex.answer == str(sum(s == target for s, _, _ in shapes))
        else:
            target = ex.prompt.removeprefix("What colour is the ").removesuffix("?")
            owners = [c for s, c, _ in shapes if s == target]
            assert owners == [ex.answer]


def test_text_images_hold_the_ink_of_their_text():
    examples = [ex for ex in vt.generate(120, seed=5) if ex.kind == "text"]
    for ex in examples:
        assert ex.answer == ex.spec["text"]
        ink_HW = np.abs(_pixels(ex.image) - np.array(ex.spec["bg"], dtype=np.int16)).max(-1) > 70
        assert ink_HW.sum() >= 15, ex.spec  # noise sigma <= 12 never reaches 70
        ys, xs = np.nonzero(ink_HW)
        assert xs.min() >= 2 and ys.min() >= 2
        assert xs.max() < ex.image.width - 2 and ys.max() < ex.image.height - 2
    # Same rendering parameters, different text -> different pixels; same text -> same pixels.
    a, _ = vt.render_text("water", random.Random(9))
    b, _ = vt.render_text("paper", random.Random(9))
    c, _ = vt.render_text("water", random.Random(9))
    assert a.tobytes() != b.tobytes() and a.tobytes() == c.tobytes()
    blank = vt.blank_like(a)
    assert (
        blank.size == a.size and blank.mode == "RGB" and np.unique(_pixels(blank).reshape(-1, 3), axis=0).shape[0] == 1
    )


def test_metrics_on_known_pairs():
    assert vt.exact_match(" Water\n", "water") and vt.exact_match("", "")
    assert not vt.exact_match("wate", "water") and not vt.exact_match("", "a")
    assert vt.edit_distance("kitten", "sitting") == 3 and vt.edit_distance("", "abc") == 3
    assert vt.character_error_rate("water", "water") == 0.0
    assert vt.character_error_rate("WATER ", "water") == 0.0
    assert vt.character_error_rate("wtaer", "water") == pytest.approx(2 / 5)
    assert vt.character_error_rate("", "water") == 1.0
    assert vt.character_error_rate("waters", "water") == pytest.approx(1 / 5)
    assert vt.character_error_rate("a much longer guess", "ab") == 9.0  # keep "a", substitute one "b", delete 17
    assert vt.character_error_rate("", "") == 0.0 and vt.character_error_rate("x", "") == 1.0


def test_generation_is_fast():
    vt.generate(20, seed=99)  # font cache warm-up
    start = time.perf_counter()
    examples = vt.generate(1000, seed=7)
    elapsed = time.perf_counter() - start
    assert len(examples) == 1000
    assert elapsed < 10.0, f"1000 examples took {elapsed:.2f} s (about 0.6 s expected on one core)"


def test_tiny_vl_preset_trains_the_tower_through_a_text_loss():
    config = K3Config.preset("tiny-vl")
    assert config.media_placeholder_token_id == 768 + 21
    with torch.device("meta"):
        model = K3ForConditionalGeneration(config)
    tower = sum(p.numel() for p in model.vision_tower.parameters())
    projector = sum(p.numel() for p in model.mm_projector.parameters())
    assert (tower, projector) == (1_933_248, 737_472)
    assert model.num_parameters()[0] == 8_977_906
    model.to_empty(device="cpu")
    model.init_weights(torch.Generator().manual_seed(0))
    torch.manual_seed(0)

    a, b = vt.example(0, seed=11, kinds=("text",)), vt.example(1, seed=11, kinds=("count",))
    pixel_values, grid_thws = preprocess([a.image, b.image])
    rows = [num_image_tokens(g) for g in grid_thws]

    def ids(text: str) -> list[int]:  # byte-level ids (the tiny vocabulary's base ranks)
        return list(text.encode())

    # The image prompt of data/vision.image_prompt with the tiny vocabulary's ids: <|media_begin|> = base + 18,
    # <|media_content|> + 19, <|media_end|> + 20, one <|media_pad|> (+ 21, the placeholder) per image.
    base, ph = 768, config.media_placeholder_token_id
    assert image_prompt(a.image).startswith(f"<|media_begin|>image {a.image.width}x{a.image.height}")
    prefix, answers = [config.bos_token_id], []
    for ex in (a, b):
        prefix += [base + 18, *ids(f"image {ex.image.width}x{ex.image.height}"), base + 19, ph, base + 20]
        prefix += ids(ex.prompt)
        answers += ids(" " + ex.answer)
    tokens = prefix + answers + [config.eos_token_id]
    input_ids = torch.tensor([tokens])
    labels = torch.tensor([[-100] * len(prefix) + answers + [config.eos_token_id]])  # shifted inside the model
    out = model(input_ids, pixel_values=pixel_values, grid_thws=grid_thws, labels=labels)
    assert out.logits.shape == (1, len(tokens) - 2 + sum(rows), config.text_config.vocab_size)
    assert torch.isfinite(out.loss) and out.loss.item() > 0
    out.loss.backward()
    for name, p in [*model.vision_tower.named_parameters(), *model.mm_projector.named_parameters()]:
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name

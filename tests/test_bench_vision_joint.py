"""benchmarks/vision_joint.py swaps the vision task stream for one-letter images while it runs `k3 train`: the swap
must give the glyph benchmark's images and answers, leave the real stream in place afterwards (even on an error),
and reject unknown task names."""

from __future__ import annotations

import pytest
import vision_glyph  # benchmarks/ (pyproject's pytest pythonpath)
import vision_joint

from openk3.data import vision_tasks as vt


def test_glyph_stream_swaps_in_letters_and_restores_the_task_stream():
    original = vt.example
    with vision_joint.glyph_stream(bw=True, aligned=True):
        ex = vt.example(3, seed=0, split="heldout")
        image, label = vision_glyph.glyph(3, "heldout", True, True)
        assert ex.answer == vision_glyph.LETTERS[label] and ex.image.tobytes() == image.tobytes()
        assert ex.prompt == vision_joint.GLYPH_PROMPT and ex.kind == "text"
        assert vt.example(3, seed=1).image.tobytes() != vt.example(3, seed=0).image.tobytes()
    assert vt.example is original
    with pytest.raises(RuntimeError), vision_joint.glyph_stream(bw=False, aligned=False):
        raise RuntimeError("a failing run")
    assert vt.example is original


def test_unknown_tasks_are_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        vision_joint.main(["--tasks", "glyph-bw-sideways"])
    assert "glyph-bw-sideways" in capsys.readouterr().err

"""`k3 plot`: every figure has a title and labelled axes, each MoE layer's MaxVio curve is named, and no legend
covers the plotting area (the loss legend used to sit on the learning-rate curve)."""

from __future__ import annotations

import json

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from openk3.train.plot import loss_figure, max_vio_figure, plot_run


def _rows(steps: int = 12, layers: int = 3) -> list[dict]:
    rows = []
    for s in range(1, steps + 1):
        row = {"step": s, "loss": 7.0 - 0.1 * s, "lr": 1e-3 * min(1.0, s / 4), "unigram_loss": 6.5,
               "max_vio": 1.0 / s, "max_vio_per_layer": [1.0 / s - 0.01 * j for j in range(layers)],
               "max_vio_floor": 0.05}  # fmt: skip
        if s % 4 == 0:
            row["val_loss"] = 7.1 - 0.1 * s
            row["expert_load"] = [[1 + (e + j) % 3 for e in range(8)] for j in range(layers)]
        rows.append(row)
    return rows


def _legend_outside_axes(fig) -> bool:
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    legend_box = ax.get_legend().get_window_extent(renderer)
    return not legend_box.overlaps(ax.get_window_extent(renderer))


def test_loss_figure_names_everything_and_its_legend_covers_no_curve():
    fig = loss_figure(_rows(), "run-x")
    ax, ax2 = fig.axes[0], fig.axes[1]
    assert "run-x" in ax.get_title() and ax.get_xlabel() == "step" and ax.get_ylabel() and ax2.get_ylabel()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["train loss", "validation loss", "unigram baseline", "learning rate (right axis)"]
    assert _legend_outside_axes(fig)


@pytest.mark.parametrize("layers", [1, 3, 40])
def test_max_vio_figure_has_a_title_and_per_layer_labels(layers):
    fig = max_vio_figure(_rows(layers=layers), "run-x")
    ax = fig.axes[0]
    assert "MaxVio" in ax.get_title() and "run-x" in ax.get_title() and ax.get_xlabel() and ax.get_ylabel()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == [f"MoE layer {j}" for j in range(layers)] + ["max over layers", "random-routing floor"]
    assert _legend_outside_axes(fig)


def test_plot_run_writes_the_three_pngs(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in _rows())
    written = plot_run(str(tmp_path))
    assert [p.rsplit("/", 1)[-1] for p in written] == ["loss.png", "max_vio.png", "expert_load.png"]
    for path in written:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"

"""`k3 plot RUN_DIR`: PNG plots of a run from its metrics.jsonl (no model needed).

    loss.png         training loss per step, validation loss at eval steps, learning rate on a second axis
    max_vio.png      MaxVio (max over MoE layers) per step and each layer's value
    expert_load.png  heatmap of the last logged per-layer expert loads, as load / mean load
"""

from __future__ import annotations

import json
import os


def read_metrics(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_run(run_dir: str, out_dir: str | None = None) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir}/metrics.jsonl is empty")
    out_dir = out_dir or run_dir
    os.makedirs(out_dir, exist_ok=True)
    written = []
    steps = [r["step"] for r in rows]

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in rows], label="train loss", lw=1)
    evals = [r for r in rows if "val_loss" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="validation loss")
    if "unigram_loss" in rows[-1]:
        ax.axhline(rows[-1]["unigram_loss"], color="gray", ls="--", label="unigram baseline")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax2 = ax.twinx()
    ax2.plot(steps, [r["lr"] for r in rows], color="tab:green", alpha=0.4, lw=1)
    ax2.set_ylabel("learning rate", color="tab:green")
    ax.legend(loc="upper right")
    ax.set_title(os.path.basename(os.path.abspath(run_dir)))
    written.append(_save(fig, out_dir, "loss.png"))

    with_vio = [r for r in rows if r.get("max_vio") is not None]
    if with_vio:
        fig, ax = plt.subplots(figsize=(7, 4))
        per_layer = [r.get("max_vio_per_layer") or [] for r in with_vio]
        for j in range(max(len(p) for p in per_layer)):
            ax.plot([r["step"] for r in with_vio], [p[j] if j < len(p) else None for p in per_layer], lw=0.6, alpha=0.5)
        ax.plot([r["step"] for r in with_vio], [r["max_vio"] for r in with_vio], color="black", lw=1.5, label="max over layers")
        if "max_vio_floor" in with_vio[-1]:
            ax.axhline(with_vio[-1]["max_vio_floor"], color="red", ls="--", label="random-routing floor")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("MaxVio (max load / mean load - 1)")
        ax.legend()
        written.append(_save(fig, out_dir, "max_vio.png"))

    loads = [r["expert_load"] for r in rows if r.get("expert_load")]
    if loads:
        import numpy as np

        grid = np.array(loads[-1], dtype=float)
        grid = grid / np.maximum(grid.mean(axis=1, keepdims=True), 1e-9)
        fig, ax = plt.subplots(figsize=(7, 0.4 * grid.shape[0] + 1.5))
        im = ax.imshow(grid, aspect="auto", cmap="coolwarm", vmin=0, vmax=2)
        ax.set_xlabel("expert")
        ax.set_ylabel("MoE layer")
        fig.colorbar(im, label="load / mean load")
        ax.set_title(f"expert load at step {[r for r in rows if r.get('expert_load')][-1]['step']}")
        written.append(_save(fig, out_dir, "expert_load.png"))
    return written


def _save(fig, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path

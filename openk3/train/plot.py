"""`k3 plot RUN_DIR`: PNG plots of a run from its metrics.jsonl (no model needed).

    loss.png         training loss per step, validation loss at eval steps, learning rate on a second axis; the
                     legend sits below the axes so it covers no curve
    max_vio.png      MaxVio (max over MoE layers) per step and each MoE layer's value, labelled, legend at the right
    expert_load.png  heatmap of the last logged per-layer expert loads, as load / mean load
    grad_norm.png    vision runs: the whole model's and the tower's gradient norm per step (log scale)
    vision_eval.png  vision runs: held-out exact match per task kind at each evaluation, blank-image baseline dashed

`k3 plot RUN_A RUN_B ...` (several runs) writes one figure, grad_norm_compare.png in --out (default: the current
folder): the runs' tower and whole-model gradient norms on shared axes (the report's stability comparison).
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


def prepare_plots(run_dir: str, out_dir: str | None) -> tuple[list[dict], str, str]:
    """(metric rows, output folder (made), run name) for a run's plots; the non-interactive matplotlib backend."""
    import matplotlib

    matplotlib.use("Agg")
    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir}/metrics.jsonl is empty")
    out_dir = out_dir or run_dir
    os.makedirs(out_dir, exist_ok=True)
    return rows, out_dir, os.path.basename(os.path.abspath(run_dir))


def plot_run(run_dir: str, out_dir: str | None = None) -> list[str]:
    rows, out_dir, name = prepare_plots(run_dir, out_dir)
    written = [_save(loss_figure(rows, name), out_dir, "loss.png")]
    if any(r.get("max_vio") is not None for r in rows):
        written.append(_save(max_vio_figure(rows, name), out_dir, "max_vio.png"))
    if any(r.get("expert_load") for r in rows):
        written.append(_save(expert_load_figure(rows, name), out_dir, "expert_load.png"))
    if any("grad_norm_tower" in r for r in rows):
        written.append(_save(grad_norm_figure({name: rows}), out_dir, "grad_norm.png"))
    if any("vision_exact" in r for r in rows):
        written.append(_save(vision_eval_figure(rows, name), out_dir, "vision_eval.png"))
    return written


def plot_comparison(run_dirs: list[str], out_dir: str | None = None) -> list[str]:
    """grad_norm_compare.png: every run's gradient norms on one figure."""
    import matplotlib

    matplotlib.use("Agg")
    runs = {}
    for run in run_dirs:
        name = os.path.basename(os.path.abspath(run))
        if name in runs:
            name = os.path.abspath(run)
        runs[name] = read_metrics(run)
    out_dir = out_dir or "."
    os.makedirs(out_dir, exist_ok=True)
    return [_save(grad_norm_figure(runs), out_dir, "grad_norm_compare.png")]


def grad_norm_figure(runs: dict[str, list[dict]]):
    """Two panels: the tower's gradient norm (vision runs) and the whole model's, one curve per run, log scale.
    Norms are before clipping."""
    import matplotlib.pyplot as plt

    towers = any("grad_norm_tower" in r for rows in runs.values() for r in rows)
    fig, axes = plt.subplots(1, 2 if towers else 1, figsize=(12 if towers else 7, 4.4), squeeze=False)
    panels = [("grad_norm_tower", "vision tower"), ("grad_norm", "whole model")] if towers else [("grad_norm", "model")]
    for ax, (key, title) in zip(axes[0], panels):
        for name, rows in runs.items():
            have = [r for r in rows if key in r and r[key] is not None]
            ax.plot([r["step"] for r in have], [r[key] for r in have], lw=0.9, alpha=0.85, label=name)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("gradient norm (before clipping)")
        ax.set_title(f"{title}: gradient norm")
        ax.legend(fontsize="small", frameon=False)
    return fig


def vision_eval_figure(rows: list[dict], name: str):
    import matplotlib.pyplot as plt

    evals = [r for r in rows if "vision_exact" in r]
    kinds = sorted({k[len("vision_exact_") :] for r in evals for k in r if k.startswith("vision_exact_")
                    and not k.startswith("vision_exact_blank")})  # fmt: skip
    fig, ax = plt.subplots(figsize=(7, 4.4))
    steps = [r["step"] for r in evals]
    for kind in kinds:
        line = ax.plot(steps, [r.get(f"vision_exact_{kind}") for r in evals], "o-", label=kind)[0]
        blank = [r for r in evals if f"vision_exact_blank_{kind}" in r]
        if blank:
            ax.axhline(blank[-1][f"vision_exact_blank_{kind}"], color=line.get_color(), ls="--", lw=1,
                       label=f"{kind}, blank image")  # fmt: skip
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out exact match (greedy)")
    ax.set_title(f"{name}: held-out exact match by task kind")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    return fig


def loss_figure(rows: list[dict], name: str):
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.6))
    ax.plot(steps, [r["loss"] for r in rows], label="train loss", lw=1)
    evals = [r for r in rows if "val_loss" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="validation loss")
    if "unigram_loss" in rows[-1]:
        ax.axhline(rows[-1]["unigram_loss"], color="gray", ls="--", label="unigram baseline")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax2 = ax.twinx()
    ax2.plot(steps, [r["lr"] for r in rows], color="tab:green", alpha=0.4, lw=1, label="learning rate (right axis)")
    ax2.set_ylabel("learning rate", color="tab:green")
    ax.set_title(f"{name}: loss and learning rate")
    # One legend for both axes, below the plot: inside it would cover the curves (the lr curve sits top right).
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, fontsize="small",
              frameon=False)  # fmt: skip
    return fig


def max_vio_figure(rows: list[dict], name: str):
    import matplotlib.pyplot as plt

    with_vio = [r for r in rows if r.get("max_vio") is not None]
    steps = [r["step"] for r in with_vio]
    fig, ax = plt.subplots(figsize=(8, 4.6))
    per_layer = [r.get("max_vio_per_layer") or [] for r in with_vio]
    for j in range(max(len(p) for p in per_layer)):
        ax.plot(steps, [p[j] if j < len(p) else None for p in per_layer], lw=0.8, alpha=0.6, label=f"MoE layer {j}")
    ax.plot(steps, [r["max_vio"] for r in with_vio], color="black", lw=1.5, label="max over layers")
    if "max_vio_floor" in with_vio[-1]:
        ax.axhline(with_vio[-1]["max_vio_floor"], color="red", ls="--", label="random-routing floor")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("MaxVio (max load / mean load - 1)")
    ax.set_title(f"{name}: expert-load imbalance (MaxVio) per MoE layer")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False,
              ncol=1 + len(ax.lines) // 16)  # fmt: skip
    return fig


def expert_load_figure(rows: list[dict], name: str):
    import matplotlib.pyplot as plt
    import numpy as np

    last = [r for r in rows if r.get("expert_load")][-1]
    grid = np.array(last["expert_load"], dtype=float)
    grid = grid / np.maximum(grid.mean(axis=1, keepdims=True), 1e-9)
    fig, ax = plt.subplots(figsize=(7, 0.4 * grid.shape[0] + 1.5))
    im = ax.imshow(grid, aspect="auto", cmap="coolwarm", vmin=0, vmax=2)
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    fig.colorbar(im, label="load / mean load")
    ax.set_title(f"{name}: expert load at step {last['step']}")
    return fig


def _save(fig, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # "tight" keeps the legends placed outside the axes
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path

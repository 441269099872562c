"""`k3 plot RL_RUN`: PNG plots of a `k3 rl` run from its metrics.jsonl.

reward.png        training reward per step (and its 10-step mean); held-out success per family at the
                  evaluation steps (greedy, the same test tasks every time), on one figure with two panels
logprob_gap.png   the rollout-vs-train log-probability gap per token, with routing replay and without, log scale
"""

from __future__ import annotations

from openk3.train.plot import _save, prepare_plots


def plot_rl_run(run_dir: str, out_dir: str | None = None) -> list[str]:
    rows, out_dir, name = prepare_plots(run_dir, out_dir)
    written = [_save(reward_figure(rows, name), out_dir, "reward.png")]
    if any(r.get("logprob_gap_replay") is not None or r.get("logprob_gap_natural") is not None for r in rows):
        written.append(_save(gap_figure(rows, name), out_dir, "logprob_gap.png"))
    return written


def _running_mean(values: list[float], window: int = 10) -> list[float]:
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def reward_figure(rows: list[dict], name: str):
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    trained = [r for r in rows if "reward" in r]
    steps = [r["step"] for r in trained]
    rewards = [r["reward"] for r in trained]
    top.plot(steps, rewards, lw=0.8, alpha=0.4, label="reward (training samples)")
    top.plot(steps, _running_mean(rewards), lw=1.6, label="10-step mean")
    top.set_ylabel("mean reward")
    top.set_title(f"{name}: reward and held-out success")
    top.legend(loc="lower right", fontsize="small", frameon=False)
    evals = [r for r in rows if r.get("eval_success")]
    for family in sorted({f for r in evals for f in r["eval_success"]}):
        pts = [(r["step"], r["eval_success"][family]) for r in evals if family in r["eval_success"]]
        bottom.plot([s for s, _ in pts], [100 * v for _, v in pts], "o-", label=f"{family} (held-out, greedy)")
    bottom.set_xlabel("RL step (0 = after the SFT warm start)")
    bottom.set_ylabel("success (%)")
    bottom.set_ylim(-3, 103)
    bottom.legend(loc="lower right", fontsize="small", frameon=False)
    return fig


def gap_figure(rows: list[dict], name: str):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, label in (("logprob_gap_replay", "with routing replay"), ("logprob_gap_natural", "routes recomputed")):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            # A gap of exactly 0 has no place on a log axis; show it at the axis floor.
            # Marked points when the series is sparse (the other gap is measured every --gap-check-every steps).
            sparse = len(pts) * 2 < len(rows)
            ax.plot([s for s, _ in pts], [max(v, 1e-9) for _, v in pts], lw=1.2, label=label,
                    marker="o" if sparse else None, ms=4)  # fmt: skip
    ax.set_yscale("log")
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean |log p_train - log p_rollout| per token")
    ax.set_title(f"{name}: rollout vs trainer log-probabilities (this version's tokens)")
    ax.legend(fontsize="small", frameon=False)
    return fig

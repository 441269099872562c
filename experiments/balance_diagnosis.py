"""Where MaxVio comes from: the quantile-balancing rule, or the composition of the batches it is measured on.

    python experiments/balance_diagnosis.py --ckpt RUN_DIR_OR_CHECKPOINT [--batches 40]
        [--out benchmarks/results/balance-diagnosis]

A trained model is frozen (no drift), its router scores s [T, E] are recorded per MoE layer on fresh training batches,
and quantile balancing (the trainer's own histogram code) is replayed on those scores, step after step: the bias
computed from batch t routes batch t+1, and MaxVio (max over experts of load / mean load − 1) is measured on batch t+1. At the same
tokens per step:

- `rows`: the batches as the trainer draws them (each row one random window of one document), K3's rule;
- `shuffled`: the same tokens shuffled across the whole pool, so every batch is an i.i.d. sample of the pool;
- `+exact+ema`: both again with exact quantile thresholds and an EMA of the bias update (`--balance-exact-thresholds
  --balance-ema E`), the damped variant;
- `oracle`: each batch of `rows` routed with the pool's best bias (the exact solver run to convergence on all
  tokens), i.e. what a perfect, omniscient balancer scores on these batches; plus `in-sample`, batch t routed with
  the bias computed from batch t itself (the rule's own precision, one histogram pass), and the near-tie fraction
  (a router-health measure) at the converged bias.

`shuffled` near the random-routing floor means the rule keeps up with i.i.d. batches; `oracle` far above the floor
means the batches' composition (tokens of one document route alike) puts MaxVio out of reach of any bias computed
before the batch is seen. The scores are recorded once under the checkpoint's bias; replaying another bias does
not re-run the later layers (their inputs would change slightly through the routed experts' outputs).

Shapes: T tokens, E experts, k experts per token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
from bench import report as results  # benchmarks/report.py, loaded by path (experiments/bench.py)

from openk3.model.batch import ForwardBatch
from openk3.ops.moe.route import route_topk
from openk3.train.balance import (
    bias_bounds,
    moe_layers,
    near_ties,
    quantile_bias_update,
    quantile_histogram,
    solve_exact,
)
from openk3.train.checkpoint import load_model
from openk3.train.config import TrainConfig
from openk3.train.data import RunData
from openk3.train.metrics import expert_loads, max_vio, random_routing_maxvio_floor


@torch.no_grad()
def record_scores(model, data: RunData, rows: int, seq_len: int, batches: int) -> list[list[torch.Tensor]]:
    """scores[layer][batch] = s [rows·seq_len, E] fp32 of fresh training batches."""
    layers = [m for _, m in moe_layers(model)]
    out: list[list[torch.Tensor]] = [[] for _ in layers]
    for i, layer in enumerate(layers):
        layer.observer = lambda module, s_TE, idx_Tk, i=i: out[i].append(s_TE.float().clone())
    for _ in range(batches):
        batch = data.next_train_batch(rows, seq_len)
        model.forward_batch(ForwardBatch.from_rows(batch.input_ids, batch.doc_lens))
    for layer in layers:
        layer.observer = None
    return out


def _qb_update(s_TE: torch.Tensor, b_E: torch.Tensor, k: int, bins: int, exact: bool, ema: float) -> torch.Tensor:
    """One `Balancer.step` of the given variant (K3's rule: exact=False, ema=0)."""
    lo, hi = bias_bounds(b_E)
    return quantile_bias_update(quantile_histogram(s_TE, b_E, k, lo, hi, bins, None, exact), lo, hi, k, b_E, ema)


def _maxvio(s_TE: torch.Tensor, b_E: torch.Tensor, k: int) -> float:
    idx_Tk, _ = route_topk(s_TE, b_E, k, False, 1.0)
    return max_vio(expert_loads(idx_Tk, s_TE.shape[-1]), k, s_TE.shape[0])


def replay(batches: list[torch.Tensor], b0_E: torch.Tensor, k: int, bins: int, exact=False, ema=0.0) -> dict:
    """QB step by step over `batches`; MaxVio of each batch under the bias from the batch before it."""
    b_E, stale, in_sample = b0_E.clone(), [], []
    for s_TE in batches:
        stale.append(_maxvio(s_TE, b_E, k))
        b_E = _qb_update(s_TE, b_E, k, bins, exact, ema)
        in_sample.append(_maxvio(s_TE, b_E, k))
    return {"stale": stale, "in_sample": in_sample}


def _near_tie_fraction(s_TE: torch.Tensor, b_E: torch.Tensor, k: int, bins: int) -> float:
    lo, hi = bias_bounds(b_E)
    return float(near_ties(s_TE, b_E, k, (hi - lo) / bins)) / s_TE.shape[0]


def diagnose(
    scores: list[list[torch.Tensor]], biases: list[torch.Tensor], k: int, bins: int, ema: float, seed: int, skip: int
) -> dict:
    """Per layer: mean MaxVio (after `skip` warm-up steps) of each replay, and the near-tie fraction at the pool's
    converged bias."""
    per_layer = []
    for layer_scores, b0_E in zip(scores, biases):
        pool_TE = torch.cat(layer_scores)
        m = layer_scores[0].shape[0]
        perm = torch.randperm(pool_TE.shape[0], generator=torch.Generator().manual_seed(seed))
        shuffled = list(pool_TE[perm].split(m))[: len(layer_scores)]
        b_star = solve_exact(pool_TE, k, iters=30, bias_E=b0_E)

        def mean(v):  # the first steps still carry the checkpoint's bias
            return statistics.mean(v[skip:])

        rows = replay(layer_scores, b0_E, k, bins)
        per_layer.append(
            {
                "rows": mean(rows["stale"]),
                "shuffled": mean(replay(shuffled, b0_E, k, bins)["stale"]),
                "rows_exact_ema": mean(replay(layer_scores, b0_E, k, bins, exact=True, ema=ema)["stale"]),
                "shuffled_exact_ema": mean(replay(shuffled, b0_E, k, bins, exact=True, ema=ema)["stale"]),
                "oracle": mean([_maxvio(s, b_star, k) for s in layer_scores]),
                "in_sample": mean(rows["in_sample"]),
                "pool_maxvio_at_oracle": _maxvio(pool_TE, b_star, k),
                "near_tie_fraction_at_oracle": _near_tie_fraction(pool_TE, b_star, k, bins),
            }
        )
    return {"per_layer": per_layer, "tokens_per_step": scores[0][0].shape[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, help="a training run folder (its latest checkpoint) or a checkpoint")
    parser.add_argument("--batches", type=int, default=40, help="fresh batches per shape")
    parser.add_argument("--shapes", default="16x256,32x256,128x64", help="rows x seq_len per step, comma separated")
    parser.add_argument("--bins", type=int, default=1000)
    parser.add_argument("--ema", type=float, default=0.5, help="the damped variant's --balance-ema")
    parser.add_argument(
        "--out",
        default="runs/experiments/balance-diagnosis",
        help="JSON path or the path without .json, the .md beside it (default under runs/, not committed; "
        "--out benchmarks/results/balance-diagnosis replaces the committed result)",
    )
    args = parser.parse_args()
    model, ckpt = load_model(args.ckpt, dtype=torch.float32)
    model.eval()
    text = model.config.text_config
    k, E = text.num_experts_per_token, text.num_experts
    biases = [m.gate.e_score_correction_bias.float().clone() for _, m in moe_layers(model)]
    data = RunData(
        TrainConfig(out=os.devnull, progress=False, seed=12345), text, tokenizer_dir=ckpt, log=lambda *a: None
    )
    report = {"checkpoint": ckpt, "k": k, "num_experts": E, "bins": args.bins, "ema": args.ema, "batches": args.batches,
              "shapes": []}  # fmt: skip
    for shape in args.shapes.split(","):
        rows, seq_len = (int(x) for x in shape.split("x"))
        scores = record_scores(model, data, rows, seq_len, args.batches)
        d = diagnose(scores, biases, k, args.bins, args.ema, seed=0, skip=5)
        m = d["tokens_per_step"]
        d.update(shape=shape, q_bar=m * k / E, floor_one_layer=random_routing_maxvio_floor(m, E, k, trials=64, seed=1))
        report["shapes"].append(d)
        print(json.dumps({key: d[key] for key in ("shape", "q_bar", "floor_one_layer")}),
              *(json.dumps({key: round(v, 4) for key, v in row.items()}) for row in d["per_layer"]), sep="\n", flush=True)  # fmt: skip
    markdown = _markdown(report)
    print(markdown)
    results.write_report(report, args.out, markdown)


COLUMNS = ("rows", "shuffled", "rows_exact_ema", "shuffled_exact_ema", "oracle", "in_sample",
           "near_tie_fraction_at_oracle")  # fmt: skip


def _markdown(r: dict) -> str:
    lines = [
        "# Where MaxVio comes from (`experiments/balance_diagnosis.py`)\n",
        (
            f"Frozen checkpoint `{r['checkpoint']}`; {r['num_experts']} experts, top-{r['k']}; {r['batches']} fresh batches "
            f"per shape, the first 5 replayed steps dropped; QB with {r['bins']} bins.\n"
        ),
        (
            "Mean MaxVio per layer. `rows`: the batches as drawn, each routed with the bias QB computed from the batch "
            "before it (K3's rule). `shuffled`: the same, on the same tokens shuffled i.i.d. across the pool. "
            f"`+exact+ema`: the same two with `--balance-exact-thresholds --balance-ema {r['ema']}`. `oracle`: the batches "
            "as drawn, routed with the pool's converged bias (no balancer can do better on them). `in-sample`: each batch "
            "routed with the bias K3's rule computed from that batch. `near-tie`: fraction of tokens whose k-th and "
            "(k+1)-th biased scores differ by less than one bin at the converged bias (a router-health measure).\n"
        ),
    ]
    for d in r["shapes"]:
        lines += [
            (
                f"\n## {d['shape']} (rows x tokens): {d['tokens_per_step']} tokens/step, q̄ = {d['q_bar']:.0f}, "
                f"random-routing floor (one layer) {d['floor_one_layer']:.4f}\n"
            ),
            "| layer | rows | shuffled | rows +exact+ema | shuffled +exact+ema | oracle | in-sample | near-tie |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for i, row in enumerate(d["per_layer"]):
            lines.append(f"| {i} | " + " | ".join(f"{row[c]:.4f}" for c in COLUMNS) + " |")
        lines.append("| max | " + " | ".join(f"{max(row[c] for row in d['per_layer']):.4f}" for c in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

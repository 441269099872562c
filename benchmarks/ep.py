"""`k3 bench ep` (or `python benchmarks/ep.py`): expert-parallel balance at K3 scale, simulated: what each
rank receives in the MoE all-to-all, with and without quantile balancing, and with a MoonEP-style plan of replicated
hot experts.

Synthetic router (popular experts, as a trained router has them): per-token logits N(0, 1) plus a per-expert popularity offset N(0, σ_e²),
scores = sigmoid. n = 896 experts, top-16, experts split evenly over R ∈ {8, 32, 64} ranks, S tokens per rank.

- plain: top-k of the scores (router bias 0);
- quantile-balanced: the bias after `--qb-steps` K3 quantile-balancing steps (1000-bin histogram over
  [min b - 1, max b + 1], interpolated quantile, mean-centred; train/balance.py), each on a fresh batch, then
  measured on a new batch it never saw;
- MoonEP-style: the balanced routes, with hot experts' tokens spread over replicas so that every rank receives
  exactly its share (water-filling over ranks in expert order); reported with the replicas it needs.

Per scheme: tokens received per rank (max / mean), and bytes per rank per MoE layer for dispatch + combine of the
latent vectors (bf16, `routed_expert_hidden_size` wide; a token is sent once per destination rank, not per expert).

Legend: T tokens, E experts, R ranks, k experts per token.
"""

from __future__ import annotations

import argparse

import torch
from report import out_help, scratch_out, write_report

from openk3.config import K3Config
from openk3.train.balance import bias_bounds, quantile_histogram, recover_quantile_bias


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="k3 bench ep", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="8,32,64", help="EP degrees, comma-separated")
    p.add_argument("--tokens-per-rank", type=int, default=1024)
    p.add_argument("--skew", type=float, default=1.5, help="σ_e of the per-expert popularity offset")
    p.add_argument("--qb-steps", type=int, default=20, help="quantile-balancing steps before measuring")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small batches (seconds; for tests)")
    p.add_argument("--out", default=None, help=out_help("ep-sim"))
    args = p.parse_args(argv)
    args.out = args.out or scratch_out("ep-sim")
    text = K3Config.preset("k3").text_config
    E, k, latent = text.num_experts, text.num_experts_per_token, text.routed_expert_hidden_size
    tokens = 64 if args.quick else args.tokens_per_rank
    gen = torch.Generator().manual_seed(args.seed)
    popularity_E = args.skew * torch.randn(E, generator=gen)
    rows = []
    for R in [int(r) for r in args.ranks.split(",")]:
        if E % R:
            raise ValueError(f"--ranks: {R} does not divide the {E} experts")
        T = R * tokens

        def batch(T: int = T) -> torch.Tensor:
            return torch.sigmoid(torch.randn(T, E, generator=gen) + popularity_E)

        bias_E = torch.zeros(E)
        for _ in range(1 if args.quick else args.qb_steps):
            lo, hi = bias_bounds(bias_E)
            b_hat = recover_quantile_bias(quantile_histogram(batch(), bias_E, k, lo, hi, 1000), lo, hi, k)
            bias_E = (b_hat - b_hat.mean()).float()
        scores_TE = batch()
        plain_TK = scores_TE.topk(k, dim=-1).indices
        balanced_TK = (scores_TE + bias_E).topk(k, dim=-1).indices
        for scheme, idx_TK in (("plain", plain_TK), ("quantile", balanced_TK)):
            rows.append({"ranks": R, "scheme": scheme, **_all_to_all(idx_TK, E, R, tokens, latent)})
        rows.append({"ranks": R, "scheme": "moonep", **_moonep(balanced_TK, E, R, tokens, latent)})
    result = {"experts": E, "top_k": k, "latent": latent, "tokens_per_rank": tokens, "skew": args.skew, "rows": rows}
    print(f"{'ranks':>5} {'scheme':9} {'max/mean recv':>13} {'MiB sent/rank (mean, max)':>27} {'replicas':>8}")
    for r in rows:
        print(f"{r['ranks']:>5} {r['scheme']:9} {r['max_over_mean']:>13.3f} "
              f"{r['bytes_mean'] / 2**20:>13.2f} {r['bytes_max'] / 2**20:>13.2f} {r.get('replicas', 0):>8}")  # fmt: skip
    write_report(result, args.out, markdown(result, args))
    return 0


def markdown(result: dict, args) -> str:
    lines = [
        "# Expert-parallel balance at K3 scale (`k3 bench ep`, simulated)", "",
        (f"{result['experts']} experts, top-{result['top_k']}, {result['tokens_per_rank']} tokens per rank, popularity "
        f"skew σ_e = {result['skew']}, quantile balancing after {args.qb_steps} steps on fresh batches, measured on an "
        f"unseen batch. Bytes: dispatch + combine of bf16 {result['latent']}-wide latents, one copy per destination "
        "rank."), "",
        "| ranks | scheme | received max / mean | MiB sent per rank (mean) | (max) | replicas |",
        "|---:|---|---:|---:|---:|---:|",
    ]  # fmt: skip
    for r in result["rows"]:
        lines.append(f"| {r['ranks']} | {r['scheme']} | {r['max_over_mean']:.3f} | {r['bytes_mean'] / 2**20:.2f} | "
                     f"{r['bytes_max'] / 2**20:.2f} | {r.get('replicas', 0)} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _traffic(dest_TK: torch.Tensor, R: int, tokens: int, latent: int) -> tuple[float, float]:
    """Bytes each rank sends in dispatch + combine: one bf16 latent per (token, other destination rank), twice."""
    T = dest_TK.shape[0]
    src_T = torch.arange(T) // tokens
    pairs = torch.zeros(T, R, dtype=torch.bool)
    pairs[torch.arange(T)[:, None], dest_TK] = True
    pairs[torch.arange(T), src_T] = False  # a token's own rank needs no transfer
    sent_R = torch.zeros(R).index_add_(0, src_T, pairs.sum(-1).float())
    bytes_R = 2 * sent_R * latent * 2  # dispatch and combine, bf16
    return bytes_R.mean().item(), bytes_R.max().item()


def _all_to_all(idx_TK: torch.Tensor, E: int, R: int, tokens: int, latent: int) -> dict:
    """Experts e live on rank e // (E / R)."""
    load_E = torch.bincount(idx_TK.reshape(-1), minlength=E).float()
    recv_R = load_E.view(R, E // R).sum(-1)
    mean_b, max_b = _traffic(idx_TK // (E // R), R, tokens, latent)
    return {"max_over_mean": (recv_R.max() / recv_R.mean()).item(), "bytes_mean": mean_b, "bytes_max": max_b}


def _moonep(idx_TK: torch.Tensor, E: int, R: int, tokens: int, latent: int) -> dict:
    """Water-filling: walk the experts in order and fill ranks to exactly total/R (±1) tokens each; an expert whose
    tokens straddle a boundary is replicated on the next rank. Every rank then receives its exact share."""
    T, k = idx_TK.shape
    flat = idx_TK.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, experts ascending
    share = -(-T * k // R)
    dest_sorted = torch.arange(T * k) // share  # the i-th pair in expert order goes to rank i // share
    dest = torch.empty_like(flat)
    dest[order] = dest_sorted
    recv_R = torch.bincount(dest, minlength=R).float()
    # Replicas: ranks each expert's pairs land on, beyond one.
    pairs = torch.unique(torch.stack([flat[order], dest_sorted]), dim=1)
    replicas = pairs.shape[1] - torch.unique(flat).numel()
    mean_b, max_b = _traffic(dest.view(T, k), R, tokens, latent)
    return {"max_over_mean": (recv_R.max() / recv_R.mean()).item(), "bytes_mean": mean_b, "bytes_max": max_b,
            "replicas": int(replicas)}  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())

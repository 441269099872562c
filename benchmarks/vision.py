"""Vision on CPU: `python benchmarks/vision.py` (or `k3 bench vision`) writes
OUT.{md,json} and the gradient-norm figure OUT-grad_norm.png (OUT: runs/bench/vision-cpu unless `--out` names it;
`--out benchmarks/results/vision-cpu` replaces the committed results).

Three parts, each skippable:
1. from scratch (`--main-steps`): `k3 train --preset tiny-vl` with the given flags; held-out exact match and
   character error rate per task kind at the end, beside the same model fed blank images and the best constant
   answer per kind (chance); the wall time of the whole run (evaluations included) against 15 minutes.
2. stability (`--stability-steps`, `--seeds`): the same tiny-vl run from scratch and with the tower first
   pre-trained contrastively (`--contrastive-steps`), same data, steps and seeds. Per run: the tower's and the
   whole model's gradient norm per joint step (before clipping): mean, 99th percentile, spikes (a step whose norm
   exceeds 3x the median of the SPIKE_WINDOW steps before it), and the final evaluation.
3. tower throughput (`--tower`): the release MoonViT-V2 (27 blocks, 1152 wide; random weights) forward on one
   224x224 and one 1024x1024 image: patches/s, against the tower's matmul FLOPs (counted from its shapes) and this
   machine's measured matmul rate.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections import Counter

import torch
from report import machine_info, measure_matmul, out_help, scratch_out, targets_table, write_report

from openk3.config import K3Config
from openk3.train.config import TrainConfig
from openk3.train.plot import grad_norm_figure, read_metrics
from openk3.train.trainer import Trainer

SPIKE_WINDOW = 50
TARGET_MINUTES = 15.0


def chance(examples) -> dict:
    """Per kind, the exact match of the best constant answer (the most frequent held-out answer)."""
    out = {}
    for kind in sorted({ex.kind for ex in examples}):
        answers = Counter(ex.answer.casefold() for ex in examples if ex.kind == kind)
        out[kind] = answers.most_common(1)[0][1] / sum(answers.values())
    return out


def grad_stats(values: list[float]) -> dict:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    spikes = sum(v > 3 * statistics.median(values[i - SPIKE_WINDOW : i])
                 for i, v in enumerate(values) if i >= SPIKE_WINDOW)  # fmt: skip
    return {"mean": statistics.fmean(values), "p99": p99, "max": ordered[-1], "spikes": spikes}


def train(run: str, log, **kw) -> tuple[dict, float, Trainer]:
    shutil.rmtree(run, ignore_errors=True)
    cfg = TrainConfig(preset="tiny-vl", out=run, progress=False, sample_tokens=0, save_every=10**6, **kw)
    trainer = Trainer(cfg, log=log)
    t0 = time.perf_counter()
    last = trainer.run()
    return last, time.perf_counter() - t0, trainer


def tower_throughput(rate_gflops: float, repeats: int) -> list[dict]:
    """The release tower on 224^2 and 1024^2 images (fp32, random init)."""
    from PIL import Image

    from openk3.data.vision import preprocess
    from openk3.model.vision import MoonViT3d, PatchMergerMLPV2, VisionConfig, init_vision_weights

    vc = VisionConfig.from_dict(K3Config.preset("k3").vision_config)
    tower, projector = MoonViT3d(vc), PatchMergerMLPV2(vc)
    init_vision_weights(tower, projector, torch.Generator().manual_seed(0))
    tower.eval()
    projector.eval()
    rows = []
    for side in (224, 1024):
        image = Image.effect_noise((side, side), 64).convert("RGB")
        pixel_values, grid_thws = preprocess(image)
        t, h, w = grid_thws[0].tolist()
        L, D, Q, inner = t * h * w, vc.hidden_size, vc.qkv_hidden_size, vc.intermediate_size
        patch = 3 * vc.patch_size**2
        merged, width = L // 4, vc.mm_hidden_size * 4
        flops = (2 * L * patch * D  # patch embedding
                 + vc.num_layers * (2 * L * D * 3 * Q + 2 * 2 * L * L * Q + 2 * L * Q * D + 2 * 2 * L * D * inner)
                 + 2 * merged * width * width + 2 * merged * width * vc.text_hidden_size)  # fmt: skip
        times = []
        with torch.no_grad():
            for _ in range(repeats):
                t0 = time.perf_counter()
                projector(tower(pixel_values, grid_thws))
                times.append(time.perf_counter() - t0)
        best = min(times)
        rows.append({"image": f"{side}x{side}", "patches": L, "grid": [t, h, w], "seconds": best,
                     "patches_per_s": L / best, "gflop": flops / 1e9, "gflops_per_s": flops / best / 1e9,
                     "share_of_matmul_rate": flops / best / 1e9 / rate_gflops, "repeats": repeats})  # fmt: skip
        print(
            f"tower {side}^2: {L} patches in {best:.2f} s = {L / best:.0f} patches/s, "
            f"{flops / best / 1e9:.1f} GFLOP/s ({flops / best / 1e9 / rate_gflops:.0%} of matmul)",
            flush=True,
        )
    return rows


def run_main(args, common) -> dict:
    last, seconds, trainer = train(os.path.join(args.run, "scratch"), print, steps=args.main_steps,
                                   eval_every=max(1, args.main_steps // args.main_evals), **common)  # fmt: skip
    base = chance(trainer.data.heldout())
    per_kind = {k: {"exact": last[f"vision_exact_{k}"], "cer": last[f"vision_cer_{k}"],
                    "exact_blank": last[f"vision_exact_blank_{k}"], "cer_blank": last[f"vision_cer_blank_{k}"],
                    "chance": base[k]} for k in sorted(base)}  # fmt: skip
    curve = [{k: v for k, v in r.items() if k in ("step", "elapsed_s", "val_loss") or k.startswith("vision_")}
             for r in read_metrics(trainer.run_dir) if "vision_exact" in r]  # fmt: skip
    return {
        "steps": args.main_steps,
        "seconds": seconds,
        "per_kind": per_kind,
        "exact": last["vision_exact"],
        "exact_blank": last["vision_exact_blank"],
        "config": json.loads(trainer.cfg.to_json()),
        "curve": curve,
    }


def run_stability(args, common) -> tuple[list[dict], dict]:
    runs, curves = [], {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name, contrastive in (("scratch", 0), ("contrastive", args.contrastive_steps)):
            run = os.path.join(args.run, f"stability-{name}-seed{seed}")
            print(f"stability run {name}, seed {seed}", flush=True)
            last, seconds, _ = train(run, print, steps=args.stability_steps, seed=seed, contrastive_steps=contrastive,
                                     contrastive_lr=args.contrastive_lr, eval_every=args.stability_steps,
                                     **{**common, "vision_kinds": args.stability_kinds})  # fmt: skip
            rows = read_metrics(run)
            curves[f"{name} seed {seed}"] = rows
            entry = {"init": name, "seed": seed, "seconds": seconds, "steps": args.stability_steps,
                     "kinds": args.stability_kinds, "contrastive_lr": args.contrastive_lr,
                     "contrastive_steps": contrastive, "tower": grad_stats([r["grad_norm_tower"] for r in rows]),
                     "model": grad_stats([r["grad_norm"] for r in rows]), "exact": last["vision_exact"],
                     "exact_blank": last["vision_exact_blank"],
                     "per_kind": {k[len("vision_exact_") :]: v for k, v in last.items()
                                  if k.startswith("vision_exact_") and "blank" not in k}}  # fmt: skip
            if contrastive:
                with open(os.path.join(run, "contrastive.jsonl")) as f:
                    pre = [json.loads(line) for line in f]
                entry["contrastive_final"] = {k: pre[-1][k] for k in ("loss", "retrieval_acc", "elapsed_s")}
            runs.append(entry)
    return runs, curves


def render(result: dict) -> tuple[list[dict], str]:
    """(targets, markdown) from the result's parts."""
    targets, md = [], []
    main, info = result.get("from_scratch"), result["machine"]
    if main:
        c, text = main["config"], main["per_kind"].get("text")
        if text:
            targets.append({
                "target": "tiny-vl from scratch: held-out exact match >= 80% on rendered text within 15 min, blank "
                          "image near chance",
                "measured": f"{100 * text['exact']:.1f}% (CER {text['cer']:.3f}) in {main['seconds'] / 60:.1f} min; "
                            f"blank image {100 * text['exact_blank']:.1f}% (chance {100 * text['chance']:.1f}%)",
                "met": text["exact"] >= 0.8 and main["seconds"] <= TARGET_MINUTES * 60
                       and text["exact_blank"] <= text["chance"] + 0.05})  # fmt: skip
        md += ["## From scratch", "",
               (f"`k3 train --preset tiny-vl --steps {main['steps']} --batch-size {c['batch_size']} --lr {c['lr']:g} "
               + (f"--vision-lr {c['vision_lr']:g} " if c.get("vision_lr") else "") +
               f"--vision-kinds {c['vision_kinds']} --vision-eval-examples {c['vision_eval_examples']}`: "
               f"{main['seconds']:.0f} s ({main['seconds'] / main['steps']:.2f} s/step, evaluations included)."), "",
               "| kind | exact match | CER | blank image: exact | blank: CER | chance (best constant answer) |",
               "|---|---|---|---|---|---|",
               *[f"| {k} | {100 * v['exact']:.1f}% | {v['cer']:.3f} | {100 * v['exact_blank']:.1f}% | "
                 f"{v['cer_blank']:.3f} | {100 * v['chance']:.1f}% |" for k, v in main["per_kind"].items()], "",
               "Held-out exact match during the run (greedy):", "",
               "| step | elapsed | " + " | ".join(main["per_kind"]) + " | val loss |",
               "|---|---|" + "---|" * len(main["per_kind"]) + "---|",
               *[f"| {r['step']} | {r.get('elapsed_s', float('nan')):.0f} s | "
                 + " | ".join(f"{100 * r.get('vision_exact_' + k, float('nan')):.1f}%" for k in main["per_kind"])
                 + f" | {r['val_loss']:.3f} |" for r in main["curve"]], ""]  # fmt: skip
    runs = result.get("stability")
    if runs:
        a = runs[0]
        settings = result["args"]["stability"]  # this part's command line (main() stores it)
        figure = os.path.basename(settings["out"]) + "-grad_norm.png"
        targets.append({"target": "contrastive-init vs from-scratch table, same data/steps/seeds, >= 2 seeds each",
                        "measured": f"{len(runs)} runs of {a['steps']} joint steps (table below)",
                        "met": len({r["seed"] for r in runs}) >= 2})  # fmt: skip
        md += ["## Stability: contrastive tower init vs from scratch", "",
               (f"{a['steps']} joint steps per run on the kinds {a['kinds']}, lr {settings['lr']:g}"
               + (f" (tower and projector {settings['vision_lr']:g})" if settings.get("vision_lr") else "")
               + f"; the contrastive runs first pre-train the "
               f"tower for {max(r['contrastive_steps'] for r in runs)} InfoNCE steps (lr {a['contrastive_lr']:g}) on "
               "the same stream. Spikes: steps whose "
               f"gradient norm exceeds 3x the median of the {SPIKE_WINDOW} steps before. Norms are before clipping. "
               f"Figure: `{figure}` (`k3 plot RUN_A RUN_B ...` draws the same)."), "",
               ("| init | seed | tower norm: mean | p99 | spikes | model norm: mean | p99 | spikes | final exact | "
                "blank | InfoNCE end (loss, retrieval) |"),
               "|---|---|---|---|---|---|---|---|---|---|---|",
               *[f"| {r['init']} | {r['seed']} | {r['tower']['mean']:.3f} | {r['tower']['p99']:.3f} | "
                 f"{r['tower']['spikes']} | {r['model']['mean']:.3f} | {r['model']['p99']:.3f} | {r['model']['spikes']} "
                 f"| {100 * r['exact']:.1f}% ({', '.join(f'{k} {100 * v:.0f}%' for k, v in r['per_kind'].items())}) "
                 f"| {100 * r['exact_blank']:.1f}% | "
                 + (f"{r['contrastive_final']['loss']:.3f}, {100 * r['contrastive_final']['retrieval_acc']:.0f}%"
                    if "contrastive_final" in r else "-") + " |" for r in runs], ""]  # fmt: skip
    rows = result.get("tower")
    if rows:
        targets.append({"target": "tower forward throughput at 224^2 and 1024^2 vs matmul FLOPs and rate",
                        "measured": "; ".join(f"{r['image']}: {r['patches_per_s']:.0f} patches/s, "
                                              f"{100 * r['share_of_matmul_rate']:.0f}% of matmul" for r in rows),
                        "met": True})  # fmt: skip
        md += ["## Release tower forward throughput (fp32, random weights)", "",
               f"Machine matmul rate (fp32, 2048² GEMM, best of 3 s): {result['tower_matmul_gflops']:.1f} GFLOP/s.", "",
               "| image | patches (t, h, w) | best of 2 | patches/s | matmul GFLOP | GFLOP/s | share of matmul rate |",
               "|---|---|---|---|---|---|---|",
               *[f"| {r['image']} | {r['patches']} {tuple(r['grid'])} | {r['seconds']:.2f} s | "
                 f"{r['patches_per_s']:.0f} | {r['gflop']:.1f} | {r['gflops_per_s']:.1f} | "
                 f"{100 * r['share_of_matmul_rate']:.0f}% |" for r in rows], ""]  # fmt: skip
    head = ["# Vision on CPU (`python benchmarks/vision.py`)", "",
            (f"Machine: {info['cpu']}, {info['threads']} threads, torch {info['torch']}; load before the last part: "
             f"{info['load_before']}."), "", *targets_table(targets, "vision"), ""]  # fmt: skip
    return targets, "\n".join(head + md)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--parts",
        default="main,stability,tower",
        help="which parts to run; the others are kept from an "
        "earlier report at --out (so the parts may run at different times)",
    )
    p.add_argument("--main-steps", type=int, default=740, help="steps of the from-scratch run")
    p.add_argument("--main-evals", type=int, default=3, help="evaluations during it (each ~20 s of the 15 minutes)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vision-lr", type=float, default=None, help="k3 train --vision-lr (default: --lr)")
    p.add_argument("--kinds", default="text", help="k3 train --vision-kinds")
    p.add_argument("--eval-examples", type=int, default=300)
    p.add_argument("--stability-steps", type=int, default=300, help="joint steps per stability run")
    p.add_argument("--contrastive-steps", type=int, default=300)
    p.add_argument("--contrastive-lr", type=float, default=1e-3)
    p.add_argument(
        "--stability-kinds",
        default="text,count,colour",
        help="task kinds of the stability runs (text "
        "alone: the contrastive stage stays near chance in 300 steps, so it would compare nothing)",
    )
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--run", default="runs/bench-vision", help="run folders go under it (replaced)")
    p.add_argument("--out", default=None, help=out_help("vision-cpu"))
    args = p.parse_args(argv)
    args.out = args.out or scratch_out("vision-cpu")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    parts = set(args.parts.split(","))
    result: dict = {}
    if parts != {"main", "stability", "tower"} and os.path.exists(args.out + ".json"):
        with open(args.out + ".json") as f:
            result = json.load(f)
    result["machine"] = machine_info()
    result.setdefault("args", {}).update({part: vars(args) for part in parts})
    common = {"batch_size": args.batch_size, "lr": args.lr, "vision_lr": args.vision_lr, "vision_kinds": args.kinds,
              "vision_eval_examples": args.eval_examples}  # fmt: skip
    if "main" in parts:
        result["from_scratch"] = run_main(args, common)
    if "stability" in parts:
        result["stability"], curves = run_stability(args, common)
        import matplotlib

        matplotlib.use("Agg")
        figure = args.out + "-grad_norm.png"
        os.makedirs(os.path.dirname(os.path.abspath(figure)), exist_ok=True)
        grad_norm_figure(curves).savefig(figure, dpi=110, bbox_inches="tight")
    if "tower" in parts:
        rate = measure_matmul(quick=False, dtypes=(torch.float32,))["fp32"]
        result["tower_matmul_gflops"] = rate
        result["tower"] = tower_throughput(rate, repeats=2)
    result["targets"], markdown = render(result)
    write_report(result, args.out, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Why tiny-vl does not learn to read in 15 minutes: the tower alone against a small CNN on the simplest
reading task there is, one capital letter per image, side by side on the same images, steps and optimiser.

    python experiments/vision_glyph.py [--steps 400] [--models ...] [--colours random,bw] [--placement free]
        [--out benchmarks/results/vision-glyph]

Data: a 56x56 image (4x4 patches of 14 px, 2x2 LM tokens) holding one of 24 capital letters (no I, O) in DejaVu
Sans at 20-26 px, at a random position, in a random colour on a random background (luma contrast >= 100), or black
on white (`bw`). With `--placement aligned` the letter starts at one of six patch corners (x = 4 + 14i, y = 14j),
so its offset inside a 14-px patch is always the same; everything else is drawn as for `free`. Example i of a split
is drawn from its own seeded generator; 256 held-out images. A model is the image encoder plus a linear head over
the mean of its output rows, trained with AdamW (weight decay 0.01, `--lr`), batch 32, gradient clip 1, and fresh
images every step. Models:

- `tower`: the tiny-vl MoonViT-V2 and projector (`K3Config.preset("tiny-vl")`, from-scratch init), as
  `k3 train --preset tiny-vl` builds them; `tower-p7` the same with 7-px patches (4x the patches, the processor's
  padding unit 14 px); `tower-nopos` with the position table zeroed;
- `vit`: a textbook pre-norm ViT of the same width, depth, heads and patch (PyTorch's `nn.TransformerEncoder`), the
  control that separates a fault of our tower from what any ViT does on this data;
- `cnn`: three 3x3 conv layers (32, 64, 128 channels, ReLU, 2x2 max pools) and a global max pool, on the same
  normalised pixels the tower gets.

The table gives held-out accuracy every 50 steps (chance 1/24 = 4.2%) and how much of the pooled features
varies between images at the start and the end (`image_share`).
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch
import torch.nn.functional as F
from bench import report  # benchmarks/report.py, loaded by path (experiments/bench.py)
from PIL import Image, ImageDraw
from torch import nn

from openk3.config import K3Config
from openk3.data import vision_tasks as vt
from openk3.data.vision import preprocess
from openk3.model.vision import MoonViT3d, PatchMergerMLPV2, VisionConfig, init_vision_weights

LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"
SIDE = 56
HELDOUT = 256


def glyph(index: int, split: str, bw: bool, aligned: bool = False) -> tuple[Image.Image, int]:
    """(image, letter index) of example `index` of `split` (module docstring)."""
    rng = random.Random(f"vision_glyph:{split}:{index}")
    label, size = rng.randrange(len(LETTERS)), rng.randint(20, 26)
    bg = (255, 255, 255) if bw else tuple(rng.randint(0, 255) for _ in range(3))
    fg = (0, 0, 0)
    while not bw:
        fg = tuple(rng.randint(0, 255) for _ in range(3))
        if abs(vt._luma(fg) - vt._luma(bg)) >= 100:
            break
    image = Image.new("RGB", (SIDE, SIDE), bg)
    xy = (rng.randint(4, 30), rng.randint(0, 26))
    if aligned:  # the same offset within a 14-px patch every time; only the patch the letter starts in varies
        xy = (4 + 14 * rng.randint(0, 2), 14 * rng.randint(0, 1))
    ImageDraw.Draw(image).text(xy, LETTERS[label], font=vt._font("DejaVuSans.ttf", size), fill=fg)
    return image, label


class TowerClassifier(nn.Module):
    def __init__(self, patch: int, pos_scale: float, seed: int):
        super().__init__()
        config = K3Config.preset("tiny-vl").vision_config
        self.proc = {"patch_size": patch}
        vc = VisionConfig.from_dict({**config, "patch_size": patch})
        self.tower, self.projector = MoonViT3d(vc), PatchMergerMLPV2(vc)
        init_vision_weights(self.tower, self.projector, torch.Generator().manual_seed(seed))
        self.tower.patch_embed.pos_emb.weight.data.mul_(pos_scale)
        self.head = nn.Linear(vc.text_hidden_size, len(LETTERS))

    def features(self, images: list[Image.Image]) -> torch.Tensor:
        pixels, grids = preprocess(images, self.proc)
        return torch.stack([r.mean(0) for r in self.projector(self.tower(pixels, grids))])

    def forward(self, images: list[Image.Image]) -> torch.Tensor:
        return self.head(self.features(images))


class ViTClassifier(nn.Module):
    """A textbook pre-norm ViT of the tower's size (PyTorch's own `nn.TransformerEncoder`: LayerNorm, learned
    absolute positions at N(0, 0.02), 14-px patches, exact GELU), mean-pooled: the control that tells a fault of
    our tower from a property of ViTs on this task."""

    def __init__(self):
        super().__init__()
        vc = VisionConfig.from_dict(K3Config.preset("tiny-vl").vision_config)
        D, grid = vc.hidden_size, SIDE // 14
        self.proj = nn.Conv2d(3, D, 14, stride=14)
        self.pos = nn.Parameter(torch.randn(grid * grid, D) * 0.02)
        layer = nn.TransformerEncoderLayer(D, vc.num_heads, vc.intermediate_size, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)  # fmt: skip
        self.encoder = nn.TransformerEncoder(layer, vc.num_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, len(LETTERS))

    def features(self, images: list[Image.Image]) -> torch.Tensor:
        x_BLD = self.proj(_images_B3HW(images)).flatten(2).transpose(1, 2) + self.pos
        return self.norm(self.encoder(x_BLD)).mean(1)

    def forward(self, images: list[Image.Image]) -> torch.Tensor:
        return self.head(self.features(images))


def _images_B3HW(images: list[Image.Image]) -> torch.Tensor:
    """The tower's normalised pixels ([B * 16, 3, 14, 14] patches for 56x56 images) put back as [B, 3, 56, 56]."""
    pixels, _ = preprocess(images)
    n, g = len(images), SIDE // 14
    return pixels.view(n, g, g, 3, 14, 14).permute(0, 3, 1, 4, 2, 5).reshape(n, 3, SIDE, SIDE)


class CNNClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveMaxPool2d(1), nn.Flatten(),
        )  # fmt: skip
        self.head = nn.Linear(128, len(LETTERS))

    def features(self, images: list[Image.Image]) -> torch.Tensor:
        return self.net(_images_B3HW(images))

    def forward(self, images: list[Image.Image]) -> torch.Tensor:
        return self.head(self.features(images))


def build(name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if name == "cnn":
        return CNNClassifier()
    if name == "vit":
        return ViTClassifier()
    return {"tower": lambda: TowerClassifier(14, 1.0, seed), "tower-p7": lambda: TowerClassifier(7, 1.0, seed),
            "tower-nopos": lambda: TowerClassifier(14, 0.0, seed)}[name]()  # fmt: skip


def image_share(features_BD: torch.Tensor) -> float:
    """How much of the pooled features varies between images: sum of per-dimension variances over the images /
    sum of mean squares. Near 0: the encoder gives every image the same vector, and the head can only learn the
    letters' prior."""
    return float(features_BD.var(0, unbiased=False).sum() / features_BD.pow(2).mean(0).sum())


def train(name: str, args, bw: bool, aligned: bool) -> dict:
    model = build(name, args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    held = [glyph(i, "heldout", bw, aligned) for i in range(HELDOUT)]
    held_labels = torch.tensor([y for _, y in held])
    with torch.no_grad():
        shares = [(0, image_share(model.features([x for x, _ in held])))]
    curve, t0 = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = [glyph((step - 1) * args.batch + i, "train", bw, aligned) for i in range(args.batch)]
        loss = F.cross_entropy(model([x for x, _ in batch]), torch.tensor([y for _, y in batch]))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0:
            with torch.no_grad():
                features = model.features([x for x, _ in held])
                acc = (model.head(features).argmax(-1) == held_labels).float().mean().item()
            curve.append((step, acc, loss.item()))
            shares.append((step, image_share(features)))
            tag = f"{name}{' bw' if bw else ''}{' aligned' if aligned else ''}"
            print(f"{tag}: step {step}, loss {loss.item():.3f}, held-out {acc:.1%}", flush=True)
    return {"model": name, "bw": bw, "aligned": aligned, "curve": curve, "image_share": shares,
            "seconds": time.perf_counter() - t0, "parameters": sum(p.numel() for p in model.parameters())}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--models", default="tower,tower-p7,tower-nopos,cnn", help="of tower, tower-p7, tower-nopos, vit, cnn"
    )
    p.add_argument("--colours", default="random,bw", help="random and/or bw (black on white)")
    p.add_argument("--placement", default="free", help="free and/or aligned (the letter's offset in its patch fixed)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out",
        default="runs/experiments/vision-glyph",
        help="JSON path or the path without .json, the .md beside it (default under runs/, not committed; "
        "--out benchmarks/results/vision-glyph replaces the committed result)",
    )
    args = p.parse_args(argv)
    machine = report.machine_info()
    runs = [train(m, args, colours == "bw", placement == "aligned") for placement in args.placement.split(",")
            for colours in args.colours.split(",") for m in args.models.split(",")]  # fmt: skip
    steps = [s for s, _, _ in runs[0]["curve"]]
    lines = ["# One letter per image: the tiny-vl tower vs a small CNN (`python experiments/vision_glyph.py`)", "",
             (f"Machine: {machine['cpu']}, {machine['threads']} threads, torch {machine['torch']}. {args.steps} "
              f"steps of {args.batch} fresh images, AdamW lr {args.lr}, seed {args.seed}; held-out accuracy on "
              f"{HELDOUT} images (chance 4.2%)."), "",
             "Run: `python experiments/vision_glyph.py " + " ".join(argv if argv is not None else sys.argv[1:]) + "`",
             "", "| model | colours | placement | parameters | " + " | ".join(f"step {s}" for s in steps)
             + " | image share: start -> end | time |", "|---|---|---|---|" + "---|" * (len(steps) + 2)]  # fmt: skip
    for r in runs:
        cells = " | ".join(f"{acc:.1%}" for _, acc, _ in r["curve"])
        colours = "black on white" if r["bw"] else "random"
        share = f"{r['image_share'][0][1]:.3f} -> {r['image_share'][-1][1]:.3f}"
        placement = "aligned" if r["aligned"] else "free"
        lines.append(f"| {r['model']} | {colours} | {placement} | {r['parameters']:,} | {cells} | {share} | "
                     f"{r['seconds']:.0f} s |")  # fmt: skip
    lines += ["", ("Image share: the part of the pooled features (the head's input) that varies between the "
                   "held-out images (`image_share`); near 0 the encoder maps every image to the same vector.")]  # fmt: skip
    report.write_report({"machine": machine, "args": vars(args), "runs": runs}, args.out, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

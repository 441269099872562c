"""Contrastive (CLIP-style InfoNCE) pre-training of the vision tower: the initialisation the K3 report compared its
from-scratch tower against. `k3 train --preset tiny-vl --contrastive-steps N` runs it before joint training; joint
training then starts from the pre-trained tower (the projector and text model keep their from-scratch init, so the two
runs differ only in the tower's starting point).

The pair of a batch is (image, caption) from the same training stream as joint training (`vision_tasks.caption`:
the text read off the image, or the scene's shapes). Image side: the tower's output patches, mean-pooled per
image, through a linear head. Text side: a small caption encoder of its own (token embeddings with positions, one
transformer layer, mean-pooled), trained with the tower and discarded after, as CLIP's text tower would be for a
ViT that goes on to a VLM. Loss: the symmetric cross-entropy over the batch's image-caption similarity matrix
with a learnable temperature (CLIP: init 1/0.07, clamped at 100).

Per step it logs loss, in-batch retrieval accuracy (image -> caption) and the tower's gradient norm to
`contrastive.jsonl` in the run folder. The stage is not checkpointed: a run stopped during it starts it again.

Legend: B pairs, N caption tokens, E embedding width.
"""

from __future__ import annotations

import json
import math
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from openk3.data import vision_tasks as vt
from openk3.train.metrics import tower_grad_norm

EMBED_DIM = 128
MAX_CAPTION_TOKENS = 32


class CaptionEncoder(nn.Module):
    """Caption ids [B, N] (right-padded with `pad_id`) -> [B, E] L2-normalised embeddings."""

    def __init__(self, vocab_size: int, pad_id: int, width: int = EMBED_DIM, heads: int = 4):
        super().__init__()
        self.pad_id = pad_id
        self.embed = nn.Embedding(vocab_size, width)
        self.pos = nn.Parameter(torch.zeros(MAX_CAPTION_TOKENS, width))
        self.layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True,
                                                norm_first=True)  # fmt: skip
        self.out = nn.Linear(width, EMBED_DIM)

    def forward(self, ids_BN: torch.Tensor) -> torch.Tensor:
        keep_BN = ids_BN != self.pad_id
        x = self.embed(ids_BN) + self.pos[: ids_BN.shape[1]]
        x = self.layer(x, src_key_padding_mask=~keep_BN)
        pooled = (x * keep_BN[..., None]).sum(1) / keep_BN.sum(1, keepdim=True).clamp(min=1)
        return F.normalize(self.out(pooled), dim=-1)


class ImageHead(nn.Module):
    """The tower's merged outputs (list of [N_i, 4, D]) -> [B, E]: mean over each image's patches, then linear."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, EMBED_DIM)

    def forward(self, merged: list[torch.Tensor]) -> torch.Tensor:
        pooled = torch.stack([m.flatten(0, 1).mean(0) for m in merged])
        return F.normalize(self.proj(pooled), dim=-1)


def _soft_targets(keys: list[str]) -> torch.Tensor:
    """[B, B] rows summing to 1 over the columns whose caption equals the row's."""
    same = torch.tensor([[a == b for b in keys] for a in keys], dtype=torch.float32)
    return same / same.sum(1, keepdim=True)


def clip_loss(image_BE: torch.Tensor, text_BE: torch.Tensor, logit_scale: torch.Tensor,
              keys: list[str]) -> tuple[torch.Tensor, float]:  # fmt: skip
    """(symmetric InfoNCE with equal captions as shared positives, image -> caption in-batch accuracy)."""
    logits = logit_scale.exp().clamp(max=100.0) * image_BE @ text_BE.T
    targets = _soft_targets(keys).to(logits.device)
    loss = 0.5 * (F.cross_entropy(logits, targets) + F.cross_entropy(logits.T, targets))
    hit = targets.gather(1, logits.argmax(1, keepdim=True)) > 0
    return loss, float(hit.float().mean())


def pretrain_tower(model, data, cfg, device="cpu", log=print) -> list[dict]:
    """`cfg.contrastive_steps` InfoNCE steps on `model.vision_tower` (updated in place) with AdamW at
    cfg.contrastive_lr (warmup over the first 5%, then constant), batches of cfg.batch_size from the run's training
    stream (examples 0.., the same ones joint training then sees). Returns the per-step rows written to
    contrastive.jsonl."""
    steps, rows = cfg.contrastive_steps, []
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    tok, pad = data.tokenizer, data.text.pad_token_id
    with torch.random.fork_rng():  # module constructors draw from the global RNG; joint training must not see it
        text_enc = CaptionEncoder(data.text.vocab_size, pad).to(device)
        head = ImageHead(model.vision.hidden_size).to(device)
    with torch.no_grad():  # a seeded init of the two throw-away encoders (torch's default init draws globally)
        for p in [*text_enc.parameters(), *head.parameters()]:
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * math.sqrt(1.0 / p.shape[-1]))
    logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07), device=device))
    params = [*model.vision_tower.parameters(), *text_enc.parameters(), *head.parameters(), logit_scale]
    opt = torch.optim.AdamW(params, lr=cfg.contrastive_lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
    warmup = max(1, int(0.05 * steps))
    path = os.path.join(cfg.out, "contrastive.jsonl")
    start = time.perf_counter()
    log(f"contrastive pre-training of the tower: {steps} steps of {cfg.batch_size} image-caption pairs")
    with open(path, "w", encoding="utf-8") as f:
        for step in range(steps):
            for g in opt.param_groups:
                g["lr"] = cfg.contrastive_lr * min(1.0, (step + 1) / warmup)
            examples = data.train_examples(step * cfg.batch_size, cfg.batch_size)
            captions = [vt.caption(ex) for ex in examples]
            ids_BN = pad_sequence([torch.tensor(tok.encode(c)[:MAX_CAPTION_TOKENS]) for c in captions],
                                  batch_first=True, padding_value=pad)  # fmt: skip
            pixel_values, grid_thws, _ = data.encoder.images(examples)
            merged = model.vision_tower(pixel_values.to(device), grid_thws)
            loss, acc = clip_loss(head(merged), text_enc(ids_BN.to(device)), logit_scale, captions)
            loss.backward()
            tower_norm = float(tower_grad_norm(model))
            norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
            opt.step()
            opt.zero_grad(set_to_none=True)
            row = {"step": step + 1, "loss": float(loss.detach()), "retrieval_acc": acc, "grad_norm_tower": tower_norm,
                   "grad_norm": norm, "temperature": float(1 / logit_scale.detach().exp()),
                   "elapsed_s": time.perf_counter() - start}  # fmt: skip
            f.write(json.dumps(row) + "\n")
            rows.append(row)
            if (step + 1) % max(1, steps // 10) == 0 or step + 1 == steps:
                log(f"contrastive step {step + 1}/{steps}: loss {row['loss']:.3f}, in-batch retrieval "
                    f"{acc:.0%}, {row['elapsed_s']:.0f} s")  # fmt: skip
    for p in model.vision_tower.parameters():
        p.grad = None
    return rows

"""Evaluation of a vision run: greedy answers to held-out image questions, scored by exact match and character error
rate (`vision_tasks.exact_match`, `character_error_rate`), overall and per task kind, beside the same model fed a blank
image of the same size (it can only guess from the prompt).

    val_loss            teacher-forced answer cross-entropy on the held-out examples
    vision_exact        exact-match accuracy of greedy answers (all kinds); vision_exact_<kind> per kind
    vision_cer          mean character error rate; vision_cer_<kind> per kind
    vision_exact_blank  the same with blank images (vision_cer_blank, vision_exact_blank_<kind>); the final
                        evaluation only, unless asked for

Greedy decoding recomputes the right-padded sequences each step (answers are a few tokens; no cache to keep in
step with the image rows) and stops an example at its end-of-message token.
"""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence

from openk3.data import vision_tasks as vt
from openk3.train.losses import lm_loss_sum

EVAL_BATCH = 64  # examples per forward
MAX_ANSWER_TOKENS = 16


@torch.no_grad()
def greedy_answers(model, encoder, examples: list[vt.VisionExample], max_new_tokens: int = MAX_ANSWER_TOKENS,
                   device="cpu") -> list[str]:  # fmt: skip
    """The model's greedy answer (decoded text, stripped) to each example's image and prompt."""
    out: list[str] = []
    for start in range(0, len(examples), EVAL_BATCH):
        chunk = examples[start : start + EVAL_BATCH]
        pixel_values, grid_thws, rows = encoder.images(chunk)
        seqs = [encoder.prompt_ids(ex, n) for ex, n in zip(chunk, rows)]
        generated: list[list[int]] = [[] for _ in chunk]
        done = [False] * len(chunk)
        for _ in range(max_new_tokens):
            full = [s + g for s, g in zip(seqs, generated)]
            ids = pad_sequence([torch.tensor(s) for s in full], batch_first=True, padding_value=encoder.pad)
            # Right-padded (causal: the padding changes nothing before it; faster than packed, vision_data.py).
            logits = model(ids.to(device), pixel_values=pixel_values.to(device), grid_thws=grid_thws).logits
            last = torch.tensor([len(s) - 1 for s in full], device=logits.device)
            next_ids = logits[torch.arange(len(full), device=logits.device), last].argmax(-1).tolist()
            for b, token in enumerate(next_ids):
                if done[b]:
                    continue
                if token == encoder.eos:
                    done[b] = True
                else:
                    generated[b].append(token)
            if all(done):
                break
        out += [encoder.tokenizer.decode(g).strip() for g in generated]
    return out


def _blank(examples: list[vt.VisionExample]) -> list[vt.VisionExample]:
    return [vt.VisionExample(vt.blank_like(ex.image), ex.prompt, ex.answer, ex.kind) for ex in examples]


def score(examples: list[vt.VisionExample], predictions: list[str], suffix: str = "") -> dict:
    """vision_exact{suffix}, vision_cer{suffix} and their per-kind versions."""
    rows: dict[str, list[tuple[bool, float]]] = {}
    for ex, pred in zip(examples, predictions):
        rows.setdefault(ex.kind, []).append((vt.exact_match(pred, ex.answer), vt.character_error_rate(pred, ex.answer)))
    every = [r for kind_rows in rows.values() for r in kind_rows]
    out = {f"vision_exact{suffix}": sum(e for e, _ in every) / len(every),
           f"vision_cer{suffix}": sum(c for _, c in every) / len(every)}  # fmt: skip
    for kind, kind_rows in sorted(rows.items()):
        out[f"vision_exact{suffix}_{kind}"] = sum(e for e, _ in kind_rows) / len(kind_rows)
        out[f"vision_cer{suffix}_{kind}"] = sum(c for _, c in kind_rows) / len(kind_rows)
    return out


@torch.no_grad()
def evaluate_vision(model, data, device="cpu", blank: bool = False) -> dict:
    """The module docstring's metrics on `data.heldout()`."""
    examples = data.heldout()
    total, count = 0.0, 0
    for batch in data.val_batches(EVAL_BATCH, None, (len(examples) + EVAL_BATCH - 1) // EVAL_BATCH):
        ids, labels = batch.padded(data.encoder.pad)
        logits = model(ids.to(device), pixel_values=batch.pixel_values.to(device), grid_thws=batch.grid_thws).logits
        total += float(lm_loss_sum(logits.flatten(0, 1), labels.to(device).flatten()))
        count += batch.num_loss_tokens()
    out = {"val_loss": total / max(count, 1)}
    out.update(score(examples, greedy_answers(model, data.encoder, examples, device=device)))
    if blank:
        blanks = _blank(examples)
        out.update(score(blanks, greedy_answers(model, data.encoder, blanks, device=device), suffix="_blank"))
    return out

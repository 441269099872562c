"""Evaluation during training: validation loss, long-context recall, and the unigram baseline beside them.

    val_loss     mean cross-entropy over fixed validation batches at the final training length
    mqar_acc     multi-query associative recall accuracy at the training length (answer tokens only)
    mqar_acc_4x  the same at 4x the training length (4x the pairs and queries)
    needle_acc   needle retrieval accuracy at 4x the training length, depths 0.1 / 0.5 / 0.9: K3's claim that
                 NoPE MLA + KDA extrapolate beyond the trained length
The per-layer expert loads and MaxVio come from the balancer's step metrics (the trainer adds them).
"""

from __future__ import annotations

import torch

from openk3.data.synthetic import answer_accuracy
from openk3.model.batch import ForwardBatch
from openk3.train.data import mqar_batch, needle_batch
from openk3.train.losses import lm_loss_sum

EVAL_ROWS = 8


def _logits(model, batch, device) -> torch.Tensor:
    fb = ForwardBatch.from_rows(batch.input_ids.to(device), batch.doc_lens)
    return model.forward_batch(fb).view(*batch.input_ids.shape, -1)


@torch.no_grad()
def evaluate(model, data, cfg, device) -> dict:
    text = model.text_config
    L = cfg.seq_len
    # Summed on the device in fp64 (each batch's fp32 sum exactly, in order): one host sync, not one per batch.
    total, count = torch.zeros((), dtype=torch.float64, device=device), 0
    for batch in data.val_batches(EVAL_ROWS, L, cfg.eval_batches):
        logits = _logits(model, batch, device)
        total += lm_loss_sum(logits.view(-1, logits.shape[-1]), batch.labels.to(device).view(-1)).double()
        count += batch.num_loss_tokens()
    out = {"val_loss": float(total) / max(count, 1)}
    if data.unigram_loss is not None:
        out["unigram_loss"] = data.unigram_loss
    if L >= 32:  # MQAR needs room for a few pairs and queries
        mq = mqar_batch(EVAL_ROWS, L, text, seed=12345)
        out["mqar_acc"] = answer_accuracy(_logits(model, mq, device).cpu(), mq)
        # 4x the length with 4x the pairs and queries: recall beyond the trained length (NoPE MLA + KDA).
        mq4 = mqar_batch(EVAL_ROWS // 4, 4 * L, text, seed=12346)
        out["mqar_acc_4x"] = answer_accuracy(_logits(model, mq4, device).cpu(), mq4)
    accs = []
    for i, depth in enumerate((0.1, 0.5, 0.9)):  # 8 needles per depth: 48 answer tokens in all
        nb = needle_batch(EVAL_ROWS, 4 * L, text, seed=777 + i, depth=depth)
        accs.append(answer_accuracy(_logits(model, nb, device).cpu(), nb))
    out["needle_acc"] = sum(accs) / len(accs)
    return out

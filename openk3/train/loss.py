"""The language-model loss on packed tokens: summed cross-entropy over labelled positions (labels -100 carry no
loss: document boundaries, padding, prompt positions of synthetic tasks), so micro-batches of a step add up to the
mean over the step's labelled tokens whatever their split.

Legend: T packed tokens, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.data.packing import IGNORE_INDEX


def lm_loss_sum(logits_TV: torch.Tensor, labels_T: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropy (fp32) over positions whose label is not -100."""
    return F.cross_entropy(logits_TV.float(), labels_T, ignore_index=IGNORE_INDEX, reduction="sum")

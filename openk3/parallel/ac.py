"""Activation checkpointing, applied from outside the model: each decoder layer's mixer (KDA or MLA) and FFN
(dense or MoE) recompute their activations in backward instead of storing them.

Only the mixer and FFN are wrapped, not whole layers: the AttnRes bank (a Python list of earlier blocks) is an
argument of the layer, which a recomputation would have to capture too. The forwards are replaced per instance, so parameter names and the
checkpoint layout do not change. Forward code that observes the MoE router (quantile balancing) runs again during
recomputation; observers must ignore calls outside the training forward (train/balance.py does).
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def _checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Wrap every decoder layer's `self_attn` and `mlp` / `block_sparse_moe`. Returns the number of wrapped modules."""
    wrapped = 0
    for layer in model.model.layers:
        for name in ("self_attn", "mlp", "block_sparse_moe"):
            module = getattr(layer, name, None)
            if module is not None and not getattr(module, "_openk3_checkpointed", False):
                module.forward = functools.partial(_checkpointed, module.forward)
                module._openk3_checkpointed = True
                wrapped += 1
    return wrapped

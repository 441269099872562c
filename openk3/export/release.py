"""The release-format export (`k3 export`'s default): the model's weights in the release dtypes (bf16, with the
tensors the release keeps in fp32) and layout, and the checkpoint's tokenizer files beside them."""

from __future__ import annotations

import os
import shutil

from openk3.utils import to_dtype

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tiktoken.model")


def copy_tokenizer(src: str, out: str) -> list[str]:
    """Copy the tokenizer files that folder `src` has into `out`; returns their names."""
    copied = [name for name in TOKENIZER_FILES if os.path.exists(os.path.join(src, name))]
    for name in copied:
        shutil.copy(os.path.join(src, name), out)
    return copied


def export_release(model, src: str, out: str, dtype: str = "bfloat16", max_shard_size: int | None = None) -> None:
    """Write `model` (loaded from checkpoint folder `src`) to `out` in the release format, in `dtype` (the release's
    fp32 tensors stay fp32), with `src`'s tokenizer. `model` is converted in place."""
    model.to_dtype(to_dtype(dtype))
    model.save_pretrained(out, max_shard_size=max_shard_size)
    copy_tokenizer(src, out)

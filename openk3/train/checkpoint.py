"""Training checkpoints you can trust: atomic, complete, and never unpickled.

Layout of a run folder:
    RUN/train_config.json                 the run's settings
    RUN/metrics.jsonl                     one JSON object per step
    RUN/checkpoints/step-00000100/        one complete checkpoint per saved step:
        config.json, model.safetensors      the model under the official K3 names, fp32 training weights
        tokenizer.json                      the run's tokenizer (when it is not byte-level)
        optimizer.safetensors               AdamW moments and step counters, flattened
        trainer_state.json                  step, data position, balancing state, RNG, counters, optimizer groups
    RUN/checkpoints/latest                the name of the newest complete checkpoint

A checkpoint is written into a hidden temporary folder and renamed into place only when complete, then `latest`
is replaced atomically; a kill at any moment leaves the previous checkpoint and pointer untouched (temporary
folders of killed saves are removed on the next save). Only safetensors and JSON are read back.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import torch
from safetensors.torch import load_file, save_file

CHECKPOINTS = "checkpoints"
LATEST = "latest"


def _flatten_optimizer(state: dict) -> tuple[dict[str, torch.Tensor], list]:
    tensors = {}
    for idx, slots in state["state"].items():
        for name, value in slots.items():
            tensors[f"{idx}.{name}"] = value if torch.is_tensor(value) else torch.tensor(value)
    return tensors, state["param_groups"]


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], groups: list) -> dict:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    return {"state": state, "param_groups": groups}


def rng_state() -> tuple[dict, dict[str, torch.Tensor]]:
    state = random.getstate()
    return {"python": [state[0], list(state[1]), state[2]]}, {"torch_cpu": torch.get_rng_state()}


def set_rng_state(json_state: dict, tensors: dict[str, torch.Tensor]) -> None:
    version, internal, gauss = json_state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(tensors["torch_cpu"])


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: str, step: int, model, optimizer, trainer_state: dict, tokenizer=None,
                    keep: int = 2) -> str:  # fmt: skip
    """Write checkpoint `step` atomically and prune older ones beyond `keep`. Returns its folder."""
    root = os.path.join(run_dir, CHECKPOINTS)
    os.makedirs(root, exist_ok=True)
    for stale in os.listdir(root):
        if stale.startswith(".tmp-"):
            shutil.rmtree(os.path.join(root, stale), ignore_errors=True)
    name = f"step-{step:08d}"
    tmp = os.path.join(root, f".tmp-{name}-{os.getpid()}")
    os.makedirs(tmp)
    model.save_pretrained(tmp)
    if tokenizer is not None and hasattr(tokenizer, "save"):
        tokenizer.save(tmp)
    opt_tensors, groups = _flatten_optimizer(optimizer.state_dict())
    rng_json, rng_tensors = rng_state()
    save_file({**{f"optim.{k}": v.contiguous() for k, v in opt_tensors.items()},
               **{f"rng.{k}": v for k, v in rng_tensors.items()}},
              os.path.join(tmp, "optimizer.safetensors"))  # fmt: skip
    with open(os.path.join(tmp, "trainer_state.json"), "w", encoding="utf-8") as f:
        json.dump({**trainer_state, "step": step, "optimizer_groups": groups, "rng": rng_json}, f, indent=1)
    return publish_checkpoint(root, tmp, name, keep)


def publish_checkpoint(root: str, tmp: str, name: str, keep: int) -> str:
    """Make the complete folder `tmp` checkpoint `name`: fsync its files, rename it into place (never over a folder
    `latest` may name), point `latest` at it atomically and prune all but the newest `keep`. Returns its folder."""
    for folder, _, files in os.walk(tmp):
        for file in files:
            with open(os.path.join(folder, file), "rb") as f:
                os.fsync(f.fileno())
    final, n = os.path.join(root, name), 1
    while os.path.exists(final):  # re-saving a step (a restarted run): never touch the folder `latest` may name
        final, n = os.path.join(root, f"{name}-r{n}"), n + 1
    os.rename(tmp, final)
    pointer = os.path.join(root, f".{LATEST}.tmp")
    with open(pointer, "w", encoding="utf-8") as f:
        f.write(os.path.basename(final) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, os.path.join(root, LATEST))
    _fsync_dir(root)
    # Keep the one just written plus the newest others; only folders `latest` no longer names are removed.
    others = [os.path.join(root, d) for d in os.listdir(root) if d.startswith("step-") and d != os.path.basename(final)]
    others.sort(key=os.path.getmtime)
    for old in others[: max(0, len(others) - (keep - 1))] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: str) -> str | None:
    pointer = os.path.join(run_dir, CHECKPOINTS, LATEST)
    if not os.path.exists(pointer):
        return None
    with open(pointer, encoding="utf-8") as f:
        path = os.path.join(run_dir, CHECKPOINTS, f.read().strip())
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{pointer} names {path}, which does not exist")
    return path


def resolve_checkpoint(path: str) -> str:
    """A checkpoint folder, or a training run folder (its latest checkpoint)."""
    if os.path.isdir(os.path.join(path, CHECKPOINTS)):
        latest = latest_checkpoint(path)
        if latest is None:
            raise FileNotFoundError(f"training run {path} has no finished checkpoint yet")
        return latest
    return path


def load_trainer_files(path: str, optimizer) -> dict:
    """Restore the optimizer and RNG from checkpoint folder `path`; return the trainer state dict."""
    with open(os.path.join(path, "trainer_state.json"), encoding="utf-8") as f:
        state = json.load(f)
    tensors = load_file(os.path.join(path, "optimizer.safetensors"))
    opt = {k.removeprefix("optim."): v for k, v in tensors.items() if k.startswith("optim.")}
    optimizer.load_state_dict(_unflatten_optimizer(opt, state["optimizer_groups"]))
    set_rng_state(state["rng"], {k.removeprefix("rng."): v for k, v in tensors.items() if k.startswith("rng.")})
    return state

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

Reading picks the newest good checkpoint (`latest_checkpoint`): the one `latest` names, unless it is missing or
damaged (a disk error, a copy cut short, a hand edit: `checkpoint_problem` says what), in which case a warning names
it and the newest complete `step-*` folder is used instead. The files are permission 0666 less the umask, as
`open` would create them (safetensors writes 0600).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from openk3.model.hf import weight_files
from openk3.utils import open_permissions, read_json

CHECKPOINTS = "checkpoints"
LATEST = "latest"
_STEP = re.compile(r"^step-(\d+)(?:-r(\d+))?$")  # step-00000100, or step-00000100-r1 for a re-saved step
_log = logging.getLogger("openk3")


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
    remove_temporaries(root)
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


def remove_temporaries(root: str) -> None:
    """Create the checkpoints folder `root` if needed and remove the temporary folders of killed saves."""
    os.makedirs(root, exist_ok=True)
    for stale in os.listdir(root):
        if stale.startswith(".tmp-"):
            shutil.rmtree(os.path.join(root, stale), ignore_errors=True)


def publish_checkpoint(root: str, tmp: str, name: str, keep: int) -> str:
    """Make the complete folder `tmp` checkpoint `name`: fsync its files, rename it into place (never over a folder
    `latest` may name), point `latest` at it atomically and prune all but the newest `keep` (damaged ones first).
    Returns its folder."""
    for folder, _, files in os.walk(tmp):
        for file in files:
            open_permissions(os.path.join(folder, file))
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
    # Keep the one just written plus the newest good others (a damaged one is no fallback, so it goes first); only
    # folders `latest` no longer names are removed.
    others = [os.path.join(root, d) for d in os.listdir(root) if d.startswith("step-") and d != os.path.basename(final)]
    others.sort(key=lambda d: (checkpoint_problem(d) is None, os.path.getmtime(d)))
    for old in others[: max(0, len(others) - (keep - 1))] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _check_safetensors(path: str, required: tuple[str, ...] = ()) -> None:
    """Open the header: safetensors checks that its offsets cover the file exactly, so a cut-short file fails."""
    with safe_open(path, "pt") as f:
        missing = [k for k in required if k not in f.keys()]
    if missing:
        raise ValueError(f"no {', '.join(missing)}")


def checkpoint_problem(path: str) -> str | None:
    """What makes checkpoint folder `path` unusable for resuming or loading, in a few words; None when every file a
    load reads is there and parses (JSON files; safetensors headers, which catch truncation). Reads no tensor data."""
    if not os.path.isdir(path):
        return "the folder does not exist"
    name, weights = "", "the model's weight files"
    try:
        name = "config.json"
        read_json(os.path.join(path, name))
        name = weights
        for file in sorted(set(weight_files(path).values())):  # the loader's own resolution (index or single file)
            name = os.path.basename(file)
            _check_safetensors(file)
        name = "trainer_state.json"
        state = read_json(os.path.join(path, name))
        if not isinstance(state.get("step"), int):
            raise ValueError("no step number")
        if os.path.isdir(os.path.join(path, "optimizer-dcp")):  # a multi-process run's optimizer
            name = "optimizer-dcp/.metadata"
            if os.path.getsize(os.path.join(path, name)) == 0:
                raise ValueError("empty file")
        else:
            if "optimizer_groups" not in state or "rng" not in state:
                raise ValueError("no optimizer_groups or rng")
            name = "optimizer.safetensors"
            _check_safetensors(os.path.join(path, name), required=("rng.torch_cpu",))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if os.path.exists(os.path.join(path, name)):
                read_json(os.path.join(path, name))
    except FileNotFoundError as err:  # the loader's own error says which weight files it looked for
        return str(err) if name == weights else f"{name} is missing"
    except (OSError, ValueError, KeyError, TypeError, AttributeError, SafetensorError) as err:
        return f"{name}: {err}"
    return None


def _newest_first(root: str) -> list[str]:
    steps = [(m, d) for d in os.listdir(root) if (m := _STEP.match(d)) and os.path.isdir(os.path.join(root, d))]
    steps.sort(key=lambda md: (int(md[0].group(1)), int(md[0].group(2) or 0)), reverse=True)
    return [d for _, d in steps]


def latest_checkpoint(run_dir: str, warn: Callable[[str], None] = _log.warning) -> str | None:
    """The newest good checkpoint of training run `run_dir`: the one `latest` names or, when that one is missing or
    damaged (`warn` is told which folder and what is wrong), the newest good `step-*` folder. None when there is none:
    the run was stopped before its first save finished (silently), or every checkpoint is damaged (warned)."""
    root = os.path.join(run_dir, CHECKPOINTS)
    if not os.path.isdir(root):
        return None
    pointer, named = os.path.join(root, LATEST), None
    candidates = _newest_first(root)
    if os.path.exists(pointer):
        try:
            with open(pointer, encoding="utf-8") as f:
                named = f.read().strip() or None
        except (OSError, UnicodeDecodeError):
            pass
        if named is None:
            warn(f"{pointer} is unreadable; looking for the newest good checkpoint")
    elif candidates:  # a kill between a checkpoint's rename and its pointer (or a deleted pointer)
        warn(f"{pointer} is missing; looking for the newest good checkpoint")
    if named is not None:
        candidates = [named] + [d for d in candidates if d != named]
    for i, name in enumerate(candidates):
        path = os.path.join(root, name)
        problem = checkpoint_problem(path)
        if problem is None:
            if i > 0 or named is None:
                warn(f"using checkpoint {path}")
            return path
        warn(f"checkpoint {path} is damaged ({problem}); skipping it")
    if candidates:
        warn(f"no good checkpoint in {root}")
    return None


def resolve_checkpoint(path: str) -> str:
    """A checkpoint folder, or a training run folder (its newest good checkpoint, see `latest_checkpoint`)."""
    if os.path.isdir(os.path.join(path, CHECKPOINTS)):
        latest = latest_checkpoint(path)
        if latest is None:
            raise FileNotFoundError(f"training run {path} has no complete checkpoint")
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

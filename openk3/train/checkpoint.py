"""Training checkpoints you can trust: one DCP checkpoint per saved step, written shard by shard, atomic, complete,
and loadable at any layout; plus the one function that loads a model from any folder a user names.

Layout of a run folder:
    RUN/train_config.json                 the run's settings
    RUN/metrics.jsonl                     one JSON object per step
    RUN/checkpoints/step-00000100/        one complete checkpoint per saved step:
        .metadata, __R_0.distcp             the DCP checkpoint (parallel/checkpoint.py): model weights (fp32, the
                                            model's own names), optimizer state, balancing state (balancer.lo/hi),
                                            torch RNG; each rank writes its own shards, nothing is gathered
        config.json                         the model's config (official schema)
        tokenizer.json                      the run's tokenizer (when it is not byte-level)
        trainer_state.json                  step, data position, counters, Python RNG, balancer settings, layout
    RUN/checkpoints/latest                the name of the newest complete checkpoint

Saved at one layout, a checkpoint resumes at any other: one process and N ranks alike (a world of 1 is a layout).
A checkpoint is written into a hidden temporary folder and renamed into place only when every rank's shards are
written, then `latest` is replaced atomically; a kill at any moment leaves the previous checkpoint and pointer
untouched (temporary folders of killed saves are removed on the next save).

Reading picks the newest good checkpoint (`latest_checkpoint`): the one `latest` names, unless it is missing or
damaged (a disk error, a copy cut short, a hand edit: `checkpoint_problem` says what), in which case a warning names
it and the newest complete `step-*` folder is used instead. The files are permission 0666 less the umask, as
`open` would create them.

`load_model(path)` is how the CLI opens `--ckpt`: a release-format folder (config.json + safetensors), a training
checkpoint (its DCP weights read in one process, no process group) or a run folder (its newest good checkpoint).
The release format itself is an offline product of a checkpoint: `k3 export --ckpt RUN --out DIR`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable

import torch

from openk3.config import K3Config
from openk3.model.model import K3ForCausalLM
from openk3.parallel.checkpoint import METADATA, load_distributed, save_distributed, storage_problem
from openk3.train.distributed import Layout
from openk3.utils import open_permissions, read_json

CHECKPOINTS = "checkpoints"
LATEST = "latest"
TRAINER_STATE = "trainer_state.json"
OPTIMIZER_CHANGES = "optimizer_changes"  # load_checkpoint's report of the settings this run changed
FIRST_SAVE_STEP = 10  # a run's early checkpoint (train/trainer.py), so one stopped in its first minutes can resume
_STEP = re.compile(r"^step-(\d+)(?:-r(\d+))?$")  # step-00000100, or step-00000100-r1 for a re-saved step
_log = logging.getLogger("openk3")


def torch_optimizers(optimizer) -> list:
    """The torch optimizers inside the trainer's optimizer: DCP's state-dict helpers take torch optimizers, and
    MuonWithAdamW (train/optim.py) is two of them over disjoint parameters."""
    inner = [getattr(optimizer, name) for name in ("muon", "adamw") if hasattr(optimizer, name)]
    return inner or [optimizer]


def _tensor_state(balancer_state: dict) -> dict:
    """The DCP-held part of a checkpoint besides model and optimizer: balancing thresholds and the torch RNG."""
    return {"balancer": {k: balancer_state[k] for k in ("lo", "hi")}, "rng": {"torch_cpu": torch.get_rng_state()}}


def _python_rng() -> dict:
    version, internal, gauss = random.getstate()
    return {"python": [version, list(internal), gauss]}


def _set_python_rng(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: str, step: int, model, optimizer, balancer_state: dict, trainer_state: dict,
                    tokenizer=None, keep: int = 2, layout: Layout | None = None) -> str:  # fmt: skip
    """Write checkpoint `step` atomically and prune older ones beyond `keep`; every rank of `layout` (default: one
    process) calls it and writes its own shards. `balancer_state` is `Balancer.state_dict()`; `trainer_state` holds
    JSON values only. Returns the checkpoint's folder on every rank."""
    layout = layout or Layout.single()
    root = os.path.join(run_dir, CHECKPOINTS)
    name = f"step-{step:08d}"
    tmp = os.path.join(root, f".tmp-{name}")
    if layout.is_main:
        remove_temporaries(root)  # leftovers of killed saves: never published checkpoints
        os.makedirs(tmp)
    layout.barrier()
    save_distributed(model, tmp, layout.mesh, layout.dims, optimizers=torch_optimizers(optimizer),
                     extra=_tensor_state(balancer_state))  # fmt: skip
    if layout.is_main:  # dcp.save returns on the coordinator once every rank's shards and the metadata are written
        model.config.save_pretrained(tmp)
        if tokenizer is not None and hasattr(tokenizer, "save"):
            tokenizer.save(tmp)
        balancer = {k: v for k, v in balancer_state.items() if k not in ("lo", "hi")}
        state = {**trainer_state, "step": step, "balancer": balancer, "rng": _python_rng(),
                 "world_size": layout.world, "layout": vars(layout.dims)}  # fmt: skip
        with open(os.path.join(tmp, TRAINER_STATE), "w", encoding="utf-8") as f:
            json.dump(state, f, indent=1)
        publish_checkpoint(root, tmp, name, keep)
    layout.barrier()
    with open(os.path.join(root, LATEST), encoding="utf-8") as f:  # the folder the main process published
        return os.path.join(root, f.read().strip())


def load_checkpoint(path: str, model, optimizer, balancer, layout: Layout | None = None) -> dict:
    """Restore `model` (built and parallelized for `layout`), `optimizer`, `balancer` and the RNG from checkpoint
    folder `path`, saved at any layout; returns trainer_state.json (step, data position, counters) with
    OPTIMIZER_CHANGES: the optimizer settings of this run that differ from the checkpoint's, sorted (setting,
    "old -> new") pairs (`describe_changes` words them).

    The optimizer's moments come from the checkpoint, its settings (lr, weight decay, betas, lr_scale) stay the
    caller's: loading an optimizer state restores its param groups too, so a run resumed with a new --lr or
    --weight-decay would otherwise silently keep the old ones."""
    layout = layout or Layout.single()
    state = read_json(os.path.join(path, TRAINER_STATE))
    tensors = _tensor_state(balancer.state_dict())
    configured = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    load_distributed(model, path, layout.mesh, layout.dims, optimizers=torch_optimizers(optimizer), extra=tensors)
    changes = set()
    for group, want in zip(optimizer.param_groups, configured):
        changes.update((k, f"{_plain(group.get(k))} -> {_plain(v)}") for k, v in want.items()
                       if _plain(group.get(k)) != _plain(v))  # fmt: skip
        group.update(want)
    state[OPTIMIZER_CHANGES] = sorted(changes)
    balancer.load_state_dict({**state["balancer"], **tensors["balancer"]})
    _set_python_rng(state["rng"])
    torch.set_rng_state(tensors["rng"]["torch_cpu"])
    return state


def describe_changes(changes, skip: tuple[str, ...] = ()) -> str:
    """load_checkpoint's OPTIMIZER_CHANGES as one line ("lr 0.0002 -> 0.0006, weight_decay 0.1 -> 0.25"), less the
    settings in `skip`; "" when none is left."""
    return ", ".join(f"{name} {change}" for name, change in changes if name not in skip)


def _plain(value):
    """An optimizer setting comparable across a save and a load (betas come back as a list)."""
    return list(value) if isinstance(value, tuple) else value


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


def checkpoint_problem(path: str) -> str | None:
    """What makes checkpoint folder `path` unusable for resuming or loading, in a few words; None when every file a
    load reads is there and parses (JSON files; the DCP metadata, and every shard file it names at its full length,
    which catches truncation). Reads no tensor data."""
    if not os.path.isdir(path):
        return "the folder does not exist"
    name = ""
    try:
        name = "config.json"
        read_json(os.path.join(path, name))
        name = TRAINER_STATE
        state = read_json(os.path.join(path, name))
        if not isinstance(state.get("step"), int):
            raise ValueError("no step number")
        if "rng" not in state or "balancer" not in state:
            raise ValueError("no rng or balancer")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if os.path.exists(os.path.join(path, name)):
                read_json(os.path.join(path, name))
    except FileNotFoundError:
        return f"{name} is missing"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"{name}: {err}"
    return storage_problem(path, required=("rng.torch_cpu", "balancer.lo", "balancer.hi"))


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


RUN_FILES = (CHECKPOINTS, "train_config.json", "metrics.jsonl")  # what makes a folder a training run


def resolve_checkpoint(path: str) -> str:
    """A checkpoint folder, or a training run folder (its newest good checkpoint, see `latest_checkpoint`). A run
    with no complete checkpoint yet is an error, even when the folder also holds a model of another origin: loading
    that one instead would silently serve or export something the run never trained."""
    if any(os.path.exists(os.path.join(path, name)) for name in RUN_FILES):
        latest = latest_checkpoint(path)
        if latest is None:
            raise FileNotFoundError(f"training run {path} has no complete checkpoint yet (the first is saved at step "
                                    f"{FIRST_SAVE_STEP}, then every --save-every steps); wait for it or pass a "
                                    f"checkpoint folder")  # fmt: skip
        return latest
    return path


def is_training_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA))


def build_model(config: K3Config, device: str | torch.device = "cpu"):
    """A K3ForCausalLM, or a K3ForConditionalGeneration when the config has a vision tower, with uninitialised fp32
    storage on `device` (meta construction, then `to_empty`): the caller initialises it (`init_weights`) or fills
    it from a checkpoint."""
    from openk3.model.multimodal import K3ForConditionalGeneration

    cls = K3ForCausalLM if config.vision_config is None else K3ForConditionalGeneration
    with torch.device("meta"):
        model = cls(config)
    return model.to_empty(device=device)


def load_model(path: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"):
    """(model, folder) for `path`: a release-format checkpoint folder, a training checkpoint (DCP, read in this one
    process without a process group) or a training run (its newest good checkpoint). `folder` is the checkpoint
    folder, where its tokenizer and chat template are. dtype=None keeps the stored dtypes (a training checkpoint's
    are fp32)."""
    folder = resolve_checkpoint(path)
    if not is_training_checkpoint(folder):
        return K3ForCausalLM.from_pretrained(folder, dtype=dtype, device=device), folder  # text (vision skipped)
    model = build_model(K3Config.from_pretrained(folder))
    load_distributed(model, folder, None, Layout.single().dims)
    if dtype is not None:
        model.to_dtype(dtype)
    return model.to(device), folder

"""Tiny process-agnostic helpers shared by every openk3 package: dtype names, relative error, the fp32 exp limit,
the checks every reader and writer of a checkpoint folder uses (`file_inside`, `read_json`, `open_permissions`), and
`release_freed_memory`. The CPU thread rule (`pick_threads`, `set_threads`) lives in `openk3.threads`; its names are
re-exported here for the code that imported them from this module.

Only the standard library, torch and `openk3.threads` may be imported here (tests/test_layering.py checks it).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
from typing import Any

import torch

from openk3.threads import physical_cores, pick_threads, set_threads  # noqa: F401  (re-exported)

# ln(fp32 max) ~ 88.72: e^x overflows to inf above it. KDA's tiles need chunk * |gate lower bound| below it, so
# that exp(-(cumulative gate)) of a chunk stays finite.
FP32_EXP_LIMIT = 88.72

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float64": torch.float64,
}


def to_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """Accept a torch dtype, a config-style name ("bfloat16", "torch.float32") or None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = dtype.removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error rms(a - b) / rms(b), computed in fp64 (the metric every equivalence test of a fast path against its reference reports)."""
    a64, b64 = a.detach().double(), b.detach().double()
    denom = b64.pow(2).mean().sqrt().item()
    num = (a64 - b64).pow(2).mean().sqrt().item()
    return num / denom if denom > 0 else num


def file_inside(folder: str | os.PathLike, name: str, what: str = "checkpoint file") -> str:
    """`folder/name`, refused with a ValueError (`what`, `name`, where it leads) unless it resolves strictly inside
    `folder` once symlinks are followed: a checkpoint may only name files it holds, never `../x`, `/abs/x`, a symlink
    leading out, or the folder itself (`""`, `"."`). One exception: a Hugging Face cache snapshot
    (`models--ORG--NAME/snapshots/REV/`) holds symlinks into its own repository's `blobs/`, and those are allowed."""
    path = os.path.join(folder, name)
    root, real = os.path.realpath(folder), os.path.realpath(path)
    named_out = os.path.isabs(name) or ".." in name.replace("\\", "/").split("/")
    if named_out or real == root or not (_under(root, real) or _under(_hf_blobs(root), real)):
        raise ValueError(f"{what} {name!r} resolves to {real}, which is not inside the folder {root}")
    return path


def _under(root: str | None, path: str) -> bool:
    return root is not None and path != root and os.path.commonpath([root, path]) == root


def _hf_blobs(snapshot: str) -> str | None:
    """The `blobs/` folder of a Hugging Face cache repository when `snapshot` is one of its snapshots, else None."""
    snapshots = os.path.dirname(snapshot)
    repo = os.path.dirname(snapshots)
    if os.path.basename(snapshots) == "snapshots" and os.path.basename(repo).startswith(("models--", "datasets--")):
        return os.path.join(repo, "blobs")
    return None


def open_permissions(file: str) -> None:
    """Give `file` the permissions `open` would (0666 less the umask): safetensors writes its files 0600, which
    hides a checkpoint from the other users of a shared machine."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(file, 0o666 & ~umask)


def read_json(file: str) -> Any:
    """`json.load` of `file`, with a one-line ValueError naming the file (and line and column) when it is not JSON."""
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{file}: invalid JSON at line {err.lineno} column {err.colno}: {err.msg}") from err
    except UnicodeDecodeError as err:
        raise ValueError(f"{file}: not UTF-8 text (byte {err.start})") from err


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc's `malloc_trim`; a no-op elsewhere).

    A loop whose steps allocate many large tensors of varying sizes (an RL update over variable-length rollouts)
    fragments glibc's heap: freed blocks stay mapped, and the process's RSS grows step after step although live
    memory does not (measured: 13 GB RSS after an RL step whose live memory was 0.7 GB). Calling this between steps
    keeps RSS at the live size.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def fp32_region():
    """Turn autocast off (CPU and CUDA) inside ops whose numerics the release fixes in fp32: under autocast a matmul
    or conv would otherwise run in bf16 even on fp32 inputs (router, AttnRes mix, KDA, short conv, attention).
    Outside autocast there is nothing to turn off, and skipping the two context managers matters in decode loops."""
    if not (torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")):
        yield
        return
    with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
        yield


def fp32_op(fn):
    """Decorator form of `fp32_region`."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with fp32_region():
            return fn(*args, **kwargs)

    return wrapper

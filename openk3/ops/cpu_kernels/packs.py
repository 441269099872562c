"""Kernel calls prepared once per module: a layer's weights checked and turned into ctypes arguments on its first
decode step, reused while they stay the same tensors.

Why: a decode step calls about 50 layer kernels, and checking their ~15 weights each (dtype, contiguity, storage)
and building pointer arrays cost ~3 ms of Python per step on the 2-core machine, ~7% of a bf16 decode step
(benchmarks/results/cpu.md). Weights stay put between steps, so that work is done once.

A pack holds what `build()` returned for a module (a prepared call, or None: the kernel does not apply to these
weights) and is reused while
  * no parameter, buffer or submodule has been registered on any module since it was built (a replaced weight:
    `load_state_dict(assign=True)`, a swapped submodule): a global counter bumped by torch's registration hooks;
  * each of its weights is still the tensor its module holds under that name (replaced without the hooks:
    FSDP2 writes `module._parameters` directly) and still has its data pointer and dtype (`.data` swaps and
    `.to()`, which keep the Parameter object but move its storage).
Non-tensor settings a kernel reads (eps, bounds, top-k) are the layer's configuration, read when it is prepared.
Values may change freely (optimizer steps, weight sync: in-place copies); the kernels read the weights where they
live. Packs live in a weak dictionary beside the modules (never on them: a module still pickles and deep-copies),
and only outside autograd: with grad enabled every call is checked afresh, as `requires_grad` may change.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
from torch.nn.modules import module as _module

_generation = 0


def _registered(*_args) -> None:
    global _generation
    _generation += 1


_module.register_module_parameter_registration_hook(_registered)
_module.register_module_buffer_registration_hook(_registered)
_module.register_module_module_registration_hook(_registered)


def _slots(modules: Sequence[object]) -> dict[int, tuple[dict, str]]:
    """id(tensor) -> (the `_parameters` or `_buffers` dict that holds it, its name) under these modules."""
    slots: dict[int, tuple[dict, str]] = {}
    for root in modules:
        if isinstance(root, torch.nn.Module):
            for m in root.modules():
                for d in (m._parameters, m._buffers):
                    for name, t in d.items():
                        if t is not None:
                            slots.setdefault(id(t), (d, name))
    return slots


class _Pack:
    __slots__ = ("generation", "keys", "parts", "slots", "tensors", "value")

    def __init__(self, owner: object, parts: tuple, tensors: Sequence[torch.Tensor], value) -> None:
        self.generation = _generation
        self.parts = parts
        self.tensors = tuple(tensors)
        self.keys = tuple((t.data_ptr(), t.dtype) for t in self.tensors)
        found = _slots((owner, *parts))
        self.slots = tuple(found.get(id(t)) for t in self.tensors)
        self.value = value

    def valid(self, parts: tuple) -> bool:
        if self.generation != _generation or len(parts) != len(self.parts):
            return False
        if any(a is not b for a, b in zip(parts, self.parts)):
            return False
        for t, (ptr, dtype), slot in zip(self.tensors, self.keys, self.slots):
            if t.data_ptr() != ptr or t.dtype != dtype:
                return False
            if slot is not None and slot[0].get(slot[1]) is not t:  # swapped without the hooks (FSDP2 does)
                return False
        return True


_packs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def prepared(owner: object, build: Callable[[], tuple[Sequence[torch.Tensor], object]], parts: tuple = ()):
    """The prepared call for `owner` (a module) and the other modules `parts` it reads (the same objects, compared by
    identity): the cached one while valid, else `build()` -> (the weights it depends on, the prepared call or None),
    cached outside autograd."""
    if torch.is_grad_enabled():
        return build()[1]
    pack = _packs.get(owner)
    if pack is None or not pack.valid(parts):
        tensors, value = build()
        pack = _packs[owner] = _Pack(owner, parts, tensors, value)
    return pack.value


def clear() -> None:
    """Forget every pack (tests)."""
    _packs.clear()

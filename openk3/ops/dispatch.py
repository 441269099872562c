"""The one dispatch point for ops with more than one implementation (STYLE.md rule 9).

Owns `select`, `use_impl` and the dispatched entry points `kda_chunked` / `kda_step` (and `kda_verify` /
`kda_fold`, which run the dispatched `kda_step`, so a fold replays with the implementation its verify used).
"ref" is the always-present CPU path (`ops.kda.chunk.kda_chunked`, the fast chunked op, and
`ops.kda.step.kda_step`); "fla" is fla-core's Triton kernels (`ops.kda.gpu`), chosen for CUDA tensors when fla-core
and triton are installed; "bf16" (opt-in, never chosen automatically) runs `ops.kda.chunk_bf16.kda_chunked_bf16`, the CPU op with bf16 tile operands, for
bf16 inputs and "ref" for any other dtype. Nothing in `model/` checks devices; tests, benchmarks and users force
an implementation with `use_impl`, e.g. `with use_impl("kda_chunked", "bf16"): model(...)` for a bf16 model on CPU.

`linear` (every projection of the model, `model.layers.Linear`, and the routed experts): "ref" is `F.linear`;
"cpu" (the CPU default) sends bf16 inputs of at most `ops.cpu_kernels.MAX_ROWS` rows without autograd (decode, verify,
small batches) to the bf16 GEMV kernel of `ops.cpu_kernels`, bf16 products on a CPU without bf16 arithmetic to
`ops.widen.linear` (fp32 compute, one rounding), and everything else to `F.linear`. `experts` ("fused"
on CPU, "ref" elsewhere): one decode token's routed experts, or a dense SiTU MLP, in one kernel call
(`fused_experts` tells the model whether to use it). `kda_decode` and `mix_norm` ("fused" on CPU, "ref" = the
torch path in model/) are a whole KDA layer's decode step (its input to o_proj's output), and a Block AttnRes mix with
the RMSNorm after it; `moe_decode` ("fused" on CPU) a StableLatentMoE layer's decode step (router included);
`mla_decode` ("fused" on CPU) a gated MLA layer's decode step in two kernels (projections and norms; attention and
the gated o_proj, around the cache append); `decode_stack` ("fused" on CPU) a decode step's whole decoder stack in
one call (model/decode_stack.py), taken only where all of these are "fused". For these, `prepared_kernel` returns the kernel prepared for a
module's weights (once per module, `ops.cpu_kernels.packs`) where it is selected, else None.
"""

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from openk3.ops import cpu_kernels, widen
from openk3.ops.cpu_features import features
from openk3.ops.cpu_kernels import packs
from openk3.ops.cpu_kernels.stack import DecodeStack
from openk3.ops.kda import gpu, step
from openk3.ops.kda.chunk import kda_chunked as kda_chunked_cpu
from openk3.ops.kda.chunk_bf16 import kda_chunked_bf16
from openk3.ops.kda.step import KDASteps
from openk3.ops.kda.step import kda_step as kda_step_cpu


def _kda_chunked_bf16_tiles(q: torch.Tensor, *args, **kwargs):
    """bf16 tile operands for bf16 inputs on a CPU with bf16 arithmetic (about 1.8x faster at 8K there, about 2x the
    rounding error of "ref"); the fp32-compute op for anything else, and on a CPU without bf16 arithmetic, where bf16
    products are the slow ones (`ops.widen`)."""
    bf16_tiles = q.dtype == torch.bfloat16 and (q.device.type != "cpu" or features().bf16_native)
    return (kda_chunked_bf16 if bf16_tiles else kda_chunked_cpu)(q, *args, **kwargs)


def _linear_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The bf16 GEMV kernel where it applies (bf16, at most cpu_kernels.MAX_ROWS rows, no bias, no autograd); a bf16
    product on a CPU without bf16 arithmetic in fp32 (`ops.widen`); else torch's."""
    if bias is None and cpu_kernels.applies(x, weight) and cpu_kernels.available():
        return cpu_kernels.linear_gemv(x, weight)
    if widen.widens(x, weight):
        return widen.linear(x, weight, bias)
    return F.linear(x, weight, bias)


IMPLS: dict[str, dict[str, Callable]] = {
    "kda_chunked": {"ref": kda_chunked_cpu, "fla": gpu.kda_chunked_fla, "bf16": _kda_chunked_bf16_tiles},
    "kda_step": {"ref": kda_step_cpu, "fla": gpu.kda_step_fla},
    "linear": {"ref": F.linear, "cpu": _linear_cpu},
    # A token's routed experts (and the dense SiTU MLPs) in one call; "ref" = the torch path in model/.
    "experts": {"ref": None, "fused": cpu_kernels.experts},
    # Whole layer parts in one call (prepared per module: `prepared_kernel`); "ref" = the torch path in model/.
    "kda_decode": {"ref": None, "fused": cpu_kernels.KDADecode},
    "mix_norm": {"ref": None, "fused": cpu_kernels.MixNorm},
    "moe_decode": {"ref": None, "fused": cpu_kernels.MoEDecode},
    "mla_decode": {"ref": None, "fused": cpu_kernels.MLADecode},
    # A decode step's whole decoder stack in one call (model/decode_stack.py); "ref" = the layer loop.
    "decode_stack": {"ref": None, "fused": DecodeStack},
}
CPU_DEFAULTS = {"linear": "cpu", "experts": "fused", "kda_decode": "fused", "mix_norm": "fused", "moe_decode": "fused",
                "mla_decode": "fused", "decode_stack": "fused"}  # fmt: skip
_forced: dict[str, str] = {}


def select(op: str, device: torch.device) -> str:
    """The implementation name `op` uses for tensors on `device`: the forced one, else for KDA "fla" on CUDA when
    available, for the CPU kernels' ops the entry of `CPU_DEFAULTS` on CPU (each falls back to its reference per
    call where it does not apply), else "ref"."""
    if op in _forced:
        return _forced[op]
    if op in CPU_DEFAULTS:
        return CPU_DEFAULTS[op] if device.type == "cpu" else "ref"
    return "fla" if device.type == "cuda" and gpu.fla_available() else "ref"


@contextmanager
def use_impl(op: str, name: str) -> Iterator[None]:
    """Force `op` to implementation `name` inside the block (tests, benchmarks)."""
    if name not in IMPLS[op]:
        raise ValueError(f"unknown implementation {name!r} for {op}; expected one of {sorted(IMPLS[op])}")
    previous = _forced.get(op)
    _forced[op] = name
    try:
        yield
    finally:
        if previous is None:
            del _forced[op]
        else:
            _forced[op] = previous


@contextmanager
def reference_path() -> Iterator[None]:
    """Every op with a CPU kernel (`CPU_DEFAULTS`) on its torch reference inside the block: the path the kernels are
    tested against."""
    with contextlib.ExitStack() as stack:
        for op in CPU_DEFAULTS:
            stack.enter_context(use_impl(op, "ref"))
        yield


def kda_chunked(q: torch.Tensor, *args, **kwargs):
    """Chunked KDA for prefill and training (contract of `ops.kda.kda_chunked`)."""
    return IMPLS["kda_chunked"][select("kda_chunked", q.device)](q, *args, **kwargs)


def kda_step(q: torch.Tensor, *args, **kwargs):
    """One decode token on a state (contract of `ops.kda.kda_step`)."""
    return IMPLS["kda_step"][select("kda_step", q.device)](q, *args, **kwargs)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; on CPU, bf16 decode-sized inputs go to the GEMV kernel (`ops.cpu_kernels`) and
    bf16 products without bf16 arithmetic are computed in fp32 (`ops.widen`)."""
    return IMPLS["linear"][select("linear", x.device)](x, weight, bias)


def fused_experts(z_TL: torch.Tensor, weights: list[torch.Tensor]):
    """`ops.cpu_kernels.experts` when it is selected, applies to one token `z_TL` [1, L] and these expert matrices,
    and is built; else None (the caller runs its torch path)."""
    fn = IMPLS["experts"][select("experts", z_TL.device)]
    if fn is None or not cpu_kernels.experts_apply(z_TL, weights) or not cpu_kernels.available():
        return None
    return fn


def prepared_kernel(op: str, owner: object, device: torch.device,
                    weights: Callable[[], tuple[list[torch.Tensor], list[torch.Tensor], Callable[[type], object]]],
                    parts: tuple = ()):  # fmt: skip
    """The layer kernel `op` prepared for `owner`'s weights where it is selected on `device`, built, and takes them;
    else None (the caller runs its torch path). `weights()` -> (the matrices and norm weights, one dtype; the fp32
    tensors; `make(cls)` -> the kernel over them). The kernel is cached per owner (and the other modules `parts` it
    reads) while those stay the same tensors (`cpu_kernels.packs`); the caller still checks each step's inputs with its `applies(...)`."""
    cls = IMPLS[op][select(op, device)]
    if cls is None or not cpu_kernels.available():
        return None

    def build():
        tensors, fp32, make = weights()
        return [*tensors, *fp32], make(cls) if cpu_kernels.weights_apply(tensors, fp32) else None

    return packs.prepared(owner, build, parts)


def kda_verify(q_NGHK: torch.Tensor, *args) -> tuple[torch.Tensor, KDASteps]:
    """G decode steps per sequence without writing the state (contract of `ops.kda.step.kda_verify`)."""
    return step.kda_verify(q_NGHK, *args, step=IMPLS["kda_step"][select("kda_step", q_NGHK.device)])


def kda_fold(steps: KDASteps, state_NHKV: torch.Tensor, consumed_N: torch.Tensor) -> torch.Tensor:
    """Replay recorded verify steps onto a state (contract of `ops.kda.step.kda_fold`)."""
    return step.kda_fold(steps, state_NHKV, consumed_N, step=IMPLS["kda_step"][select("kda_step", state_NHKV.device)])

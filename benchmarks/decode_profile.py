"""Where a decode step of openk3's serving engine spends its time: torch.profiler over a few batch-1 decode steps,
the ops' self CPU time grouped into categories (matmul, elementwise, indexing/copies, reductions/norms, other), the
top ops, and the time outside any op (Python, the engine's bookkeeping, dispatch). benchmarks/cpu.py calls
`profile_decode` per dtype.

Self times are those of the ops on the calling thread: an op's intra-op worker threads count toward the op that
started them. Kernels called through ctypes (`openk3.ops.cpu_kernels`) are no torch ops, so the profiler would count
them as overhead: while profiling, each C function is called inside a `record_function` named `cpu_kernels::NAME`
(the names contain "gemv" or "expert": matmul), and the result lists the ones called. Reading
the profiler's events back costs ~70 us per event (~1500 events per tiny-model step), so keep `steps` small.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from torch.profiler import ProfilerActivity, profile, record_function

from openk3.ops import cpu_kernels
from openk3.serve.request import SamplingParams

CATEGORIES = ("matmul", "fused layers", "elementwise", "indexing/copies", "reductions/norms", "other")
# The kernels that run a whole layer part in one call (its matmuls included): a KDA layer, a MoE layer, a gated MLA
# layer (two calls), an AttnRes mix with its norm, and the decoder stack of a step (all of them, one call).
FUSED_LAYER_KERNELS = ("kda_decode", "moe_decode", "mla_decode", "mix_norm", "decode_stack")
MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "linear", "mv", "addmv", "matmul", "_addmm_activation"}
ELEMENTWISE_OPS = {"add", "sub", "rsub", "mul", "div", "neg", "exp", "log", "log1p", "expm1", "sigmoid", "silu",
                   "gelu", "relu", "tanh", "rsqrt", "sqrt", "pow", "clamp", "clamp_min", "clamp_max", "where",
                   "softplus", "abs", "sign", "maximum", "minimum", "eq", "ne", "lt", "gt", "ge", "le", "logical_and",
                   "logical_or", "logical_not", "reciprocal", "sin", "cos", "addcmul", "addcdiv", "lerp", "square",
                   "isfinite", "isnan", "bitwise_and", "bitwise_or", "floor", "ceil", "round", "fmod", "remainder",
                   "nan_to_num", "masked_fill", "erf"}  # fmt: skip
# Data movement, views and allocation: copies and dtype casts, gathers and scatters, concatenation, views, creation.
COPY_OPS = {"copy", "_to_copy", "to", "clone", "contiguous", "index", "index_select", "gather", "scatter",
            "scatter_add",
            "index_put", "_index_put_impl", "index_add", "index_copy", "index_fill", "cat", "stack", "slice", "select",
            "narrow", "view", "view_as", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "expand",
            "expand_as", "permute", "transpose", "t", "unsqueeze", "squeeze", "flatten", "unflatten", "movedim",
            "split", "split_with_sizes", "chunk", "unbind", "repeat", "repeat_interleave", "empty", "empty_like",
            "empty_strided", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like", "fill", "zero",
            "new_empty", "new_zeros", "new_full", "masked_select", "masked_scatter", "nonzero", "item",
            "_local_scalar_dense", "resize", "detach", "lift_fresh", "lift_fresh_copy", "alias", "unfold", "roll",
            "flip", "pad", "constant_pad_nd", "arange", "scalar_tensor", "diagonal", "tril", "triu", "one_hot",
            "bincount", "searchsorted", "embedding"}  # fmt: skip
REDUCTION_OPS = {"sum", "mean", "norm", "linalg_vector_norm", "rms_norm", "_fused_rms_norm", "layer_norm",
                 "native_layer_norm", "softmax", "_softmax", "log_softmax", "_log_softmax", "max", "min", "amax",
                 "amin", "argmax", "argmin", "topk", "sort", "argsort", "cumsum", "var", "std", "var_mean",
                 "logsumexp", "prod", "all", "any", "count_nonzero", "multinomial"}  # fmt: skip


def op_category(name: str) -> str:
    """The category of a profiler op name (`aten::index_copy_` -> indexing/copies); a custom op whose name contains
    "gemv" or "expert" is a matmul, one of `FUSED_LAYER_KERNELS` a fused layer."""
    base = name.split("::", 1)[-1].rstrip("_")
    if any(k in name for k in FUSED_LAYER_KERNELS):
        return "fused layers"
    if "gemv" in name or "expert" in name or base in MATMUL_OPS:
        return "matmul"
    for category, ops in (("elementwise", ELEMENTWISE_OPS), ("indexing/copies", COPY_OPS),
                          ("reductions/norms", REDUCTION_OPS)):  # fmt: skip
        if base in ops:
            return category
    return "other"


class _AnnotatedLibrary:
    """The kernel library with each C function called inside a `record_function` of its name."""

    def __init__(self, lib, names: list[str]):
        self._lib, self._names = lib, names

    def __getattr__(self, attr: str):
        fn = getattr(self._lib, attr)
        name = f"cpu_kernels::{attr.removeprefix('openk3_')}"
        if name not in self._names:
            self._names.append(name)

        def call(*args, _fn=fn, _name=name):
            with record_function(_name):
                return _fn(*args)

        return call


@contextmanager
def annotated_kernels():
    """Route the ctypes kernels (`ops.cpu_kernels`' library) through `record_function`s of their names for the
    duration; yields the list of names called (filled as they are; empty without the library)."""
    names: list[str] = []
    lib = cpu_kernels.library()
    if lib is None:
        yield names
        return
    previous = cpu_kernels._lib
    cpu_kernels._lib = _AnnotatedLibrary(lib, names)
    try:
        yield names
    finally:
        cpu_kernels._lib = previous


def profile_decode(engine, prompt: list[int], steps: int, top: int = 15) -> dict:
    """One request of `prompt` in `engine` (an idle LLMEngine whose max_model_len holds len(prompt) + 2 * steps + 4
    tokens): its prefill and two warm steps, `steps` decode steps timed plain, `steps` more under torch.profiler
    (the ctypes kernels annotated), then the rest untimed. Per step: the wall time both ways, each category's ops'
    self time, the overhead (the profiled wall time minus the ops' summed self time: Python, the engine's
    bookkeeping, dispatch, and the profiler's own cost), the `top` ops by self time and the names that fell into
    "other"."""
    engine.add_request({"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=2 * steps + 4, temperature=0.0, ignore_eos=True))  # fmt: skip
    for _ in range(3):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    plain = time.perf_counter() - t0
    with annotated_kernels() as kernels, profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - t0
    if not engine.has_unfinished():
        raise RuntimeError("the profiled request ended early: the profile timed idle steps")
    while engine.has_unfinished():
        engine.step()
    ops = [e for e in prof.key_averages() if not e.is_user_annotation or e.key in kernels]
    by_category = dict.fromkeys(CATEGORIES, 0.0)
    for e in ops:
        by_category[op_category(e.key)] += e.self_cpu_time_total / 1e3 / steps
    ops_ms = sum(by_category.values())
    wall_ms = 1e3 * wall / steps
    return {
        "steps": steps, "annotated_kernels": kernels, "ms_per_step_unprofiled": 1e3 * plain / steps,
        "ms_per_step_profiled": wall_ms, "ops_ms_per_step": ops_ms, "overhead_ms_per_step": wall_ms - ops_ms,
        "categories_ms_per_step": by_category,
        "other_ops": sorted({e.key for e in ops if op_category(e.key) == "other"}),
        "top_ops": [{"op": e.key, "category": op_category(e.key), "calls_per_step": e.count / steps,
                     "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps}
                    for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:top]],
    }  # fmt: skip

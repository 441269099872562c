"""A decode step's decoder stack in one kernel call (`ops.cpu_kernels.stack.DecodeStack`), where it applies.

Its reference is K3Model's layer loop: each layer calling its own fused kernels (or their torch references). The
stack runs the same kernels in the same order, with the Block AttnRes bookkeeping (model/attnres.py) in C, so the
outputs are the same bits; what it removes is ~10 ms of Python per bf16 step of the benchmark model between ~50
kernel calls (module calls, checks, allocations, benchmarks/results/cpu.md).

It applies to a DECODE batch of at most MAX_ROWS sequences on CPU, without context parallelism, when every layer
kernel is selected ("fused", `ops.dispatch`) and takes its layer's weights (one dtype, fp32 or bf16), every MoE
layer dispatches locally, no module hook would see a call of the layer loop (a layer, its mixer, FFN or norms:
FSDP's, a user's), the KDA entries give `decode_in_out()`, and the MLA entries are pages of one pool
(`decode_rows()` / `advance()`: serving's paged views; the list cache of `K3Cache` is not, and takes the layer
loop). The stack over the weights is prepared once per model while they stay the same tensors
(`ops.cpu_kernels.packs`). Observers of MoE layers see the kernel's scores and experts after the stack, in layer
order, as they would have during the loop.
"""

from __future__ import annotations

import torch
from torch.nn.modules import module

from openk3.model.attnres import mix_norm_weights
from openk3.model.batch import ForwardBatch
from openk3.model.moe import local_dispatch
from openk3.ops import dispatch

STACK_OPS = ("decode_stack", "kda_decode", "mix_norm", "moe_decode", "mla_decode", "experts")


def _dense_weights(mlp):
    tensors = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    return tensors, [], lambda cls: (*tensors, mlp.beta, mlp.linear_beta)


def _stack_weights(model):
    """(every layer part's matrices, their fp32 tensors, make(cls) -> the DecodeStack or None): the form of
    `ops.dispatch.prepared_kernel`."""
    from openk3.ops import cpu_kernels  # the classes of the parts (the stack is selected only with all of them)

    layers, tensors, fp32 = [], [], []

    def part(weights):
        t, f, _ = weights
        tensors.extend(t)
        fp32.extend(f)
        return weights

    for layer in model.layers:
        attn = part(mix_norm_weights(layer.self_attention_res_norm, layer.self_attention_res_proj,
                                     layer.input_layernorm))  # fmt: skip
        mixer = part(layer.self_attn._decode_weights())
        mlp = part(mix_norm_weights(layer.mlp_res_norm, layer.mlp_res_proj, layer.post_attention_layernorm))
        if hasattr(layer, "mlp"):
            ffn, ffn_cls = part(_dense_weights(layer.mlp)), None
        else:
            ffn, ffn_cls = part(layer.block_sparse_moe._decode_weights()), cpu_kernels.MoEDecode
        mixer_cls = cpu_kernels.KDADecode if layer.kind == "kda" else cpu_kernels.MLADecode
        layers.append((layer.block_start, attn, mixer, mixer_cls, mlp, ffn, ffn_cls))
    out = part(mix_norm_weights(model.output_attn_res_norm, model.output_attn_res_proj, model.norm))

    def make(cls):
        parts = [p for entry in layers for p in (entry[1], entry[2], entry[4], entry[5])] + [out]
        if any(make is None or not cpu_kernels.weights_apply(t, f) for t, f, make in parts):
            return None
        mix = cpu_kernels.MixNorm
        built = [(start, (attn[2](mix), mlp[2](mix)), mixer[2](mixer_cls), ffn[2](ffn_cls))
                 for start, attn, mixer, mixer_cls, mlp, ffn, ffn_cls in layers]  # fmt: skip
        return cls(built, out[2](mix))

    return tensors, fp32, make


def _hooked(model) -> bool:
    """Whether a hook would see a module call of the layer loop (a layer, its mixer, FFN or norms): the stack makes
    none of them, so it steps aside."""
    if any((module._global_forward_hooks, module._global_forward_pre_hooks, module._global_backward_hooks,
            module._global_backward_pre_hooks)):  # fmt: skip
        return True
    for layer in model.layers:
        for m in (layer, *layer._modules.values()):
            if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
                return True
    return False


def decode_stack(model, partial_TD: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
    """K3Model's final-norm hidden states [N, D] of a DECODE batch (`partial_TD` [N, D]: the token embeddings) in one
    kernel call, updating the cache as the layer loop would; None where the stack does not apply (see above)."""
    device = partial_TD.device
    if any(dispatch.select(op, device) != "fused" for op in STACK_OPS) or _hooked(model):
        return None
    stack = dispatch.prepared_kernel("decode_stack", model, device, lambda: _stack_weights(model))
    if stack is None or not stack.applies(partial_TD):
        return None
    entries = batch.cache.layers
    layers = model.layers
    ios = []
    for l in stack.kda:
        io = entries[l].decode_in_out()
        if not stack.mixers[l].applies_io(io):
            return None
        ios.append((l, io))
    views = [entries[l] for l in stack.mla]
    rows, pools, absorbed = None, [], []
    if views:
        if not all(hasattr(v, "decode_rows") and v.written == views[0].written for v in views):
            return None
        pools = [v.pool_rows() for v in views]
        absorbed = [layers[l].self_attn.absorbed() for l in stack.mla]
        if not stack.mla_applies(pools, absorbed):
            return None
        rows = views[0].decode_rows(batch.seq_lens)
    moes = [layers[l].block_sparse_moe for l in stack.moe]
    if any(m.dispatcher is not local_dispatch for m in moes):
        return None
    for l, io in ios:
        stack.set_kda(l, io)
    for l, pool, (w_uk, w_uv) in zip(stack.mla, pools, absorbed):
        stack.set_mla(l, pool, w_uk, w_uv, layers[l].self_attn.scale)
    N = partial_TD.shape[0]
    if moes:
        k, E = moes[0].top_k, moes[0].gate.weight.shape[0]
        scores = torch.empty(len(moes), N, E, dtype=torch.float32)
        weights = torch.empty(len(moes), N, k, dtype=torch.float32)
        replay = batch.routed_experts is not None
        if replay:  # [T, M, k] -> [M, T, k], each token's experts ascending (checked by K3Model)
            idx = batch.routed_experts.to(torch.int64).transpose(0, 1).sort(dim=-1).values.contiguous()
        else:
            idx = torch.empty(len(moes), N, k, dtype=torch.int64)
        for m, l in enumerate(stack.moe):
            stack.set_moe(l, idx[m], scores[m], weights[m], replay)
    hidden = stack(partial_TD, *(rows if rows is not None else (None, None, None)))
    for _, io in ios:
        io.commit()
    for v in views:
        v.advance(batch.seq_lens)
    for m, moe in enumerate(moes):
        if moe.observer is not None:
            moe.observer(moe, scores[m], idx[m])
    return hidden

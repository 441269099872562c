"""The decoder stack in one kernel call (model/decode_stack.py) against the layer loop it replaces (each layer's own
fused kernels, `use_impl("decode_stack", "ref")`): the same kernels in the same order, so the same bits: logits,
tokens, recorded routes and the KDA pools after the run, fp32 and bf16, with several ragged sequences whose MLA
latents span pages, under routing replay, and with an observer. Where it does not apply (the list cache of
K3Cache, a forced reference, a module hook) the layer loop runs."""

from __future__ import annotations

import pytest
import torch
from kernel_marks import needs_kernels
from serve_helpers import LogitTap, make_engine, random_prompt, run_outputs, tiny_model

from openk3.model.batch import ForwardBatch
from openk3.model.cache import K3Cache
from openk3.ops import dispatch
from openk3.serve.request import SamplingParams

pytestmark = needs_kernels


PROMPTS = [random_prompt(n, seed=n) for n in (37, 5, 21)]  # ragged: MLA blocks of different lengths, across pages


def _run(model, stack: bool, **options):
    engine = make_engine(model, hash_unit=16, block_size=16, record_routed_experts=True, **options)
    tap = LogitTap(engine)
    for i, p in enumerate(PROMPTS):
        engine.add_request({"prompt_token_ids": p}, SamplingParams(max_tokens=14, ignore_eos=True), str(i))
    with dispatch.use_impl("decode_stack", "fused" if stack else "ref"):
        outs = run_outputs(engine)
    pools = [engine.manager.pools.state_NkSHKV.clone(), engine.manager.pools.conv_Nk3SWP.clone()]  # the KDA slots
    return outs, tap.rows, pools


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_stack_equals_the_layer_loop_bit_for_bit(dtype, calls):
    model = tiny_model(0).to_dtype(dtype)
    outs, rows, pools = _run(model, stack=True)
    assert calls.get("openk3_decode_stack", 0) >= 13  # every decode step of the three requests
    ran = calls.get("openk3_decode_stack", 0)
    ref_outs, ref_rows, ref_pools = _run(model, stack=False)
    assert calls["openk3_decode_stack"] == ran  # the reference run never took it
    for rid, out in outs.items():
        assert out.outputs[0].token_ids == ref_outs[rid].outputs[0].token_ids, rid
        assert torch.equal(torch.stack(rows[rid]), torch.stack(ref_rows[rid])), rid
        assert torch.equal(
            torch.as_tensor(out.outputs[0].routed_experts), torch.as_tensor(ref_outs[rid].outputs[0].routed_experts)
        )
    for a, b in zip(pools, ref_pools):  # released slots are poisoned with NaN in both
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_the_stack_replays_routes_as_the_layer_loop(monkeypatch, calls):
    """Routing replay in decode (routes given with the batch): the same experts used, the same logits."""
    model = tiny_model(1)
    moe = [layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe")]
    E, k = moe[0].gate.weight.shape[0], moe[0].top_k
    plain = ForwardBatch.from_lengths.__func__

    def with_routes(cls, input_ids_T, lengths, *args, **kwargs):
        g = torch.Generator().manual_seed(int(input_ids_T.sum()))  # the same routes for the same tokens in both runs
        T = input_ids_T.shape[0]
        routes = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T * len(moe))]).view(T, len(moe), k)
        return plain(cls, input_ids_T, lengths, *args, routed_experts=routes, **kwargs)

    monkeypatch.setattr(ForwardBatch, "from_lengths", classmethod(with_routes))
    outs, rows, _ = _run(model, stack=True)
    assert calls.get("openk3_decode_stack", 0) > 0
    ref_outs, ref_rows, _ = _run(model, stack=False)
    for rid, out in outs.items():
        assert out.outputs[0].token_ids == ref_outs[rid].outputs[0].token_ids, rid
        assert torch.equal(torch.stack(rows[rid]), torch.stack(ref_rows[rid])), rid


def test_the_stack_feeds_observers_in_layer_order(calls):
    model = tiny_model(2)
    seen = {True: [], False: []}
    moes = [layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe")]
    for stack in (True, False):
        for m in moes:
            m.observer = lambda module, scores, idx, s=stack: seen[s].append(
                (module.moe_index, scores.clone(), idx.clone())
            )
        engine = make_engine(model, hash_unit=16, block_size=16)
        engine.add_request({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=3, ignore_eos=True), "0")
        with dispatch.use_impl("decode_stack", "fused" if stack else "ref"):
            run_outputs(engine)
    assert calls.get("openk3_decode_stack", 0) == 2  # the two decode steps after the prefill
    assert len(seen[True]) == len(seen[False]) > 0
    for (i, s, x), (j, t, y) in zip(seen[True], seen[False]):
        assert i == j and torch.equal(s, t) and torch.equal(x, y)


def test_the_layer_loop_runs_where_the_stack_does_not_apply(calls):
    model = tiny_model(0)
    ids = torch.tensor([random_prompt(9, seed=4)])
    cache = K3Cache(model.config, 1, torch.float32)
    with torch.no_grad():
        model(ids, cache=cache)
        model(ids[:, :1], cache=cache)  # a decode step on the list cache: no pool rows for the MLA layers
    assert "openk3_decode_stack" not in calls and calls.get("openk3_kda_decode", 0) > 0


def test_a_hook_on_a_layer_takes_the_layer_loop(calls):
    model = tiny_model(0)
    seen = []
    handle = model.model.layers[2].self_attn.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    try:
        engine = make_engine(model, hash_unit=16, block_size=16)
        engine.add_request({"prompt_token_ids": PROMPTS[1]}, SamplingParams(max_tokens=3, ignore_eos=True), "0")
        run_outputs(engine)
    finally:
        handle.remove()
    assert "openk3_decode_stack" not in calls and len(seen) == 3  # the prefill and two decode steps

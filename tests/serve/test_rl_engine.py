"""The engine as an RL rollout engine: routed experts recorded per token (equal to a full forward's choices, through
prefix hits, copy-on-write, chunked prefill, batching and speculative verify), in-place weight updates that never
serve a stale prefix entry, and output-end checkpoints that let the next turn of an agent loop resume near the end of
the previous turn's output."""

from __future__ import annotations

import pytest
import torch
from serve_helpers import make_engine, random_prompt, run_outputs, tiny_model

from openk3.model.batch import ForwardBatch
from openk3.serve.kv.routes import moe_layers, record_routes
from openk3.serve.request import SamplingParams

UNITS = {"hash_unit": 16, "block_size": 64}
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


@torch.no_grad()
def full_forward_routes(model, ids: list[int]) -> torch.Tensor:
    """[P, M, k] int16: the experts every MoE layer chooses for `ids` in one plain forward, no cache."""
    with record_routes(moe_layers(model)) as chosen:
        model.forward_batch(ForwardBatch.from_lengths(torch.tensor(ids), [len(ids)]))
    return torch.stack([calls[0] for calls in chosen], 1).to(torch.int16)


def serve(engine, prompt: list[int], rid: str, params: SamplingParams = GREEDY):
    engine.add_request({"prompt_token_ids": prompt}, params, request_id=rid)
    return run_outputs(engine)[rid]


def fed(prompt: list[int], out) -> list[int]:
    return prompt + out.outputs[0].token_ids[:-1]  # the last sampled token is never fed


def test_routes_equal_a_full_forward_and_off_is_none(model, one_thread):
    M = sum(model.text_config.ffn_kind(i) == "moe" for i in range(model.text_config.num_hidden_layers))
    assert 0 < M < model.text_config.num_hidden_layers  # layer 0 is dense: it has no row
    engine = make_engine(model, record_routed_experts=True, max_num_batched_tokens=32, **UNITS)
    for seed, n in ((1, 40), (2, 70)):
        prompt = random_prompt(n, seed=seed)
        out = serve(engine, prompt, str(seed))
        routes = out.outputs[0].routed_experts
        assert routes.dtype == torch.int16 and routes.device.type == "cpu"
        assert routes.shape == (len(prompt) + GREEDY.max_tokens - 1, M, model.text_config.num_experts_per_token)
        assert torch.equal(routes, full_forward_routes(model, fed(prompt, out)))
    off = make_engine(model, **UNITS)
    assert serve(off, random_prompt(20, seed=3), "x").outputs[0].routed_experts is None


def test_observers_already_set_keep_running_and_are_restored(model):
    seen = []
    layer = moe_layers(model)[0]
    layer.observer = lambda module, scores, idx: seen.append(idx.shape[0])
    try:
        engine = make_engine(model, record_routed_experts=True, **UNITS)
        serve(engine, random_prompt(20, seed=4), "a", SamplingParams(max_tokens=3, ignore_eos=True))
        assert sum(seen) == 20 + 2  # every fed token, through the chained observer
        assert layer.observer is not None and all(m.observer is None for m in moe_layers(model)[1:])
    finally:
        layer.observer = None


@pytest.mark.parametrize("output_end", [False, True])
def test_routes_through_a_multi_turn_prefix_hit_equal_a_recompute(model, output_end, one_thread):
    """Turn 2 = turn 1's prompt + output + new tokens hits turn 1's cached pages (a partial page: copy-on-write);
    its routes for the restored positions come from the routes pool and equal a run without caching."""
    policy = {"output_end": output_end}
    warm = make_engine(model, record_routed_experts=True, checkpoint_policy=policy, **UNITS)
    cold = make_engine(model, record_routed_experts=True, enable_prefix_caching=False, **UNITS)
    p1 = random_prompt(40, seed=5)
    out1 = serve(warm, p1, "t1")
    p2 = p1 + out1.outputs[0].token_ids + random_prompt(7, seed=6)
    out2 = serve(warm, p2, "t2")
    assert out2.num_cached_tokens == (48 if output_end else 32)  # turn 1 fed 51 tokens: output boundary 48
    assert warm.manager.stats.cow_copies >= 1  # the hit ends inside a 64-token page
    ref = serve(cold, p2, "t2")
    assert ref.num_cached_tokens == 0
    assert out2.outputs[0].token_ids == ref.outputs[0].token_ids
    assert torch.equal(out2.outputs[0].routed_experts, ref.outputs[0].routed_experts)
    assert torch.equal(out2.outputs[0].routed_experts, full_forward_routes(model, fed(p2, out2)))


def test_concurrent_chunked_requests_each_get_their_own_routes(model, one_thread):
    prompts = [random_prompt(n, seed=10 + n) for n in (5, 37, 70, 18)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (9, 4, 6, 14)]
    engine = make_engine(model, record_routed_experts=True, max_num_batched_tokens=32, **UNITS)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request({"prompt_token_ids": p}, sp, request_id=str(i))
    done = run_outputs(engine)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        solo = serve(make_engine(model, record_routed_experts=True, **UNITS), p, "solo", sp)
        got = done[str(i)].outputs[0]
        assert got.token_ids == solo.outputs[0].token_ids
        assert got.routed_experts.shape[0] == len(p) + sp.max_tokens - 1
        assert torch.equal(got.routed_experts, solo.outputs[0].routed_experts), i
        assert torch.equal(got.routed_experts, full_forward_routes(model, fed(p, done[str(i)])))


@pytest.mark.parametrize("draft", ["self", "other"])
def test_speculative_verify_rows_are_overwritten_or_never_read(model, draft, one_thread):
    """Verify passes write rows for draft positions; after acceptance only fed positions are read (a rejected one is
    overwritten when the real token is fed), so the routes still equal a full forward over prompt + output[:-1]."""
    prompt = random_prompt(30, seed=7)
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": model if draft == "self" else tiny_model(5)}
    engine = make_engine(model, record_routed_experts=True, speculative_config=spec, **UNITS)
    out = serve(engine, prompt, "s", SamplingParams(max_tokens=16, ignore_eos=True))
    stats = engine.spec_stats
    assert stats.accepted > 0 if draft == "self" else stats.accepted < stats.drafted
    routes = out.outputs[0].routed_experts
    assert routes.shape[0] == len(prompt) + 15 and bool((routes >= 0).all())
    assert torch.equal(routes, full_forward_routes(model, fed(prompt, out)))


@pytest.mark.parametrize("caching", [False, True])
def test_routes_survive_preemption_and_n_samples(model, caching, one_thread):
    """Requests that grow past a small pool are preempted and recomputed (or resumed from a checkpoint whose pages
    hold their routes); two samples of one prompt share its prompt pages. Each gets the routes of its own tokens."""
    prompts = [random_prompt(30, seed=70 + i) for i in range(3)]
    engine = make_engine(model, hash_unit=16, block_size=32, num_blocks=7, max_num_seqs=3, max_model_len=96,
                         enable_prefix_caching=caching, max_num_checkpoints=3, record_routed_experts=True)  # fmt: skip
    for i, p in enumerate(prompts):
        n = 2 if i == 0 else 1
        engine.add_request({"prompt_token_ids": p}, SamplingParams(max_tokens=40, n=n, temperature=1.0, seed=i),
                           request_id=str(i))  # fmt: skip
    done = run_outputs(engine)
    assert sum(r.num_preemptions for reqs in engine.requests.values() for r in reqs) > 0
    for i, p in enumerate(prompts):
        for sample in done[str(i)].outputs:
            fed_ids = p + sample.token_ids[:-1]
            assert torch.equal(sample.routed_experts, full_forward_routes(model, fed_ids)), (i, sample.index)


def test_abort_reads_the_fed_positions(model):
    engine = make_engine(model, record_routed_experts=True, max_num_batched_tokens=16, **UNITS)
    engine.add_request({"prompt_token_ids": random_prompt(40, seed=8)}, GREEDY, request_id="a")
    engine.add_request({"prompt_token_ids": random_prompt(30, seed=9)}, GREEDY, request_id="b")
    engine.step()  # "a" has fed its first 16 tokens; "b" waits
    req_a, req_b = engine.requests["a"][0], engine.requests["b"][0]
    engine.abort_request("a")
    engine.abort_request("b")
    assert req_a.routed_experts.shape[0] == 16 and bool((req_a.routed_experts >= 0).all())
    assert req_b.routed_experts.shape[0] == 0


def _outputs(engine, prompts, prefix=""):
    return {i: serve(engine, p, f"{prefix}{i}") for i, p in enumerate(prompts)}


def test_update_weights_equals_a_fresh_engine_and_never_hits_stale_state(one_thread):
    old, new = tiny_model(0), tiny_model(1)
    prompts = [random_prompt(40, seed=20), random_prompt(25, seed=21)]
    engine = make_engine(old, **UNITS)
    _outputs(engine, prompts, "before")
    assert engine.manager.index.checkpoints and engine.weight_version == 0
    state = {k: v.double() for k, v in new.state_dict().items()}  # cast to the model's dtype on copy
    assert engine.update_weights(state) == 1 and engine.weight_version == 1
    assert not engine.manager.index.checkpoints and not engine.manager.blocks.evictable  # reset at once
    fresh = make_engine(tiny_model(1), **UNITS)
    got, ref = _outputs(engine, prompts), _outputs(fresh, prompts)
    for i in range(len(prompts)):
        assert got[i].num_cached_tokens == 0  # the prompt was cached under the old weights
        a, b = got[i].outputs[0], ref[i].outputs[0]
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) <= 1e-6 for t in x)
    # Entries made under version 1 hit again; an update from a model object with an explicit version.
    assert serve(engine, prompts[0] + [1, 2], "again").num_cached_tokens == 32
    assert engine.update_weights(tiny_model(1), version=7) == 7 and engine.weight_version == 7
    assert serve(engine, prompts[0], "v7").num_cached_tokens == 0


def test_the_version_in_the_hash_alone_keeps_old_entries_out(one_thread):
    """Without the reset (entries still cached), a new version never matches them; the old version still does."""
    engine = make_engine(tiny_model(0), **UNITS)
    prompt = random_prompt(40, seed=22)
    serve(engine, prompt, "a")
    engine.manager.set_weight_version(3)
    assert serve(engine, prompt, "b").num_cached_tokens == 0
    engine.manager.set_weight_version(0)
    assert serve(engine, prompt, "c").num_cached_tokens == 32


def test_bad_weight_updates_raise_and_change_nothing(one_thread):
    engine = make_engine(tiny_model(0), **UNITS)
    prompt = random_prompt(30, seed=23)
    before = serve(engine, prompt, "a").outputs[0].token_ids
    params = {k: v.clone() for k, v in engine.model.state_dict().items()}
    good = tiny_model(1).state_dict()
    first = next(iter(good))
    wrong_shape = dict(good)
    wrong_shape["lm_head.weight"] = good["lm_head.weight"][:-1]
    unknown, missing = {**good, "bogus.weight": torch.zeros(1)}, {k: v for k, v in good.items() if k != first}
    for bad, name in ((wrong_shape, "lm_head.weight"), (unknown, "bogus.weight"), (missing, first)):
        with pytest.raises(ValueError, match=name):
            engine.update_weights(bad)
    assert engine.weight_version == 0
    assert all(torch.equal(v, params[k]) for k, v in engine.model.state_dict().items())
    assert serve(engine, prompt, "b").outputs[0].token_ids == before
    engine.add_request({"prompt_token_ids": prompt}, GREEDY, request_id="waiting")
    with pytest.raises(RuntimeError, match="waiting"):
        engine.update_weights(good)
    engine.abort_request("waiting")
    assert engine.update_weights(good) == 1


def test_reset_prefix_cache_frees_unreferenced_entries(model):
    engine = make_engine(model, **UNITS)
    serve(engine, random_prompt(40, seed=24), "a")
    assert engine.manager.index.checkpoints and engine.manager.blocks.evictable
    engine.add_request({"prompt_token_ids": random_prompt(20, seed=25)}, GREEDY, request_id="running")
    engine.step()
    held = list(engine.requests["running"][0].block_ids)
    assert engine.reset_prefix_cache() == 1
    assert not engine.manager.index.checkpoints and not engine.manager.blocks.evictable
    assert engine.requests["running"][0].block_ids == held
    run_outputs(engine)


def _episode(engine, turns: int, obs_len: int, max_tokens: int):
    """An agent episode: turn k+1's prompt = turn k's prompt + its output + a few observation tokens. Returns the
    outputs, the prompts and the tokens fed to the model (the prefill work)."""
    fed_tokens = [0]
    run = engine.runner.run

    def counted(reqs, ids, rows, verify=False):
        fed_tokens[0] += sum(len(x) for x in ids)
        return run(reqs, ids, rows, verify)

    engine.runner.run = counted
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    prompt, outs, prompts = random_prompt(40, seed=30), [], []
    for k in range(turns):
        engine.add_request({"prompt_token_ids": prompt}, params, request_id=f"turn{k}")
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outs.append(out)
            assert len(engine.manager.index.checkpoints) <= engine.config.max_num_checkpoints
            engine.manager.check()
        prompts.append(prompt)
        prompt = prompt + outs[-1].outputs[0].token_ids + random_prompt(obs_len, seed=31 + k)
    return outs, prompts, fed_tokens[0]


def test_output_end_checkpoints_let_agent_turns_resume_near_the_output_end(model, one_thread):
    U, max_tokens = UNITS["hash_unit"], 30
    options = {"max_num_checkpoints": 3, **UNITS}
    on = make_engine(model, checkpoint_policy={"output_end": True}, **options)
    off = make_engine(model, **options)  # prompt-end checkpoints only
    cold = make_engine(model, enable_prefix_caching=False, **UNITS)
    outs, prompts, work_on = _episode(on, 3, 5, max_tokens)
    outs_off, _, work_off = _episode(off, 3, 5, max_tokens)
    outs_cold, _, work_cold = _episode(cold, 3, 5, max_tokens)
    for k in range(1, 3):
        fed_before = len(prompts[k - 1]) + max_tokens - 1
        assert outs[k].num_cached_tokens >= (fed_before // U) * U - U
        assert outs[k].num_cached_tokens > outs_off[k].num_cached_tokens
    for a, b in zip(outs, outs_cold):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == y.token_ids
        assert max(abs(p[t] - q[t]) for p, q in zip(x.logprobs, y.logprobs) for t in p) <= 1e-4
    assert work_on < work_off < work_cold
    print(f"fed tokens over the episode: output_end {work_on}, prompt end only {work_off}, no caching {work_cold}")


def test_a_request_keeps_one_output_checkpoint(model):
    """Decoding across several unit boundaries keeps only the latest output checkpoint (plus the prompt-end one);
    an output checkpoint another request has restored from stays."""
    engine = make_engine(model, checkpoint_policy={"output_end": True}, **UNITS)
    prompt = random_prompt(40, seed=40)
    out = serve(engine, prompt, "a", SamplingParams(max_tokens=60, ignore_eos=True))  # fed 99: boundaries 48..96
    depths = sorted(c.depth for c in engine.manager.index.checkpoints.values())
    assert depths == [2, 6]  # prompt end (32) and the latest output boundary (96)
    assert engine.manager.stats.checkpoints_created == 5  # 32, 48, 64, 80, 96
    assert out.num_cached_tokens == 0
    # A second decoding request whose 48-token output checkpoint another request restores from keeps it.
    engine = make_engine(model, checkpoint_policy={"output_end": True}, **UNITS)
    engine.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=40, ignore_eos=True), request_id="a")
    req = engine.requests["a"][0]
    while req.num_computed < 50:
        engine.step()
    engine.add_request({"prompt_token_ids": req.tokens[:50]}, SamplingParams(max_tokens=3), request_id="b")
    done = run_outputs(engine)
    assert done["b"].num_cached_tokens == 48
    assert sorted(c.depth for c in engine.manager.index.checkpoints.values()) == [2, 3, 4]  # 48 kept, then 64

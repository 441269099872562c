"""Input-replay speculative decoding: the fold of recorded verify inputs is bitwise
the sequential decode update for every KDA layer; speculative greedy decoding equals plain decoding token for token
with both proposers, with prefix caching on and off; proposers and acceptance behave."""

from __future__ import annotations

import pytest
import torch
from serve_helpers import greedy_reference, make_engine, random_prompt, run_to_end, tiny_model

from openk3.model.batch import ForwardBatch, Mode
from openk3.ops.dispatch import kda_step
from openk3.serve.request import Request, SamplingParams
from openk3.serve.spec_decode import NgramProposer, accept, fold
from openk3.utils import rel_rms


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


def _engine_with_slots(model, n):
    engine = make_engine(model, hash_unit=16, block_size=32)
    reqs = []
    for i in range(n):
        req = Request(str(i), [1, 2, 3], SamplingParams())
        engine.manager.admit(req)
        engine.manager.ensure_blocks(req, 32)
        reqs.append(req)
    return engine, reqs


@torch.no_grad()
def test_fold_is_bitwise_the_sequential_update_per_kda_layer(model, one_thread):
    """Layer-level contract: verify records G steps without touching the slot; folding the first c_n of them
    gives, bitwise, the state of c_n plain decode steps on the same recorded inputs (and the conv tails rolled from
    the recorded rows). The layer's own one-token decode path on the same input rows agrees within rounding only:
    verify's projections are GEMMs over N*G rows, decode's over N (which is why the model-level contract is equal greedy
    tokens on margin-clear prompts, not bitwise logits)."""
    N, G = 3, 5
    gen = torch.Generator().manual_seed(0)
    engine, reqs = _engine_with_slots(model, N)
    pools = engine.manager.pools
    pools.state_NkSHKV.normal_(generator=gen)
    pools.conv_Nk3SWP.normal_(generator=gen)
    before_state, before_conv = pools.state_NkSHKV.clone(), pools.conv_Nk3SWP.clone()
    layer = model.model.layers[0].self_attn  # a KDA layer (index 0 in the KDA pools)
    x_NGD = torch.randn(N, G, model.text_config.hidden_size, generator=gen)
    view = engine.manager.view(reqs, [G] * N, verify=True)
    batch = ForwardBatch.from_lengths(torch.zeros(N * G, dtype=torch.long), [G] * N, view, mode=Mode.VERIFY)
    out_verify = layer(x_NGD.reshape(N * G, -1), batch, view.layers[0]).view(N, G, -1)
    assert torch.equal(pools.state_NkSHKV, before_state) and torch.equal(pools.conv_Nk3SWP, before_conv)
    record = view.records[0]
    consumed = [1, 5, 3]
    slots = [r.slot for r in reqs]
    fold(pools, slots, [record], consumed)  # this layer only: it is KDA layer 0 of the pools
    # (i) replaying the recorded inputs with the decode step
    state = before_state[0, slots]
    snapshots = []
    for t in range(G):
        _, state = kda_step(*record.steps.step(t), state)
        snapshots.append(state)
    for n, c in enumerate(consumed):
        assert torch.equal(pools.state_NkSHKV[0, slots[n]], snapshots[c - 1][n])
        for j in range(3):  # the tail is the last W-1 pre-conv rows up to step c, copied exactly
            rows = torch.cat([before_conv[0, j, slots[n]], record.pre_conv_NGP[j][n]])
            assert torch.equal(pools.conv_Nk3SWP[0, j, slots[n]], rows[c : c + 3])
    # (ii) the layer's own plain decode path, one token at a time, on the same input rows
    engine2, reqs2 = _engine_with_slots(model, N)
    engine2.manager.pools.state_NkSHKV.copy_(before_state)
    engine2.manager.pools.conv_Nk3SWP.copy_(before_conv)
    plain_states, plain_tails, plain_out = [], [], []
    for t in range(G):
        view2 = engine2.manager.view(reqs2, [1] * N)
        b2 = ForwardBatch.from_lengths(torch.zeros(N, dtype=torch.long), [1] * N, view2)
        plain_out.append(layer(x_NGD[:, t].contiguous(), b2, view2.layers[0]))
        p2 = engine2.manager.pools
        plain_states.append(p2.state_NkSHKV[0, slots].clone())
        plain_tails.append(p2.conv_Nk3SWP[0][:, slots].clone())
    for n, c in enumerate(consumed):
        assert rel_rms(pools.state_NkSHKV[0, slots[n]], plain_states[c - 1][n]) <= 1e-6
        assert rel_rms(pools.conv_Nk3SWP[0][:, slots[n]], plain_tails[c - 1][:, n]) <= 1e-6
    assert rel_rms(out_verify, torch.stack(plain_out, 1)) <= 1e-5


def test_ngram_proposer_takes_the_latest_match():
    req = Request("r", [7, 1, 2, 9, 9, 1, 2, 5, 6, 1, 2], SamplingParams())
    assert NgramProposer(max_n=3, min_n=2)(req, 3) == [5, 6, 1]
    assert NgramProposer(max_n=3, min_n=2)(Request("s", [1, 2, 3, 4], SamplingParams()), 3) == []
    # A repeating run overlaps its own copy: period 2 still yields a full window.
    assert NgramProposer(max_n=2, min_n=2)(Request("t", [5, 1, 2, 1, 2], SamplingParams()), 5) == [1, 2, 1, 2, 1]


def test_accept_rule_greedy():
    logits = torch.full((4, 10), -5.0)
    for j, t in enumerate([3, 4, 8, 1]):
        logits[j, t] = 5.0
    assert accept(logits, None, [3, 4, 8], None)[0] == [3, 4, 8, 1]  # all accepted + bonus
    assert accept(logits, None, [3, 7, 8], None)[0] == [3, 4]  # second draft rejected, corrected
    assert accept(logits, None, [0, 4, 8], None)[0] == [3]


def _repetitive_prompt(model, seed):
    """p + o + p where o is the model's own continuation of p: prompt lookup then proposes o again."""
    p = random_prompt(24, seed=seed)
    o, _ = greedy_reference(model, p, 16)
    return p + o + p


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("method", ["ngram", "draft_model", "draft_model_other"])
def test_speculative_greedy_equals_plain(model, method, caching):
    prompts = [_repetitive_prompt(model, s) for s in (1, 2, 3)] + [random_prompt(30, seed=4)]
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    if method.startswith("draft_model"):
        spec = {"method": "draft_model", "num_speculative_tokens": 3,
                "model": model if method == "draft_model" else tiny_model(5)}  # fmt: skip
    options = {"hash_unit": 16, "block_size": 32, "enable_prefix_caching": caching, "max_num_batched_tokens": 64}
    plain, specd = make_engine(model, **options), make_engine(model, speculative_config=spec, **options)
    for engine in (plain, specd):
        for rep in range(2 if caching else 1):  # with caching: the second round hits the first round's prefixes
            for i, p in enumerate(prompts):
                engine.add_request({"prompt_token_ids": p}, SamplingParams(max_tokens=16), request_id=f"{rep}-{i}")
            engine.results = {**getattr(engine, "results", {}), **run_to_end(engine)}
    stats = specd.spec_stats
    assert stats.drafted > 0
    if method != "draft_model_other":
        assert stats.accepted > 0
    if method == "draft_model":
        assert stats.acceptance_rate > 0.9  # the target drafting for itself
    compared = 0
    for rid, ref in plain.results.items():
        ref_ok = greedy_reference(model, prompts[int(rid.split("-")[1])], 16)
        clear = ref_ok[1]
        assert specd.results[rid][:clear] == ref[:clear] == ref_ok[0][:clear], rid
        compared += clear
    assert compared >= 12 * len(plain.results)  # of 16 per request (all 16 here): the comparison has teeth
    if caching:
        assert specd.manager.stats.state_hit_tokens > 0  # caching stays effective with speculation on


def test_speculative_sampling_is_seeded(model):
    prompt = _repetitive_prompt(model, 1)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    params = SamplingParams(max_tokens=12, temperature=0.7, seed=3)
    runs = []
    for _ in range(2):
        engine = make_engine(model, speculative_config=spec, hash_unit=16, block_size=32)
        engine.add_request({"prompt_token_ids": prompt}, params, request_id="a")
        runs.append(run_to_end(engine)["a"])
    assert runs[0] == runs[1] and len(runs[0]) == 12


class _AlwaysDrafts:
    """Proposes k copies of token 1 for every request (so every decode has drafts for the scheduler to cut)."""

    def __call__(self, req, k):
        return [1] * k

    def update(self, req, drafted, accepted):
        pass

    def release(self, req):
        pass


def test_the_engine_drafts_and_the_scheduler_cuts_drafts_to_the_budget(model):
    """Drafting happens outside `Scheduler.schedule` (it gets the drafts), which cuts each to what the step's token
    budget leaves: a verified request's drafts are a prefix of what the proposer returned, never over budget, and
    greedy tokens stay those of plain decoding."""
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    engine = make_engine(model, speculative_config=spec, hash_unit=16, block_size=32, max_num_batched_tokens=6)
    engine.proposer = _AlwaysDrafts()
    prompts = [random_prompt(8, seed=20 + i) for i in range(3)]
    for i, p in enumerate(prompts):
        engine.add_request({"prompt_token_ids": p}, SamplingParams(max_tokens=10), request_id=str(i))
    schedule, seen = engine.scheduler.schedule, {"cut": 0, "verified": 0}

    def recording(drafts):
        plan = schedule(drafts)
        assert plan.num_tokens <= 6
        planned = {id(req): used for group in plan.verify.values() for req, used in group}
        assert planned.keys() <= drafts.keys()
        for key, proposed in drafts.items():
            used = planned.get(key, [])
            assert 1 <= len(proposed) <= 4 and used == proposed[: len(used)]
            seen["cut"] += 0 < len(used) < len(proposed)
        seen["verified"] += len(planned)
        return plan

    engine.scheduler.schedule = recording
    spec_out = run_to_end(engine)
    assert seen["verified"] >= 6 and seen["cut"] >= 3
    plain = make_engine(model, hash_unit=16, block_size=32, max_num_batched_tokens=6)
    for i, p in enumerate(prompts):
        plain.add_request({"prompt_token_ids": p}, SamplingParams(max_tokens=10), request_id=str(i))
    plain_out = run_to_end(plain)
    for i, p in enumerate(prompts):
        _, clear = greedy_reference(model, p, 10)
        assert clear >= 4 and spec_out[str(i)][:clear] == plain_out[str(i)][:clear]

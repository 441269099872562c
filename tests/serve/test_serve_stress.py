"""Randomised stress of the engine: arrivals, aborts, preemptions, evictions and slot
reuse under a small pool never let one request see another's state (each finished request equals its solo greedy
run on margin-clear steps, and freed memory is NaN-poisoned so a stray read would show), the pool invariants hold
after every step, and every page and slot returns to the pool at the end."""

from __future__ import annotations

import functools

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_helpers import LogitTap, greedy_reference, make_engine, random_prompt, tiny_model

from openk3.serve.request import SamplingParams

MODEL = tiny_model(0)
PROMPTS = [random_prompt(n, seed=40 + i) for i, n in enumerate((5, 18, 33, 47, 64, 90))]
# Prompts that share prefixes, so prefix hits, copy-on-write and checkpoint reuse happen under pressure.
PROMPTS += [PROMPTS[4][:40] + random_prompt(12, seed=60), PROMPTS[5][:64] + random_prompt(20, seed=61)]
MAX_TOKENS = 24


@functools.cache
def reference(i: int) -> tuple[list[int], int]:
    return greedy_reference(MODEL, PROMPTS[i], MAX_TOKENS)


events = st.lists(
    st.tuples(st.integers(0, len(PROMPTS) - 1), st.integers(1, MAX_TOKENS), st.integers(0, 3), st.booleans()),
    min_size=3,
    max_size=10,
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=events, budget=st.sampled_from([8, 16, 48]), spec=st.booleans(), num_blocks=st.integers(7, 12))
def test_random_traffic_keeps_requests_isolated_and_returns_every_resource(events, budget, spec, num_blocks):
    options = {"hash_unit": 16, "block_size": 32, "max_num_batched_tokens": budget, "max_num_seqs": 4, "num_blocks": num_blocks,
                   "max_num_checkpoints": 2, "max_model_len": 120}  # fmt: skip
    if spec:
        options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 2}
    engine = make_engine(MODEL, **options)
    tap = LogitTap(engine)
    finished, aborted, live = {}, set(), []
    with torch.no_grad():
        for n, (prompt, max_tokens, wait, abort) in enumerate(events):
            rid = f"r{n}"
            engine.add_request({"prompt_token_ids": PROMPTS[prompt]}, SamplingParams(max_tokens=max_tokens), rid)
            live.append((rid, prompt, max_tokens))
            for _ in range(wait):
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out.outputs[0]
                engine.manager.check()
            if abort and len(live) > 1:
                victim = live[-2][0]
                if victim not in finished:
                    engine.abort_request(victim)
                    aborted.add(victim)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.outputs[0]
            engine.manager.check()
    for rows in tap.rows.values():
        assert all(torch.isfinite(r).all() for r in rows)  # nothing read poisoned (freed) memory
    for rid, prompt, max_tokens in live:
        if rid in aborted:
            continue
        ref, clear = reference(prompt)
        got = finished[rid].token_ids
        assert len(got) == max_tokens
        upto = min(clear, max_tokens)
        assert got[:upto] == ref[:upto], (rid, prompt)
    usage = engine.manager.usage()
    assert usage["blocks_used"] == 0 and usage["slots_used"] == 0
    pool = engine.manager.blocks
    assert len(pool.free) + len(pool.evictable) == pool.num_blocks

"""Prefix caching on the hybrid cache: a hit gives the same logits as computing
from scratch (bitwise against a cold run split at the same point, within a measured 2e-5 of an unsplit one) for hits on and off
page boundaries (copy-on-write) and after evictions; hits at the default units; separate latent and state counters;
second-sighting checkpoints; warnings when caching is inert."""

from __future__ import annotations

import logging

import pytest
import torch
from serve_helpers import LogitTap, make_engine, random_prompt, run_to_end, tiny_model

from openk3.serve.request import SamplingParams
from openk3.utils import rel_rms

UNITS = {"hash_unit": 16, "block_size": 32}
UNSPLIT_BOUND = 2e-5  # hit vs an unsplit recompute: measured worst 5.7e-6 (see the first test)


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


def _serve(engine, prompt, rid, max_tokens=6):
    engine.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=max_tokens), request_id=rid)
    return run_to_end(engine)[rid]


# (shared tokens, checkpoint interval, expected hit): a hit that ends on a page boundary; one inside a page
# (copy-on-write); one bounded by an interval checkpoint below the deeper latent match (the state, not the latents,
# decides where a hit ends).
@pytest.mark.parametrize(("shared", "interval", "hit"), [(64, 0, 64), (48, 0, 48), (48, 32, 32)])
def test_prefix_hit_is_bitwise_equal_to_a_cold_split_run(model, shared, interval, hit, one_thread):
    base = random_prompt(shared + 6, seed=1)
    follow = base[:shared] + random_prompt(20, seed=2)
    # Both runs cut the first prefill chunk at the hit; no second-sighting checkpoint adds a cut to one run only.
    options = {"max_num_batched_tokens": hit, **UNITS}
    # The interval case takes no prompt-end checkpoints, so its only checkpoint below the shared prefix is at 32.
    options["checkpoint_policy"] = {"prompt_end": not interval, "interval": interval, "second_sighting": False}
    warm = make_engine(model, **options)
    _serve(warm, base, "a")
    tap_warm = LogitTap(warm)
    out_warm = _serve(warm, follow, "b")
    assert warm.manager.stats.state_hit_tokens == hit
    assert warm.manager.stats.mla_hit_tokens == shared
    assert warm.manager.stats.cow_copies == (1 if hit % 32 else 0)
    cold = make_engine(model, **options)
    tap_cold = LogitTap(cold)
    out_cold = _serve(cold, follow, "b")
    assert out_warm == out_cold
    for a, b in zip(tap_warm.rows["b"], tap_cold.rows["b"], strict=True):
        assert torch.equal(a, b)
    with torch.no_grad():
        unsplit = model(torch.tensor([follow + out_cold[:-1]])).logits[0, len(follow) - 1 :]
    # Against the unsplit forward the split itself reorders fp32 sums (chunk cuts, cached-decode kernels), so this
    # bound is a measured one: over 3 random models x 3 cases x 4 prompt pairs at 1 and 2 threads the prompt's last
    # row reached 5.7e-6 and the decode rows 5.4e-6 (1.06e-6 on this exact case on one CI machine). 2e-5 is ~3.5x
    # that; a wrong state or a stale latent page is >= 1e-3. The bitwise check above is the exact one.
    first, rest = rel_rms(tap_warm.rows["b"][0], unsplit[0]), rel_rms(torch.stack(tap_warm.rows["b"][1:]), unsplit[1:])
    print(f"hit vs unsplit recompute: prompt row {first:.2e}, decode rows {rest:.2e}")
    assert first <= UNSPLIT_BOUND and rest <= UNSPLIT_BOUND


def test_hit_after_evictions_and_with_concurrent_sharers(model, one_thread):
    """A small pool: a flood of other prompts evicts the first prompt's pages, which must drop its checkpoint
    (never a checkpoint without its latents); the next lookup then misses and recomputes correctly. Two concurrent
    requests sharing a prefix each match their solo run."""
    base = random_prompt(70, seed=3)
    engine = make_engine(model, num_blocks=12, max_num_seqs=2, max_num_checkpoints=3, max_model_len=256, **UNITS)
    _serve(engine, base, "a")
    assert engine.manager.stats.checkpoints_created == 1
    for i in range(6):
        _serve(engine, random_prompt(90, seed=100 + i), f"flood{i}")
    assert engine.manager.stats.blocks_evicted > 0 and engine.manager.stats.checkpoints_evicted > 0
    follow = base[:64] + random_prompt(10, seed=4)
    before = engine.manager.stats.state_hit_tokens
    got = _serve(engine, follow, "b")
    solo = _serve(make_engine(model, **UNITS), follow, "solo")
    assert got == solo
    assert engine.manager.stats.state_hit_tokens == before  # the evicted prefix could not be reused
    # Two requests that share a prefix, admitted together after it is cached.
    x, y = base[:64] + random_prompt(9, seed=5), base[:64] + random_prompt(13, seed=6)
    shared = make_engine(model, **UNITS)
    _serve(shared, base, "warm")
    shared.add_request({"prompt_token_ids": x}, SamplingParams(max_tokens=6), request_id="x")
    shared.add_request({"prompt_token_ids": y}, SamplingParams(max_tokens=6), request_id="y")
    both = run_to_end(shared)
    assert both["x"] == _serve(make_engine(model, **UNITS), x, "x")
    assert both["y"] == _serve(make_engine(model, **UNITS), y, "y")
    assert shared.manager.stats.state_hit_tokens == 128


def test_repeats_hit_at_the_default_units(model):
    """With U = 512, an exact repeat of a 2,000-token prompt reuses 1,536 tokens, a 600-token one 512."""
    engine = make_engine(model, max_num_batched_tokens=2048)
    assert engine.config.hash_unit == 512 and engine.config.block_size == 1024
    for n, want in ((2000, 1536), (600, 512)):
        prompt = random_prompt(n, seed=n)
        first = _serve(engine, prompt, f"first{n}", max_tokens=2)
        engine.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2), request_id=f"again{n}")
        outs = {}
        while engine.has_unfinished():
            outs.update({o.request_id: o for o in engine.step() if o.finished})
        assert outs[f"again{n}"].num_cached_tokens == want
        assert outs[f"again{n}"].outputs[0].token_ids == first


def test_latent_and_state_counters_differ_and_second_sighting_plants_a_checkpoint(model):
    engine = make_engine(model, **UNITS)
    base = random_prompt(100, seed=7)  # prompt-end checkpoint at 96
    _serve(engine, base, "a")
    stats = engine.manager.stats
    # Shares 3 units of latents but no checkpoint sits at 48: latent hit 48, effective hit 0 ...
    first = base[:50] + random_prompt(30, seed=8)
    _serve(engine, first, "b")
    assert (stats.mla_hit_tokens, stats.state_hit_tokens) == (48, 0)
    # ... so a checkpoint was planted at 48 while recomputing, and the next sharer resumes there.
    second = base[:50] + random_prompt(30, seed=9)
    _serve(engine, second, "c")
    assert stats.state_hit_tokens == 48
    assert _serve(make_engine(model, **UNITS), second, "solo") == _serve(engine, second, "c2")


def test_warnings_when_prefix_caching_is_inert(model, caplog):
    with pytest.warns(UserWarning, match="inert"):
        make_engine(model, max_num_checkpoints=0, **UNITS)
    with pytest.warns(UserWarning, match="inert"):
        make_engine(model, checkpoint_policy={"prompt_end": False, "interval": 0, "second_sighting": False}, **UNITS)
    with pytest.warns(UserWarning, match="not a multiple of hash_unit"):
        make_engine(model, max_num_batched_tokens=100, **UNITS)
    engine = make_engine(model, **UNITS)
    with caplog.at_level(logging.WARNING, logger="openk3.serve"):
        for i in range(8):
            engine.add_request({"prompt_token_ids": random_prompt(10, seed=200 + i)}, SamplingParams(max_tokens=1))
        run_to_end(engine)
    assert "shorter than the hash unit" in caplog.text
    # Latent matches with no checkpoint to resume from (every checkpoint trigger off): the runtime warning.
    caplog.clear()
    with pytest.warns(UserWarning, match="inert"):
        engine = make_engine(model, checkpoint_policy={"prompt_end": False, "interval": 0, "second_sighting": False},
                             **UNITS)  # fmt: skip
    base = random_prompt(60, seed=9)
    with caplog.at_level(logging.WARNING, logger="openk3.serve"):
        for i in range(8):
            engine.add_request({"prompt_token_ids": base[:40] + random_prompt(5, seed=300 + i)},
                               SamplingParams(max_tokens=1))  # fmt: skip
            run_to_end(engine)
    assert engine.manager.stats.mla_hit_tokens > 0 and engine.manager.stats.state_hit_tokens == 0
    assert "no state checkpoint" in caplog.text

"""The engine against `model.generate` and the cache-free forward: greedy equality for batches of mixed-length
requests arriving at different steps, chunked prefill at any budget ≡ one-shot prefill, sampling that does not depend
on batching, stop conditions, log-probs, the offline `LLM` API and clear errors."""

from __future__ import annotations

import math

import pytest
import torch
from serve_helpers import LogitTap, greedy_reference, make_engine, random_prompt, run_to_end, tiny_model

from openk3.data.tokenizer import ByteTokenizer
from openk3.serve.engine import LLM
from openk3.serve.request import SamplingParams
from openk3.utils import rel_rms


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


def test_engine_greedy_matches_generate_with_staggered_arrivals(model):
    lengths = [3, 70, 17, 140, 1, 33]
    prompts = [random_prompt(n, seed=10 + i) for i, n in enumerate(lengths)]
    refs = [greedy_reference(model, p, 12) for p in prompts]
    engine = make_engine(model, hash_unit=16, block_size=32, max_num_batched_tokens=48, max_num_seqs=4)
    done = {}
    arrivals = {0: [0, 1], 2: [2], 3: [3, 4], 7: [5]}  # step -> prompts arriving then
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for i in arrivals.get(step, []):
            engine.add_request({"prompt_token_ids": prompts[i]}, SamplingParams(max_tokens=12), request_id=str(i))
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out.outputs[0].token_ids
        engine.manager.check()
        step += 1
    compared = 0
    for i, (ref, clear) in enumerate(refs):
        assert done[i][:clear] == ref[:clear], f"prompt {i}"
        compared += clear
    assert compared >= 50  # most steps have clear margins, so the comparison has teeth
    # Every slot and page went back: only cached prefixes and checkpoints remain.
    usage = engine.manager.usage()
    assert usage["blocks_used"] == 0 and usage["slots_used"] == 0


@pytest.mark.parametrize("budget", [7, 16, 33, 64, 1000])
def test_chunked_prefill_matches_one_shot(model, budget):
    prompt = random_prompt(150, seed=3)
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0, -1].float()
    engine = make_engine(model, hash_unit=16, block_size=32, max_num_batched_tokens=budget,
                         enable_prefix_caching=False)  # fmt: skip
    tap = LogitTap(engine)
    engine.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), request_id="a")
    run_to_end(engine)
    assert rel_rms(tap.rows["a"][0], want) <= 1e-5


def test_decode_logits_match_full_forward(model):
    prompt = random_prompt(40, seed=4)
    engine = make_engine(model, hash_unit=16, block_size=32)
    tap = LogitTap(engine)
    engine.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=20), request_id="a")
    out = run_to_end(engine)["a"]
    with torch.no_grad():
        full = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]
    assert rel_rms(torch.stack(tap.rows["a"]), full) <= 1e-5


def test_sampling_is_seeded_per_request_not_per_batch(model):
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=7)
    prompt = random_prompt(20, seed=5)
    alone = make_engine(model)
    alone.add_request({"prompt_token_ids": prompt}, params, request_id="x")
    solo = run_to_end(alone)["x"]
    crowd = make_engine(model, max_num_seqs=8)
    for i in range(4):
        crowd.add_request({"prompt_token_ids": random_prompt(30, seed=50 + i)}, params, request_id=f"o{i}")
    crowd.add_request({"prompt_token_ids": prompt}, params, request_id="x")
    assert run_to_end(crowd)["x"] == solo


class _OneCharPerToken(ByteTokenizer):
    """Every id decodes to one printable character, so a random model's output is text with a known length (bytes
    from a random model are mostly invalid UTF-8 and decode to a lone replacement character)."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(0x4E00 + i) for i in ids)


def test_n_samples_stop_conditions_and_logprobs(model):
    llm = LLM(model, tokenizer=_OneCharPerToken(model.text_config.vocab_size), hash_unit=16, block_size=32)
    prompt = {"prompt_token_ids": random_prompt(25, seed=6)}
    greedy = llm.generate(prompt, SamplingParams(max_tokens=8, logprobs=3))[0]
    first = greedy.outputs[0]
    assert len(first.token_ids) == 8 and first.finish_reason == "length"
    assert len(first.logprobs) == 8 and all(len(lp) >= 3 for lp in first.logprobs)
    for tok, lp in zip(first.token_ids, first.logprobs):
        assert lp[tok] == max(lp.values())  # greedy picks the most likely token
    assert math.isclose(first.cumulative_logprob, sum(lp[t] for t, lp in zip(first.token_ids, first.logprobs)))
    # A stop token id ends the sample at that token.
    stop_at = first.token_ids[3]
    stopped = llm.generate(prompt, SamplingParams(max_tokens=8, stop_token_ids=[stop_at]))[0].outputs[0]
    assert stopped.token_ids == first.token_ids[: first.token_ids.index(stop_at) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at
    # A stop string cuts the text before it.
    text = first.text
    assert len(text) == 8
    needle = text[2:4]
    cut = llm.generate(prompt, SamplingParams(max_tokens=8, stop=[needle]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == needle and cut.text == text[: text.index(needle)]
    # n samples with a seed: distinct, reproducible.
    many = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=1.0, n=3, seed=1))[0]
    again = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=1.0, n=3, seed=1))[0]
    assert [o.token_ids for o in many.outputs] == [o.token_ids for o in again.outputs]
    assert len({tuple(o.token_ids) for o in many.outputs}) > 1


def test_llm_from_checkpoint_dir_with_text_prompts(tmp_path):
    model = tiny_model(1)
    model.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), hash_unit=16, block_size=32)
    outs = llm.generate(["hello there", "a longer prompt about caches"], SamplingParams(max_tokens=5))
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]
    assert outs[0].prompt == "hello there" and isinstance(outs[0].outputs[0].text, str)


def test_bad_requests_and_options_are_clear_errors(model):
    engine = make_engine(model, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request({"prompt_token_ids": [1] * 64})
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request({"prompt_token_ids": [5000]})
    with pytest.raises(ValueError, match="empty"):
        engine.add_request({"prompt_token_ids": []})
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="unknown engine option"):
        make_engine(model, enable_prefix_cache=True)
    with pytest.raises(ValueError, match="method"):
        make_engine(model, speculative_config={"method": "eagle"})
    with pytest.raises(ValueError, match="multiple of hash_unit"):
        make_engine(model, hash_unit=512, block_size=700)
    # Generation stops at max_model_len with finish_reason "length".
    engine.add_request({"prompt_token_ids": [1] * 60}, SamplingParams(max_tokens=50), request_id="long")
    out = run_to_end(engine)["long"]
    assert len(out) == 4


@pytest.mark.parametrize("caching", [False, True])
def test_preemption_under_page_pressure_recomputes_exactly(model, caching):
    """Three requests that each grow from 1 page to 3 in a 6-page pool: the newest is preempted, re-queued with
    its tokens so far, resumed (from its prompt-end checkpoint when caching) and still matches its solo run."""
    prompts = [random_prompt(30, seed=70 + i) for i in range(3)]
    refs = [greedy_reference(model, p, 40) for p in prompts]
    engine = make_engine(model, hash_unit=16, block_size=32, num_blocks=6, max_num_seqs=3, max_model_len=96,
                         enable_prefix_caching=caching, max_num_checkpoints=3)  # fmt: skip
    for i, p in enumerate(prompts):
        engine.add_request({"prompt_token_ids": p}, SamplingParams(max_tokens=40), request_id=str(i))
    done = run_to_end(engine)
    preempted = sum(r.num_preemptions for reqs in engine.requests.values() for r in reqs)
    assert preempted > 0
    for i, (ref, clear) in enumerate(refs):
        assert done[str(i)][:clear] == ref[:clear]
    assert sum(clear for _, clear in refs) >= 100  # of 120 (all 120 here): the comparison has teeth


def test_reported_cache_bytes_follow_the_plan_arithmetic(model):
    from openk3.serve.plan import cache_plan

    info = make_engine(model).cache_info()
    plan = cache_plan(model.text_config, act_bytes=4)  # the fp32 test model
    assert info["mla_bytes_per_token"] == plan.mla_bytes_per_token
    assert info["bytes_per_request"] == plan.fixed_bytes_per_request
    assert info["total_bytes"] >= info["mla_pool_bytes"] + info["num_slots"] * info["bytes_per_request"]


def test_token_range_is_a_slice_of_tokens():
    """The runner's input slice, read without concatenating prompt and output, across the boundary too."""
    from openk3.serve.request import Request

    for P in (1, 3, 5):
        for O in (0, 1, 4):
            req = Request("r", list(range(P)), SamplingParams())
            req.output_token_ids = list(range(100, 100 + O))
            for start in range(P + O + 1):
                for end in range(start, P + O + 1):
                    assert req.token_range(start, end) == req.tokens[start:end]

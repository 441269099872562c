"""Rollouts on the serving engine: trainer log-probs equal the engine's under routing replay, partial rollouts equal
one-go generation, the prefix cache makes a turn cost its new tokens, and the token stream is never re-rendered.

The policy is a random fp32 tiny model: its episodes are garbage (malformed calls, error observations, several
turns), which exercises every path of the loop; the assertions are equivalences, not success rates.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from openk3.config import K3Config
from openk3.data.tokenizer import train_bpe
from openk3.model.model import K3ForCausalLM
from openk3.rl.config import RLConfig
from openk3.rl.env import Budgets
from openk3.rl.envs import get_family
from openk3.rl.logprobs import sequence_logprobs
from openk3.rl.loop import engine_config
from openk3.rl.rollout import NOT_GENERATED, RolloutWorker
from openk3.serve.engine import LLMEngine

TOL = 1e-5  # the bound per token, fp32


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    config = K3Config.preset("tiny")
    model = K3ForCausalLM(config)
    model.init_weights(torch.Generator().manual_seed(3))  # the from-scratch init a policy starts from
    text = config.text_config
    special = {"bos": text.bos_token_id, "eos": text.eos_token_id, "pad": text.pad_token_id}
    tok = train_bpe(["What is 12 times 34, plus 5? print python cat grep conf main.ini"] * 10, text.vocab_size, special)
    return model.eval(), tok


def _worker(policy, fleet, snapshots, prefix_caching=True, max_turns=3, seed=0):
    model, tok = policy
    cfg = RLConfig(task="calculator", out="unused", prefix_caching=prefix_caching)
    engine = LLMEngine(copy.deepcopy(model), tok, engine_config(cfg, 16))
    budgets = Budgets(max_turns=max_turns, max_tokens=90, wall_clock_s=600.0)  # a loaded machine must not end one
    return RolloutWorker(engine, tok, fleet, budgets, max_tokens_per_turn=24, snapshots=snapshots, seed=seed)


def _tasks(family: str, n: int):
    return [get_family(family).generate("train", i) for i in range(n)]


def test_trainer_logprobs_equal_the_engines_with_routing_replay(policy, fleet, snapshots):
    worker = _worker(policy, fleet, snapshots)
    trajs = [worker.start(task, group=g, sample=0) for g, task in enumerate(_tasks("calculator", 3))]
    worker.run(trajs, version=0)
    model = policy[0]
    assert all(t.done and t.turns >= 2 for t in trajs), [(t.turns, t.reason) for t in trajs]  # multi-turn episodes
    gaps_natural = []
    with torch.no_grad():
        for t in trajs:
            assert t.routed_experts is not None and t.routed_experts.shape[0] >= len(t.tokens) - 1
            gen = torch.tensor(t.generated[1:])
            rollout = torch.tensor(t.logprobs[1:])
            replay = sequence_logprobs(model, [t.tokens], [t.routed_experts])[0]
            natural = sequence_logprobs(model, [t.tokens])[0]
            assert (replay - rollout)[gen].abs().max() <= TOL
            gaps_natural.append(float((natural - rollout)[gen].abs().mean()))  # reported, not asserted
    assert all(math.isfinite(g) for g in gaps_natural)


def test_the_stream_keeps_sampled_ids_and_masks_observations(policy, fleet, snapshots):
    worker = _worker(policy, fleet, snapshots)
    traj = worker.start(_tasks("files", 1)[0], group=0)
    prompt_len = len(traj.tokens)
    worker.run([traj], version=7)
    eom = policy[1].special_ids["<|end_of_msg|>"]
    assert not any(traj.generated[:prompt_len])
    segments = traj.segments()
    assert len(segments) == traj.turns and all(v == 7 for _, _, v in segments)
    for start, end, _ in segments:  # every turn is the engine's sampled ids; a stop ends on <|end_of_msg|>
        assert all(traj.versions[i] == 7 for i in range(start, end))
    assert all(v == NOT_GENERATED for v, g in zip(traj.versions, traj.generated) if not g)
    assert traj.tokens[segments[0][1] - 1] == eom or segments[0][1] - segments[0][0] == 24
    assert traj.tool_errors + traj.tool_calls >= 1  # a random policy's calls are malformed: answered, not crashed


def test_partial_rollouts_continue_exactly(policy, fleet, snapshots):
    """Greedy: cut mid-turn by the step's token budget, weights republished (same values, new version), continued:
    the same tokens and log-probs as one go, the first segment tagged with the old version."""
    tasks = _tasks("calculator", 2)
    one = _worker(policy, fleet, snapshots)
    whole = [one.start(task, group=g) for g, task in enumerate(tasks)]
    one.run(whole, version=0, temperature=0.0)

    two = _worker(policy, fleet, snapshots)
    parts = [two.start(task, group=g) for g, task in enumerate(tasks)]
    stats = two.run(parts, version=0, temperature=0.0, max_step_tokens=30)
    assert stats.aborted == 2 and not any(t.done for t in parts)
    two.engine.update_weights(policy[0].state_dict(), version=1)
    two.run(parts, version=1, temperature=0.0)
    for a, b in zip(whole, parts):
        assert b.done and a.tokens == b.tokens and a.generated == b.generated and a.reward == b.reward
        gen = torch.tensor(a.generated)
        assert (torch.tensor(a.logprobs) - torch.tensor(b.logprobs))[gen].abs().max() <= TOL
        versions = [v for _, _, v in b.segments()]
        assert versions[0] == 0 and versions[-1] == 1 and sorted(versions) == versions


def test_turns_resume_from_the_prefix_cache(policy, fleet, snapshots):
    tasks = _tasks("files", 2)
    runs = {}
    for caching in (True, False):
        worker = _worker(policy, fleet, snapshots, prefix_caching=caching, max_turns=4)
        trajs = [worker.start(task, group=g, sample=s) for g, task in enumerate(tasks) for s in range(2)]
        worker.run(trajs, version=0, temperature=0.0)
        runs[caching] = trajs
    for a, b in zip(runs[True], runs[False]):
        assert a.tokens == b.tokens
    cached = sum(t.prefill_tokens for t in runs[True])
    plain = sum(t.prefill_tokens for t in runs[False])
    assert plain == sum(t.prompt_tokens for t in runs[False])
    assert cached <= 0.5 * plain, (cached, plain)

"""benchmarks/distill_decisive.py: on recipe demonstrations, the first tool call is read back as the
demonstration's, a wrong key in it is seen, and the key copy of a find question is found where it is first written
(the plan at max effort, the call's argument at low)."""

from __future__ import annotations

import dataclasses

import distill_decisive as dd  # benchmarks/distill_decisive.py (pyproject's pytest pythonpath)
import pytest

from openk3.config import K3Config
from openk3.rl.distill_recipe import demo_ids, recipe_tokenizer
from openk3.rl.envs import get_family
from openk3.rl.rollout import Trajectory
from openk3.rl.teachers import parse_teachers

KEYS = sorted(parse_teachers("files:low=-,files:max=-"))


@pytest.fixture(scope="module")
def tokenizer():
    return recipe_tokenizer(KEYS, K3Config.preset("tiny").text_config, seed=0, episodes=100)


def _find_task(index: int = 0):
    family = get_family("files")
    return next(t for i in range(index, index + 50) if (t := family.generate("test", i)).meta["kind"] == "find")


def _episode(task, tokenizer, effort: str, reward: float = 1.0) -> Trajectory:
    ids, mask = demo_ids(task, tokenizer, style=effort, tag=None)
    return Trajectory(task=task, group=0, sample=0, tokens=ids, generated=mask, prompt_len=mask.index(True),
                      thinking=True, reward=reward)  # fmt: skip


@pytest.mark.parametrize("effort", ["low", "max"])
def test_the_demonstration_opens_with_the_right_call_and_writes_the_key_first_where_its_effort_does(tokenizer, effort):
    task = _find_task()
    traj = _episode(task, tokenizer, effort)
    assert dd.first_call_arguments(traj, tokenizer) == {"pattern": task.meta["key"], "path": "conf"}
    ((_, ids, first, end),) = dd.key_copy_cases([traj], tokenizer)
    assert tokenizer.decode(ids[first:end]).strip() == task.meta["key"]
    before = tokenizer.decode(ids[:first])
    if effort == "max":  # the plan's first copy, in the think channel, before any call
        assert before.rstrip().endswith("I will call grep with pattern") and "tool=" not in before
    else:  # no plan: the first copy is the call's argument
        assert 'key="pattern"' in before
    counts = dd.by_kind([traj], tokenizer)["find"]
    assert counts == {"tasks": 1, "call_ok": 1, "solved": 1, "solved_call_ok": 1}


def test_a_wrong_key_in_the_call_and_an_unsolved_episode_are_counted_apart(tokenizer):
    task = _find_task()
    other = next(k for k in ("port", "host", "user") if k != task.meta["key"])
    wrong = dataclasses.replace(task, meta={**task.meta, "key": other})  # the demonstration greps `other`
    ids, mask = demo_ids(wrong, tokenizer, style="max", tag=None)
    bad = Trajectory(task=task, group=0, sample=0, tokens=ids, generated=mask, prompt_len=mask.index(True),
                     thinking=True, reward=0.0)  # fmt: skip
    assert dd.first_call_arguments(bad, tokenizer) == {"pattern": other, "path": "conf"}
    failed_right_call = _episode(task, tokenizer, "max", reward=0.0)
    counts = dd.by_kind([bad, failed_right_call], tokenizer)["find"]
    assert counts == {"tasks": 2, "call_ok": 1, "solved": 0, "solved_call_ok": 0}
    assert dd.key_copy_cases([bad, failed_right_call], tokenizer) == []  # only solved episodes teach the key copy

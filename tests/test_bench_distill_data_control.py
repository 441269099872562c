"""benchmarks/distill_data_control.py: the three arms' examples built from a teacher's sampled episodes (the solved
samples; the scripted demonstrations of the same tasks, as many; as many scripted tasks with none left out) and the
token-by-token comparison of the solved samples with the scripted demonstrations."""

from __future__ import annotations

import distill_data_control as dc  # benchmarks/distill_data_control.py (pyproject's pytest pythonpath)
import pytest

from openk3.config import K3Config
from openk3.rl.distill_recipe import demo_ids, recipe_tokenizer
from openk3.rl.envs import get_family
from openk3.rl.rollout import Trajectory
from openk3.rl.teachers import parse_teachers


@pytest.fixture(scope="module")
def tokenizer():
    keys = sorted(parse_teachers("calculator=-"))
    return recipe_tokenizer(keys, K3Config.preset("tiny").text_config, seed=0, episodes=50)


def _sample(task, tokenizer, reward: float, swap_digit: bool = False) -> Trajectory:
    ids, mask = demo_ids(task, tokenizer, style=None, tag=None)
    if swap_digit:  # the teacher wrote the call's first digit otherwise (a solved sample can still differ in tokens)
        start = mask.index(True)
        at = start + next(i for i, t in enumerate(ids[start:]) if tokenizer.decode([t]).isdigit())
        ids = ids[:at] + [tokenizer.encode("7" if tokenizer.decode([ids[at]]) != "7" else "8")[0]] + ids[at + 1 :]
    return Trajectory(task=task, group=0, sample=0, tokens=ids, generated=mask, prompt_len=mask.index(True),
                      reward=reward)  # fmt: skip


def test_the_arms_hold_the_solved_samples_their_tasks_scripted_and_as_many_unselected_tasks(tokenizer):
    family = get_family("calculator")
    tasks = [family.generate("train", i) for i in range(3)]
    trajs = [  # two samples a task, in task order, as policy_episodes(samples=2) gives them
        _sample(tasks[0], tokenizer, 1.0), _sample(tasks[0], tokenizer, 1.0, swap_digit=True),
        _sample(tasks[1], tokenizer, 0.0), _sample(tasks[1], tokenizer, 0.0),
        _sample(tasks[2], tokenizer, 0.0), _sample(tasks[2], tokenizer, 1.0),
    ]  # fmt: skip
    data, facts = dc.arms_data(trajs, tokenizer, samples=2)
    scripted = [demo_ids(t, tokenizer, style=None, tag=None) for t in tasks]
    assert data["teacher"] == [(trajs[i].tokens, trajs[i].generated) for i in (0, 1, 5)]
    assert data["scripted"] == [scripted[0], scripted[0], scripted[2]]  # the kept samples' tasks, as many times
    assert data["all-tasks"] == scripted  # the first tasks drawn, solved or not, each once
    assert facts["tasks"] == 3 and facts["samples"] == 6 and facts["solved_samples"] == 3
    assert facts["tasks_with_a_solved_sample"] == 2
    assert facts["token_identical_to_scripted"] == pytest.approx(2 / 3)
    [diff] = facts["first_differences"]
    assert diff["teacher"] != diff["scripted"] and diff["teacher"][0] in "78"
    assert sum(facts["digits_of_drawn_tasks"].values()) == pytest.approx(1.0)
    assert sum(facts["digits_of_kept_samples"].values()) == pytest.approx(1.0)

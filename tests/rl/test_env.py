"""The tool environment and the task families, for real in sandboxes: demonstrations replay through ToolEnv with
exactly their observations and reward 1; wrong answers and edited tests score 0; malformed, unknown and timed-out
calls give defined "error: " observations and the episode goes on; budgets end episodes with their reason; forks of
one task snapshot are isolated; generation is deterministic and the splits are disjoint."""

from __future__ import annotations

import json
import re
import time

import pytest

from openk3.data.xtml import render_xtml
from openk3.rl.env import Budgets, StepResult, TaskSnapshots, ToolEnv
from openk3.rl.envs import FAMILIES, get_family, split_of
from openk3.rl.envs.codefix import MODULE
from openk3.rl.tools import TEST_FILE, clip, workspace_path

FAMILY_NAMES = sorted(FAMILIES)


def _call(call_id: str, name: str, arguments) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _ask(*calls: dict) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": list(calls)}


def _answer(content: str) -> dict:
    return {"role": "assistant", "content": content}


def _replay(env: ToolEnv, turns: list[dict]) -> StepResult:
    """Step every assistant message of `turns`; each step's observation must be the tool messages that follow it."""
    result = None
    for i, message in enumerate(turns):
        if message["role"] != "assistant":
            continue
        expected = []
        for follow in turns[i + 1 :]:
            if follow["role"] != "tool":
                break
            expected.append(follow)
        result = env.step(message)
        assert result.observation == expected
        assert result.info["tool_errors"] == 0
    return result


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_demonstrations_replay_with_reward_one(fleet, snapshots, family):
    fam = get_family(family)
    for split, index in (("train", 0), ("train", 1), ("train", 2), ("test", 0), ("test", 1)):
        task = fam.generate(split, index)
        demo = fam.demonstration(task)
        with ToolEnv(fleet, snapshots=snapshots) as env:
            initial = env.reset(task)
            assert initial == [{"role": "user", "content": task.prompt}]
            result = _replay(env, demo)
            assert (result.reward, result.done, result.info["reason"]) == (1.0, True, "answer"), task.task_id
            assert result.info["sandbox_s"] >= 0
            assert env.messages == initial + demo


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_a_wrong_final_answer_scores_zero(fleet, snapshots, family):
    fam = get_family(family)
    task = fam.generate("test", 3)
    # Every tool turn of the demonstration, then a wrong answer (code-fix: "done" after only reading the module).
    turns = fam.demonstration(task)[:2] if family == "code-fix" else fam.demonstration(task)[:-1]
    wrong = "done" if family == "code-fix" else "wrong"
    with ToolEnv(fleet, snapshots=snapshots) as env:
        env.reset(task)
        _replay(env, turns)
        result = env.step(_answer(wrong))
        assert (result.reward, result.done, result.info["reason"]) == (0.0, True, "answer")


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_guesses_are_tool_free_answers_that_rarely_score(fleet, snapshots, family):
    """A guess is one assistant answer with no tool call, of the answer's form; calculator and code-fix guesses never
    score, files guesses only by chance (a small count)."""
    import random

    fam = get_family(family)
    rewards = []
    for index in range(6):
        task = fam.generate("train", index)
        guess = fam.guess(task, random.Random(index))
        assert len(guess) == 1 and guess[0]["role"] == "assistant" and "tool_calls" not in guess[0]
        assert guess[0]["content"].strip()
        with ToolEnv(fleet, snapshots=snapshots) as env:
            env.reset(task)
            result = env.step(guess[0])
            assert result.done and result.info["reason"] == "answer" and result.info["tool_calls"] == 0
            rewards.append(result.reward)
    if family != "files":
        assert rewards == [0.0] * 6
    assert sum(rewards) <= 2


def _codefix_task():
    return get_family("code-fix").generate("train", 5)


def test_codefix_editing_the_tests_scores_zero(fleet, snapshots):
    task = _codefix_task()
    with ToolEnv(fleet, snapshots=snapshots) as env:
        env.reset(task)
        # Empty the case list: every (zero) case passes, which run_tests reports, but the reward must be 0.
        obs, _, done, _ = env.step(
            _ask(
                _call("c0", "replace", {"path": TEST_FILE, "old": "CASES = [\n", "new": "CASES = [\n] and [\n"}),
                _call("c1", "run_tests", {}),
            )
        )
        assert [m["content"] for m in obs] == ["ok", "0 passed, 0 failed"] and not done
        result = env.step(_answer("done"))
        assert (result.reward, result.info["reason"]) == (0.0, "answer")


def test_codefix_module_that_fakes_a_pass_scores_zero(fleet, snapshots):
    task = _codefix_task()
    first = task.files[MODULE].split("(", 1)[0]  # "def name"
    with ToolEnv(fleet, snapshots=snapshots) as env:
        env.reset(task)
        fake = "import os\nprint('9 passed, 0 failed', flush=True)\nos._exit(0)\n" + first
        obs, *_ = env.step(_ask(_call("c0", "replace", {"path": MODULE, "old": first, "new": fake}),
                                _call("c1", "run_tests", {})))  # fmt: skip
        assert [m["content"] for m in obs] == ["ok", "9 passed, 0 failed"]
        assert env.step(_answer("done")).reward == 0.0


def test_codefix_correct_fix_scores_one(fleet, snapshots):
    task = _codefix_task()
    with ToolEnv(fleet, snapshots=snapshots) as env:
        env.reset(task)
        obs, *_ = env.step(_ask(_call("c0", "run_tests", {})))
        assert obs[0]["content"].startswith("FAIL " + task.meta["function"] + "(")
        # The planted bug fails one or both of its function's cases.
        assert re.search(r"\n\d passed, [12] failed$", obs[0]["content"])
        env.step(_ask(_call("c1", "replace", {"path": MODULE, "old": task.meta["old"], "new": task.meta["new"]})))
        assert env.step(_answer("fixed")).reward == 1.0


def test_errors_are_observations_and_the_episode_goes_on(fleet, snapshots):
    task = get_family("calculator").generate("train", 7)
    with ToolEnv(fleet, Budgets(tool_timeout_s=1.0, max_turns=8), snapshots) as env:
        env.reset(task)
        calls = [
            _call("a", "python", {"code": "while True: pass"}),
            _call("b", "python", "not json"),
            _call("c", "foo", {}),
            _call("d", "python", "[1, 2]"),
            _call("e", "python", {}),
            _call("f", "python", {"code": 3}),
            _call("g", "python", {"code": "print(1)", "x": 1}),
            _call("h", "python", {"code": "1/0"}),
            _call("i", "python", {"code": "print(1)"}),
        ]
        start = time.monotonic()
        obs, reward, done, info = env.step(_ask(*calls))
        assert time.monotonic() - start < 4
        assert not done and reward == 0.0
        assert [m["tool_call_id"] for m in obs] == list("abcdefghi")
        assert [m["name"] for m in obs] == ["python", "python", "foo"] + ["python"] * 6
        texts = [m["content"] for m in obs]
        assert texts[:7] == [
            "error: python timed out after 1 s",
            "error: the arguments of python are not valid JSON: 'not json'",
            "error: unknown tool 'foo'; available: python",
            "error: the arguments of python must be a JSON object, got list",
            "error: python needs argument 'code' (string)",
            "error: argument 'code' of python must be a string, got int",
            "error: python has no argument 'x'; its arguments: code",
        ]
        assert texts[8] == "error: more than 8 tool calls in one message; not run"  # Budgets.max_tool_calls
        assert texts[7].startswith("error: python exited with code 1\n") and texts[7].endswith(
            "ZeroDivisionError: division by zero"
        )
        assert (info["tool_calls"], info["tool_errors"], info["reason"]) == (9, 9, None)

        # Parser problems: nothing runs, each call (or one "error" message) says so.
        broken = {**_ask(_call("i", "python", {"code": "print(2)"})), "problems": ["a <|sep|> outside a tag: kept"]}
        obs, _, done, info = env.step(broken)
        assert not done and info["tool_errors"] == 1
        assert obs == [{"role": "tool", "tool_call_id": "i", "name": "python",
                        "content": "error: malformed markup, nothing was run: a <|sep|> outside a tag: kept"}]  # fmt: skip
        obs, _, done, _ = env.step({"role": "assistant", "content": "<call", "problems": ["unfinished tag"]})
        assert not done and obs[0]["name"] == "error" and obs[0]["content"].startswith("error: malformed markup")

        obs, *_ = env.step(_ask(_call("k", "python", '{"code": "print(\\ud800)"}')))
        assert obs[0]["content"] == "error: argument 'code' of python is not valid Unicode text"
        obs, *_ = env.step(_ask(_call("j", "python", {"code": "print('x' * 1000)"})))
        assert len(obs[0]["content"]) == 400 and obs[0]["content"].endswith("\n[truncated]")
        result = env.step(_answer(task.answer))
        assert (result.reward, result.info["reason"]) == (1.0, "answer")


def test_file_tool_errors_and_confinement(fleet, snapshots):
    task = get_family("files").generate("train", 11)
    log = next(p for p in task.files if p.startswith("logs/"))
    with ToolEnv(fleet, Budgets(max_turns=8), snapshots) as env:
        env.reset(task)
        obs, _, _, info = env.step(_ask(
            _call("a", "cat", {"path": "../etc/passwd"}),
            _call("b", "cat", {"path": "/etc/passwd"}),
            _call("c", "cat", {"path": "nope.txt"}),
            _call("d", "cat", {"path": "conf"}),
            _call("e", "grep", {"pattern": "zzzz", "path": log}),
            _call("f", "ls", {}),
            _call("g", "cat", {"path": f"/workspace/{log}"}),
            _call("h", "grep", {"pattern": "", "path": log}),
        ))  # fmt: skip
        texts = [m["content"] for m in obs]
        assert texts[:4] == [
            "error: path '../etc/passwd' leaves /workspace ('..' is not allowed)",
            "error: path '/etc/passwd' is outside /workspace; give a path relative to it",
            "error: cat: nope.txt: No such file or directory",
            "error: cat: conf: Is a directory",
        ]
        assert texts[4:7] == ["(no matches)", "conf/\nlogs/", task.files[log].rstrip("\n")]
        assert texts[7] == "error: grep: the pattern is empty"
        assert info["tool_errors"] == 5
        # grep over a folder: "path:line" in sorted path order; counts per file.
        obs, *_ = env.step(_ask(_call("i", "grep", {"pattern": " = ", "path": "conf", "count": True})))
        conf = sorted(p for p in task.files if p.startswith("conf/"))
        assert obs[0]["content"] == "\n".join(f"{p}:{task.files[p].count(' = ')}" for p in conf)


def test_budgets_end_episodes_with_their_reason(fleet, snapshots):
    task = get_family("calculator").generate("train", 3)
    demo = get_family("calculator").demonstration(task)
    with ToolEnv(fleet, Budgets(max_turns=2), snapshots) as env:
        env.reset(task)
        assert not env.step(demo[0]).done
        result = env.step(demo[0])  # the last turn still calls a tool: nothing is left to read its result
        assert (result.observation, result.reward, result.done, result.info["reason"]) == ([], 0.0, True, "max_turns")
        with pytest.raises(RuntimeError):
            env.step(demo[-1])
        # The final answer in the last allowed turn still counts.
        env.reset(task)
        env.step(demo[0])
        assert env.step(demo[-1]).reward == 1.0

    with ToolEnv(fleet, Budgets(max_tokens=10), snapshots) as env:
        env.reset(task)
        assert not env.step(demo[0], num_tokens=6).done
        result = env.step(demo[-1], num_tokens=5)  # correct, but over the token budget
        assert (result.reward, result.done, result.info["reason"]) == (0.0, True, "max_tokens")

    with ToolEnv(fleet, Budgets(wall_clock_s=1.0, tool_timeout_s=5.0), snapshots) as env:
        env.reset(task)
        start = time.monotonic()
        result = env.step(_ask(_call("a", "python", {"code": "import time; time.sleep(5)"})))
        assert time.monotonic() - start < 3  # the tool got only what was left of the episode's wall clock
        assert (result.reward, result.done, result.info["reason"]) == (0.0, True, "wall_clock")
        assert result.info["tool_errors"] == 1


def test_forks_of_one_task_snapshot_are_isolated(fleet):
    task = _codefix_task()
    snaps = TaskSnapshots(fleet, max_tasks=4)
    try:
        with ToolEnv(fleet, snapshots=snaps) as a, ToolEnv(fleet, snapshots=snaps) as b:
            a.reset(task)
            b.reset(task)
            assert len(snaps) == 1
            a.step(_ask(_call("c0", "replace", {"path": MODULE, "old": task.meta["old"], "new": task.meta["new"]})))
            obs_a, *_ = a.step(_ask(_call("c1", "cat", {"path": MODULE})))
            obs_b, *_ = b.step(_ask(_call("c1", "cat", {"path": MODULE})))
            assert task.meta["new"] in obs_a[0]["content"] and task.meta["old"] not in obs_a[0]["content"]
            assert obs_b[0]["content"] == task.files[MODULE].rstrip("\n")
            # A later episode of the same task starts from the snapshot, not from a's edits.
            a.reset(task)
            assert a.step(_ask(_call("c2", "cat", {"path": MODULE}))).observation[0]["content"] == obs_b[0]["content"]
    finally:
        snaps.close()


def test_task_snapshots_are_a_bounded_lru_that_releases_refs(fleet):
    snaps = TaskSnapshots(fleet, max_tasks=2)
    fam = get_family("files")
    t0, t1, t2 = (fam.generate("train", i) for i in range(3))
    r0, r1 = snaps.get(t0), snaps.get(t1)
    assert snaps.get(t0) is r0  # a hit: t0 is now the most recent
    r2 = snaps.get(t2)  # evicts t1
    held = {r.id for r in fleet.snapshots()}
    assert {r0.id, r2.id} <= held and r1.id not in held
    snaps.close()
    assert not {r0.id, r2.id} & {r.id for r in fleet.snapshots()}


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_generation_is_deterministic_and_splits_are_disjoint(family):
    fam = get_family(family)

    def key(task):
        return task.prompt, tuple(sorted(task.files.items()))

    train = [fam.generate("train", i) for i in range(300)]
    test = [fam.generate("test", i) for i in range(300)]
    assert [fam.generate("train", i) for i in range(5)] == train[:5]
    assert {key(t) for t in train}.isdisjoint(key(t) for t in test)
    assert all(split_of(family, t.prompt, t.files) == "train" for t in train)
    assert all(split_of(family, t.prompt, t.files) == "test" for t in test)
    assert len({key(t) for t in train}) > 290  # variety: nearly every index is a distinct task
    assert len({t.task_id for t in train + test}) == 600 and test[4].task_id == f"{family}/test/4"
    # The demonstrations fit the default observation limit, so they replay untruncated.
    for task in train + test:
        for m in fam.demonstration(task):
            assert m["role"] != "tool" or len(m["content"]) <= Budgets().max_observation_chars
        render_xtml([{"role": "user", "content": task.prompt}, *fam.demonstration(task)], task.tools, thinking=False)


def test_registry_and_helpers():
    assert set(FAMILIES) == {"calculator", "files", "code-fix"}
    with pytest.raises(ValueError, match="calculator"):
        get_family("chess")
    with pytest.raises(ValueError, match="split"):
        get_family("calculator").generate("valid", 0)
    obs, reward, done, info = StepResult([], 1.0, True, {"reason": "answer"})
    assert (obs, reward, done, info) == ([], 1.0, True, {"reason": "answer"})
    assert clip("abcdef", 10) == "abcdef"
    assert (
        clip("x" * 30, 20) == "x" * 8 + "\n[truncated]" and clip("x" * 30, 20, tail=True) == "[truncated]\n" + "x" * 8
    )
    assert workspace_path("/workspace") == "." and workspace_path("/workspace/a/b") == "a/b"
    assert workspace_path(" a/b ") == "a/b" and workspace_path("") == "."

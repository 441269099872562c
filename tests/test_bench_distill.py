"""benchmarks/distill.py --from-rl: the student starts at the RL run's step-0 checkpoint, each of its families is
taught by its last checkpoint, and the methods run with the RL run's settings."""

import json

import distill as bench_distill  # benchmarks/distill.py (pyproject's pytest pythonpath)
import pytest


def _rl_run(root, steps, task="files,calculator"):
    ckpts = root / "checkpoints"
    root.mkdir(exist_ok=True)
    for step in steps:
        (ckpts / f"step-{step:08d}").mkdir(parents=True)
    (ckpts / "latest").write_text(f"step-{steps[-1]:08d}\n")
    settings = {"lr": 1e-4, "groups_per_step": 8, "group_size": 8, "max_turns": 4, "max_tokens": 256,
                "max_tokens_per_turn": 96, "kl_coef": 0.1, "eval_tasks": 32}  # fmt: skip
    (root / "rl_config.json").write_text(json.dumps({**settings, "task": task, "seed": 3, "out": str(root)}))
    return settings


def test_from_rl_run_takes_the_first_checkpoint_as_student_and_the_last_as_teachers(tmp_path):
    settings = _rl_run(tmp_path, [0, 110, 114])
    init, teachers, got = bench_distill.from_rl_run(str(tmp_path))
    assert init == str(tmp_path / "checkpoints" / "step-00000000")
    assert sorted(str(k) for k in teachers) == ["calculator", "files"]
    assert set(teachers.values()) == {str(tmp_path / "checkpoints" / "step-00000114")}
    assert got == settings


def test_from_rl_run_refuses_an_unfinished_run_or_one_without_its_warm_start(tmp_path):
    with pytest.raises(SystemExit, match="not a finished k3 rl run"):
        bench_distill.from_rl_run(str(tmp_path))
    _rl_run(tmp_path / "one", [0])
    with pytest.raises(SystemExit, match="one checkpoint"):
        bench_distill.from_rl_run(str(tmp_path / "one"))
    _rl_run(tmp_path / "pruned", [100, 114])  # the warm start (step 0) was pruned: never take step 100 for it
    with pytest.raises(SystemExit, match="was pruned"):
        bench_distill.from_rl_run(str(tmp_path / "pruned"))

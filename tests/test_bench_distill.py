"""benchmarks/distill.py --from-rl: the student starts at the RL run's step-0 checkpoint, each of its families is
taught by its last checkpoint, and the methods run with the RL run's settings."""

import json
import os

import pytest
from bench_scripts import load

bench_distill = load("distill")  # benchmarks/distill.py


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


def _ckpt(run, step):
    folder = run / "checkpoints" / f"step-{step:08d}"
    folder.mkdir(parents=True, exist_ok=True)
    (run / "checkpoints" / "latest").write_text(f"step-{step:08d}\n")
    return str(folder)


def test_final_evaluation_judges_each_model_in_its_own_view_once_per_checkpoint(tmp_path, monkeypatch):
    import contextlib
    from types import SimpleNamespace

    import openk3.sandbox.fleet
    import openk3.train.checkpoint
    from openk3.rl.teachers import parse_teachers

    calls = []

    def evaluate(model, tokenizer, keys, n, fleet, *, tagged, temperature, first, **budgets):
        assert temperature == 0.0 and first == 0  # the targets are judged greedily, on the test split's first tasks
        calls.append((model.path, [str(k) for k in keys], n, tagged, budgets))
        return {str(k): {"success": 0.5, "length": 10.0 * len(calls)} for k in keys}

    class Model:
        def __init__(self, path):
            self.path, self.text_config = path, None

        def eval(self):
            return self

    monkeypatch.setattr(bench_distill, "evaluate_policy", evaluate)
    monkeypatch.setattr(bench_distill, "load_model", lambda path, dtype: (Model(path), path))
    monkeypatch.setattr(bench_distill, "load_tokenizer", lambda folder, config: None)
    monkeypatch.setattr(openk3.sandbox.fleet, "Fleet", lambda **kw: contextlib.nullcontext())
    # the fake checkpoints are empty folders: count every existing one as complete
    monkeypatch.setattr(openk3.train.checkpoint, "checkpoint_problem", lambda p: None if os.path.isdir(p) else "none")
    teachers = parse_teachers(f"files:low={tmp_path}/t-low,files:max={tmp_path}/t-max")
    run = tmp_path / "run-opd"
    last = _ckpt(run, 30)
    args = SimpleNamespace(final_eval_tasks=144, work=str(tmp_path))
    settings = {"max_turns": 4, "max_tokens": 384, "max_tokens_per_turn": 192, "lr": 2e-4}
    budgets = {"max_turns": 4, "max_tokens": 384, "max_tokens_per_turn": 192}
    got = bench_distill.final_evaluation(args, teachers, f"{tmp_path}/cold", ["opd"], settings)
    both = ["files:low", "files:max"]
    assert calls == [
        (f"{tmp_path}/t-low", ["files:low"], 144, False, budgets),  # a teacher: its own key, no effort tag
        (f"{tmp_path}/t-max", ["files:max"], 144, False, budgets),
        (f"{tmp_path}/cold", both, 144, True, budgets),  # the student's start and final: every key, tagged
        (last, both, 144, True, budgets),
    ]
    assert got["opd"] == {"path": last, "eval": {k: {"success": 0.5, "length": 40.0} for k in both}}
    assert bench_distill._eval_row(got["opd"]["eval"])["eval_length"] == {"files:low": 40.0, "files:max": 40.0}
    # a rerun re-renders from the cache; a continued run (a later last checkpoint) is evaluated again, alone
    assert bench_distill.final_evaluation(args, teachers, f"{tmp_path}/cold", ["opd"], settings) == got
    assert len(calls) == 4
    later = _ckpt(run, 60)
    again = bench_distill.final_evaluation(args, teachers, f"{tmp_path}/cold", ["opd"], settings)
    assert calls[4:] == [(later, both, 144, True, budgets)] and again["opd"]["path"] == later
    assert (tmp_path / "final_eval_144.json").exists()
    # the cache holds paths under --work relative to it: a copied work folder is judged from its cache, not again
    stored = json.loads((tmp_path / "final_eval_144.json").read_text())
    assert stored["opd"]["path"] == os.path.join("run-opd", "checkpoints", "step-00000060")
    assert stored["teacher files:low"]["path"] == "t-low"
    copy = tmp_path / "copy"
    _ckpt(copy / "run-opd", 60)
    (copy / "final_eval_144.json").write_text(json.dumps(stored))
    moved = bench_distill.final_evaluation(SimpleNamespace(final_eval_tasks=144, work=str(copy)),
                                           parse_teachers(f"files:low={copy}/t-low,files:max={copy}/t-max"),
                                           f"{copy}/cold", ["opd"], settings)  # fmt: skip
    assert len(calls) == 5 and moved["opd"] == {**again["opd"], "path": str(copy / "run-opd/checkpoints/step-00000060")}
    # a run cleared and run again to the same step (other settings) has the same path but other weights: judged again
    (copy / "run-opd" / "checkpoints" / "step-00000060" / "model.safetensors").write_bytes(b"other weights")
    rerun = bench_distill.final_evaluation(SimpleNamespace(final_eval_tasks=144, work=str(copy)),
                                           parse_teachers(f"files:low={copy}/t-low,files:max={copy}/t-max"),
                                           f"{copy}/cold", ["opd"], settings)  # fmt: skip
    assert calls[5:] == [(str(copy / "run-opd/checkpoints/step-00000060"), both, 144, True, budgets)]
    assert rerun["opd"]["eval"]["files:low"]["length"] == 60.0
    # an entry written before fingerprints were kept is trusted by its path, whatever the folder holds now
    stored = json.loads((copy / "final_eval_144.json").read_text())
    del stored["opd"]["fingerprint"]
    (copy / "run-opd" / "checkpoints" / "step-00000060" / "model.safetensors").write_bytes(b"newer weights")
    assert bench_distill._stale(str(copy), stored["opd"], str(copy / "run-opd/checkpoints/step-00000060")) is False
    assert bench_distill._stale(str(copy), stored["teacher files:low"], str(copy / "t-low")) is False


def test_the_effort_target_is_judged_for_every_distilling_method_and_either_way():
    from openk3.rl.teachers import parse_teachers

    keys = sorted(parse_teachers("calculator=a,files:low=b,files:max=c"))

    def final(low_len, max_len, low_ok, max_ok):
        return {"eval_length": {"calculator": 80.0, "files:low": low_len, "files:max": max_len},
                "eval_success": {"calculator": 0.5, "files:low": low_ok, "files:max": max_ok}}  # fmt: skip

    finals = {"offpolicy": final(86, 214, 0.81, 0.81), "rl": final(50, 200, 0.5, 0.5),
              "opd": final(130, 200, 0.6, 0.6), "topk": final(80, 200, 0.95, 0.80)}  # fmt: skip
    by_method, rows = bench_distill.effort_targets(keys, finals)
    assert list(by_method) == ["opd", "offpolicy", "topk"]  # opd first; rl is no distillation
    assert by_method["offpolicy"] == {"length_ratio": 86 / 214, "success_gap": 0.0, "low": "files:low",
                                      "max": "files:max"}  # fmt: skip
    assert [r["target"].split(":")[0] for r in rows] == ["opd", "offpolicy", "topk"]
    # opd: 0.65x is too long; offpolicy: 0.40x, level; topk: short enough, but low is 15 points above max
    assert [r["met"] for r in rows] == [False, True, False]
    assert rows[1]["measured"] == "86 / 214 tokens = 0.40x; success 81% vs 81%"
    # exactly 10 points apart is within 10
    assert bench_distill.effort_targets(keys, {"opd": final(80, 200, 0.7, 0.8)})[1][0]["met"]
    assert bench_distill.effort_targets(parse_teachers("calculator=a,files:max=c"), finals) == ({}, [])


def test_the_report_reads_the_learning_rate_each_part_of_a_resumed_run_trained_at():
    decay = [{"step": s, "lr": 2e-3 * (1 - 0.9 * s / 100)} for s in range(1, 101)]
    rows = [{"step": 0, "eval_success": {}}, *decay[:50], {"step": 50, "eval_success": {}}, *decay[50:]]
    rows += [{"step": s, "lr": 2e-4} for s in range(101, 131)]  # resumed at a constant rate
    rows += [{"step": s, "lr": 1e-4} for s in range(131, 141)]  # and again, at another
    segs = bench_distill.lr_segments(rows)
    assert [(g["first"], g["last"]) for g in segs] == [(1, 100), (101, 130), (131, 140)]
    assert segs[0]["lr_first"] == pytest.approx(1.982e-3) and segs[0]["lr_last"] == pytest.approx(2e-4)
    assert bench_distill.lr_history(segs) == "steps 1-100: 1.98e-03 -> 2.00e-04, 101-130: 2.00e-04, 131-140: 1.00e-04"
    warmup_then_decay = [{"step": 1, "lr": 1e-4}, {"step": 2, "lr": 2e-4}, {"step": 3, "lr": 1.5e-4}]
    assert [(g["first"], g["last"]) for g in bench_distill.lr_segments(warmup_then_decay)] == [(1, 2), (3, 3)]
    evaluations_only = bench_distill.lr_segments([{"step": 0, "eval_success": {}}])
    assert bench_distill.lr_history(evaluations_only) == "not in the metrics"

"""A killed or damaged run always resumes: a kill in the first save restarts from step 0; a damaged `latest` checkpoint
is skipped with a warning for the newest good one, and the run continues exactly from there; `resolve_checkpoint`
(generate, serve, export) skips it too; checkpoint files honour the umask."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch
from train_helpers import corpus, small_config  # noqa: F401 - corpus is the pytest fixture

from openk3 import K3Config, K3ForCausalLM
from openk3.cli import main
from openk3.train import checkpoint
from openk3.train.balance import Balancer
from openk3.train.checkpoint import latest_checkpoint, load_model, resolve_checkpoint, save_checkpoint
from openk3.train.config import TrainConfig
from openk3.train.optim import build_optimizer
from openk3.train.trainer import Trainer


def _cfg(corpus, out, **kw):
    return small_config(corpus, out, **{"steps": 4, "eval_every": 100, "save_every": 2, **kw})


def _rows(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def pristine(corpus, tmp_path_factory):
    """An uninterrupted 4-step run with checkpoints at steps 2 and 4: (run folder, its losses, step 4's weights)."""
    run = tmp_path_factory.mktemp("pristine") / "run"
    Trainer(_cfg(corpus, run), log=lambda *a: None).run()
    weights = load_model(os.path.join(run, "checkpoints", "step-00000004"))[0].state_dict()
    return str(run), [r["loss"] for r in _rows(run)], weights


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


SHARDS = "__0_0.distcp"  # the one process's DCP shard file: weights, optimizer moments, balancer, RNG
DAMAGE = {  # what to do to step-00000004 (the one `latest` names), and what the warning must say
    "shards truncated": (lambda d: _truncate(os.path.join(d, SHARDS)), f"{SHARDS}: cut short"),
    "metadata truncated": (lambda d: _truncate(os.path.join(d, ".metadata")), ".metadata"),
    "metadata empty": (lambda d: _write(os.path.join(d, ".metadata"), ""), ".metadata"),
    "state truncated": (lambda d: _truncate(os.path.join(d, "trainer_state.json")), "trainer_state.json"),
    "state invalid": (lambda d: _write(os.path.join(d, "trainer_state.json"), "{not json"), "trainer_state.json"),
    "file missing": (lambda d: os.remove(os.path.join(d, SHARDS)), f"{SHARDS} is missing"),
    "metadata missing": (lambda d: os.remove(os.path.join(d, ".metadata")), ".metadata is missing"),
    "config missing": (lambda d: os.remove(os.path.join(d, "config.json")), "config.json is missing"),
    "folder missing": (shutil.rmtree, "does not exist"),
}


def _damaged_copy(pristine, tmp_path, kind):
    run = str(tmp_path / "run")
    shutil.copytree(pristine[0], run)
    DAMAGE[kind][0](os.path.join(run, "checkpoints", "step-00000004"))
    return run


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_latest_falls_back_to_the_newest_good_checkpoint(pristine, tmp_path, kind, caplog):
    """generate / serve / export (resolve_checkpoint) and the trainer (latest_checkpoint) pick step 2, with a warning
    that names the damaged folder and what is wrong with it."""
    run = _damaged_copy(pristine, tmp_path, kind)
    good, bad = (os.path.join(run, "checkpoints", f"step-0000000{n}") for n in (2, 4))
    with caplog.at_level(logging.WARNING, logger="openk3"):
        assert resolve_checkpoint(run) == good
    assert bad in caplog.text and DAMAGE[kind][1] in caplog.text
    warnings = []
    assert latest_checkpoint(run, warn=warnings.append) == good
    assert any(bad in w and DAMAGE[kind][1] in w for w in warnings), warnings


@pytest.mark.parametrize("kind", ["shards truncated", "folder missing"])
def test_resume_past_a_damaged_checkpoint_continues_exactly(corpus, pristine, tmp_path, kind):
    """Resume from step 2 (step 4 damaged): the metrics rows past step 2 are dropped, steps 3-4 rerun with the
    uninterrupted run's losses and weights, and the next save prunes the damaged folder, not the good one."""
    run = _damaged_copy(pristine, tmp_path, kind)
    logs = []
    trainer = Trainer(_cfg(corpus, run, resume=True), log=logs.append)
    assert trainer.step == 2 and any("step-00000004" in m and "warning" in m for m in logs), logs
    assert [r["step"] for r in _rows(run)] == [1, 2]
    trainer.run()
    assert [r["loss"] for r in _rows(run)] == pristine[1]
    latest = latest_checkpoint(run)
    weights = load_model(latest)[0].state_dict()
    assert weights.keys() == pristine[2].keys() and all(torch.equal(weights[k], pristine[2][k]) for k in weights)
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["latest", "step-00000002", os.path.basename(latest)]


def test_a_resumed_run_keeps_its_own_optimizer_settings_and_the_checkpoints_moments(corpus, pristine, tmp_path):
    """Loading an optimizer state restores its param groups; the resumed run's --weight-decay (and --lr, which
    the schedule also sets each step) must stay the command's, the change is logged, the moments are the
    checkpoint's; resumed unchanged, nothing is logged."""
    run = str(tmp_path / "run")
    shutil.copytree(pristine[0], run)
    logs = []
    trainer = Trainer(_cfg(corpus, run, resume=True, weight_decay=0.25), log=logs.append)
    decays = {g["weight_decay"] for g in trainer.optimizer.param_groups}
    assert decays == {0.0, 0.25}, decays  # the matrices' groups take the new decay; norms and biases none
    assert any("weight_decay 0.1 -> 0.25" in m for m in logs), logs
    logs.clear()
    saved = Trainer(_cfg(corpus, run, resume=True), log=logs.append).optimizer.state_dict()["state"]
    assert not any("optimizer settings" in m for m in logs), logs  # the lr differs (scheduled), but is not news
    moments = trainer.optimizer.state_dict()["state"]
    assert saved and all(torch.equal(moments[k]["exp_avg"], v["exp_avg"]) for k, v in saved.items() if "exp_avg" in v)


def test_kill_in_the_first_save_restarts_from_step_zero(corpus, tmp_path, monkeypatch, capsys):
    """A kill in the first save leaves train_config.json, metrics.jsonl (here also with a row cut short) and only a
    temporary folder under checkpoints/. A fresh start says to pass --resume; --resume restarts from step 0."""
    run = str(tmp_path / "run")

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # the checkpoint's files are written, the rename never happens

    monkeypatch.setattr(checkpoint, "publish_checkpoint", killed)
    with pytest.raises(KeyboardInterrupt):
        Trainer(_cfg(corpus, run, steps=3, save_every=100), log=lambda *a: None).run()
    monkeypatch.undo()
    losses = [r["loss"] for r in _rows(run)]
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        f.write('{"step": 4, "lo')
    assert [d for d in os.listdir(os.path.join(run, "checkpoints")) if not d.startswith(".tmp-step-00000003")] == []

    assert main(["train", "--data", corpus, "--tokenizer", "byte", "--out", run, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "no complete checkpoint" in err and "--resume" in err
    assert main(["train", "--out", run, "--resume", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "no complete checkpoint" in out and "step 0" in out
    assert [r["step"] for r in _rows(run)] == [1, 2, 3]
    assert [r["loss"] for r in _rows(run)] == losses
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["latest", "step-00000003"]  # .tmp-* removed


def test_no_good_checkpoint_restarts_from_step_zero(corpus, pristine, tmp_path):
    run = _damaged_copy(pristine, tmp_path, "state invalid")
    _truncate(os.path.join(run, "checkpoints", "step-00000002", SHARDS))
    logs = []
    trainer = Trainer(_cfg(corpus, run, resume=True), log=logs.append)
    assert trainer.step == 0 and not os.path.getsize(os.path.join(run, "metrics.jsonl"))
    assert any("no good checkpoint" in m for m in logs) and any("step 0" in m for m in logs), logs
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        resolve_checkpoint(run)
    with pytest.raises(ValueError, match="--resume"):  # a fresh start still refuses the folder
        Trainer(_cfg(corpus, run), log=lambda *a: None)


def test_missing_pointer_uses_the_newest_complete_checkpoint(pristine, tmp_path):
    """A kill between a save's rename and its pointer leaves a complete checkpoint that `latest` does not name."""
    run = str(tmp_path / "run")
    shutil.copytree(pristine[0], run)
    os.remove(os.path.join(run, "checkpoints", "latest"))
    warnings = []
    assert latest_checkpoint(run, warn=warnings.append) == os.path.join(run, "checkpoints", "step-00000004")
    assert any("latest is missing" in w for w in warnings)


def test_checkpoint_files_honour_the_umask(tmp_path):
    model = K3ForCausalLM(K3Config.preset("tiny"))
    model.init_random_weights(0)
    opt = build_optimizer(model, TrainConfig())
    old = os.umask(0o027)
    try:
        path = save_checkpoint(str(tmp_path), 1, model, opt, Balancer(model, "quantile").state_dict(), {})
    finally:
        os.umask(old)
    modes = {name: os.stat(os.path.join(path, name)).st_mode & 0o777 for name in os.listdir(path)}
    assert {".metadata", SHARDS, "config.json", "trainer_state.json"} <= modes.keys(), modes
    assert all(mode == 0o640 for mode in modes.values()), modes


class _RunsCode:
    """A pickle payload that would call os.getpid (harmless here) when unpickled by plain pickle.load."""

    def __reduce__(self):
        return (os.getpid, ())


def test_a_hostile_checkpoint_pickle_is_refused_not_run(pristine, tmp_path):
    """DCP's .metadata is a pickle and its non-tensor items are torch.load blobs: a crafted one must be refused by
    name (by the check, by resume, by load_model), never executed."""
    import pickle

    from openk3.parallel.checkpoint import SafePlanner, storage_problem

    run = str(tmp_path / "run")
    shutil.copytree(pristine[0], run)
    step = os.path.join(run, "checkpoints", "step-00000004")
    with open(os.path.join(step, ".metadata"), "wb") as f:
        pickle.dump(_RunsCode(), f)
    assert "posix.getpid, which a DCP checkpoint never holds" in storage_problem(step)
    warnings = []
    assert latest_checkpoint(run, warn=warnings.append) == os.path.join(run, "checkpoints", "step-00000002")
    assert any("never holds" in w for w in warnings), warnings
    with pytest.raises(ValueError, match="never holds"):
        load_model(step)
    # A non-tensor item (optimizer param groups are stored this way) goes through torch.load(weights_only=True).
    import io

    blob = io.BytesIO()
    torch.save(_RunsCode(), blob)
    blob.seek(0)
    planner = SafePlanner()
    planner.flatten_state_dict, planner.state_dict = False, {}
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(type("Item", (), {"dest_index": type("I", (), {"fqn": "x"})()})(), blob)

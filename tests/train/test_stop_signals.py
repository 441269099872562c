"""A run stopped early can be resumed: the early checkpoint (step FIRST_SAVE_STEP) and the checkpoint on SIGINT/SIGTERM
at the next step boundary, after which `--resume` continues with the losses of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from train_helpers import corpus, small_config  # noqa: F401  (corpus is a fixture)

from openk3.cli import main
from openk3.train import trainer as trainer_module
from openk3.train.trainer import FIRST_SAVE_STEP, Trainer, _StopSignals

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rows(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _steps_saved(run):
    return sorted(d for d in os.listdir(os.path.join(run, "checkpoints")) if d.startswith("step-"))


def test_first_checkpoint_comes_early(corpus, tmp_path):
    run = tmp_path / "run"
    cfg = small_config(corpus, run, steps=FIRST_SAVE_STEP + 1, batch_size=2, seq_len=32, eval_every=100,
                       save_every=100, keep_checkpoints=3)  # fmt: skip
    Trainer(cfg, log=lambda *a: None).run()
    assert _steps_saved(run) == [f"step-{FIRST_SAVE_STEP:08d}", f"step-{FIRST_SAVE_STEP + 1:08d}"]


def test_stop_signals_restore_the_previous_handlers():
    before = {sig: signal.getsignal(sig) for sig in trainer_module.STOP_SIGNALS}
    signals = _StopSignals(log=lambda *a: None).install()
    try:
        assert signal.getsignal(signal.SIGTERM) == signals._handle
        signal.raise_signal(signal.SIGTERM)  # recorded, not fatal
        assert signals.received == signal.SIGTERM
        signal.raise_signal(signal.SIGINT)  # at once: the same request arriving twice (torchrun forwards it)
        assert signals.received == signal.SIGTERM
        signals._first_at -= trainer_module.REPEAT_GRACE_S + 1  # later: a second Ctrl-C stops at once
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        signals.restore()
    assert {sig: signal.getsignal(sig) for sig in trainer_module.STOP_SIGNALS} == before

    seen = []  # outside the main thread no handler can be installed: nothing changes
    thread = threading.Thread(target=lambda: seen.append(_StopSignals().install()._previous))
    thread.start()
    thread.join()
    assert seen == [{}] and {sig: signal.getsignal(sig) for sig in trainer_module.STOP_SIGNALS} == before


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_saves_stops_cleanly_and_resumes_exactly(corpus, tmp_path, sig, capsys):
    flags = ["--data", corpus, "--tokenizer", "byte", "--batch-size", "2", "--seq-len", "32", "--steps", "8",
             "--eval-every", "100", "--no-progress", "--sample-tokens", "0", "--threads", "1"]  # fmt: skip
    # --threads 1 everywhere: the in-process runs and the subprocess must reduce in the same order (CI sets
    # OMP_NUM_THREADS=2, and --threads is a launch flag that --resume does not inherit).
    assert main(["train", *flags, "--out", str(tmp_path / "whole")]) == 0
    whole = [r["loss"] for r in _rows(tmp_path / "whole")]

    run = str(tmp_path / "run")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "openk3.cli", "train", *flags, "--out", run], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    metrics, deadline = os.path.join(run, "metrics.jsonl"), time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.exists(metrics):
            with open(metrics) as f:
                if len(f.readlines()) >= 2:
                    break
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[0]
    proc.send_signal(sig)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 128 + sig, out
    assert "Traceback" not in out and f"stopped by {sig.name} at step" in out and "--resume" in out
    stopped = [r["step"] for r in _rows(run)]
    assert 2 <= len(stopped) < 8 and stopped == list(range(1, len(stopped) + 1))
    assert _steps_saved(run) == [f"step-{len(stopped):08d}"]  # saved at the step it stopped after

    assert main(["train", "--out", run, "--resume", "--no-progress", "--threads", "1"]) == 0
    assert [r["step"] for r in _rows(run)] == list(range(1, 9))
    assert [r["loss"] for r in _rows(run)] == whole


def test_a_run_without_a_checkpoint_yet_is_refused_not_replaced(tmp_path, capsys):
    """`--ckpt RUN` before the run's first save says so, even where the folder also holds another model (the README's
    random one once shared runs/tiny): generate, serve and export would have used that one."""
    import torch

    from openk3.config import K3Config
    from openk3.model.model import K3ForCausalLM
    from openk3.train.checkpoint import load_model

    run = tmp_path / "run"
    model = K3ForCausalLM(K3Config.preset("tiny"))
    model.init_weights(torch.Generator().manual_seed(0))
    model.save_pretrained(str(run))
    assert load_model(str(run))[1] == str(run)  # a release folder alone loads
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 6.0}\n')  # a run started here, not yet saved
    with pytest.raises(FileNotFoundError, match="no complete checkpoint yet"):
        load_model(str(run))
    assert main(["export", "--ckpt", str(run), "--out", str(tmp_path / "release")]) == 2
    assert "has no complete checkpoint yet" in capsys.readouterr().err
    assert not (tmp_path / "release").exists()

"""CPU threads of every `k3` command that runs a model, and rough edges that live in the CLI and the engine:
--threads sets torch's thread count, the default honours OMP_NUM_THREADS and otherwise shares the free physical
cores among the processes, OpenMP threads spin briefly before they sleep, the header says the count; `chat --show-template` reads no weights;
Ctrl-C leaves `chat` with one line; an engine does not log its cache pools at INFO."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from openk3 import threads
from openk3.cli import main
from openk3.threads import physical_cores, pick_threads, set_threads
from openk3.train.config import TrainConfig
from openk3.train.flags import add_train_arguments, config_from_args


@pytest.fixture(autouse=True)
def keep_threads(monkeypatch):
    old = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    assert main(["init", "--preset", "tiny", "--out", str(path)]) == 0
    return str(path)


def test_default_is_the_free_physical_cores_shared_by_the_local_processes(monkeypatch):
    cores = physical_cores()
    assert 1 <= cores <= len(os.sched_getaffinity(0))
    monkeypatch.setattr(threads, "busy_cores_of_others", lambda: 0.0)
    assert pick_threads() == (cores, f"of {cores} cores")
    assert pick_threads(None, 2)[0] == max(1, cores // 2)
    assert pick_threads(None, 10 * cores)[0] == 1  # never 0
    logical = len(os.sched_getaffinity(0))
    # Another job keeps all but one core busy: this one takes the core that is left; a fully busy machine still
    # gets one thread.
    monkeypatch.setattr(threads, "busy_cores_of_others", lambda: (cores - 1) * logical / cores)
    assert pick_threads() == (1, f"1 of {cores} cores free") if cores > 1 else (1, "of 1 cores")
    monkeypatch.setattr(threads, "busy_cores_of_others", lambda: 2.0 * logical)
    assert pick_threads()[0] == 1 and pick_threads(None, 2)[0] == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert pick_threads(None, 2) == (3, f"OMP_NUM_THREADS=3; {cores} cores available")
    assert pick_threads(5, 2)[0] == 5  # --threads wins over the environment
    with pytest.raises(ValueError, match="--threads must be positive"):
        pick_threads(0)


def test_busy_cores_of_others_sees_another_process_and_not_this_one():
    """A spinning child process counts; this process's own spinning thread does not (bounded: 3 s at most)."""
    spin = "import time\nend = time.monotonic() + 3\nwhile time.monotonic() < end: pass"
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.3)  # the child's interpreter is up and spinning
        assert threads.busy_cores_of_others(0.5) >= 0.3  # a busy machine may give it less than a whole core
    finally:
        child.kill()
        child.wait()
    quiet = threads.busy_cores_of_others(0.3)
    stop = time.monotonic() + 2.0
    spinner = threading.Thread(target=lambda: [None for _ in iter(lambda: time.monotonic() < stop, False)])
    own = time.process_time()
    spinner.start()
    try:
        others = threads.busy_cores_of_others(0.5)
        assert time.process_time() - own >= 0.1  # this process did spin while it measured
    finally:
        stop = 0.0
        spinner.join()
    assert others < quiet + 0.5


def test_openmp_threads_spin_briefly_unless_the_user_says_otherwise():
    """libgomp reads its wait settings when torch loads it: importing openk3 first sets a 10,000-turn spin; a policy
    the user set wins. OMP_DISPLAY_ENV=verbose makes libgomp print what it actually uses."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["OMP_DISPLAY_ENV"] = "verbose"
    code = "import openk3, torch; torch.ones(64, 64) @ torch.ones(64, 64)"
    shown = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stderr
    if "OPENMP DISPLAY ENVIRONMENT" not in shown:
        pytest.skip("torch here does not use libgomp")
    assert f"GOMP_SPINCOUNT = '{threads.SPIN_COUNT_DEFAULT}'" in shown
    env["OMP_WAIT_POLICY"] = "ACTIVE"
    shown = subprocess.run([sys.executable, "-c", "import openk3"], env=env, capture_output=True, text=True, check=True)
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in shown.stderr and "GOMP_SPINCOUNT = '10000'" not in shown.stderr


def test_set_threads_sets_torch_and_says_so(monkeypatch):
    assert set_threads(1) == f"threads: 1 (--threads; {physical_cores()} cores available)"
    assert torch.get_num_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert set_threads().startswith("threads: 2 (OMP_NUM_THREADS=2;") and torch.get_num_threads() == 2


def test_generate_flag_and_default_set_the_count_in_the_header(ckpt, monkeypatch, capsys):
    torch.set_num_threads(2)
    assert main(["generate", "--ckpt", ckpt, "--max-new-tokens", "1", "--threads", "1"]) == 0
    assert torch.get_num_threads() == 1
    assert "k3 generate: threads: 1 (--threads" in capsys.readouterr().err
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert main(["generate", "--ckpt", ckpt, "--max-new-tokens", "1"]) == 0
    assert torch.get_num_threads() == 3
    assert "k3 generate: threads: 3 (OMP_NUM_THREADS=3;" in capsys.readouterr().err
    assert main(["generate", "--ckpt", ckpt, "--threads", "0"]) == 2
    assert "k3: error: --threads must be positive, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "demo", "train", "serve", "chat"])
def test_every_model_command_has_the_flag(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "--threads" in capsys.readouterr().out


def test_train_threads_is_a_launch_setting(tmp_path):
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    assert config_from_args(parser.parse_args(["--out", str(tmp_path), "--threads", "3"])).threads == 3
    with pytest.raises(ValueError, match="--threads must be positive"):
        TrainConfig(out=str(tmp_path), threads=-1)
    TrainConfig(out=str(tmp_path), threads=3).save(str(tmp_path))
    resumed = config_from_args(parser.parse_args(["--out", str(tmp_path), "--resume"]))
    assert resumed.threads is None  # this machine's default, not the one the run started on


def test_show_template_reads_no_weights(ckpt, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("--show-template loaded the model")

    monkeypatch.setattr("openk3.train.checkpoint.load_model", refuse)
    assert main(["chat", "--ckpt", ckpt, "--show-template"]) == 0
    assert "### Assistant:" in capsys.readouterr().out


def test_ctrl_c_leaves_chat_with_one_line(ckpt, monkeypatch, capsys):
    def interrupt(prompt=""):
        raise KeyboardInterrupt

    monkeypatch.setattr("builtins.input", interrupt)
    assert main(["chat", "--ckpt", ckpt, "--threads", "1"]) == 130
    err = capsys.readouterr().err
    assert "k3 chat: interrupted" in err and "Traceback" not in err
    assert "k3 chat: threads: 1" in err


def test_engine_logs_its_cache_only_at_debug(ckpt, caplog):
    from openk3 import K3ForCausalLM
    from openk3.data.tokenizer import load_tokenizer
    from openk3.serve.config import ServeConfig
    from openk3.serve.engine import LLMEngine

    model = K3ForCausalLM.from_pretrained(ckpt).eval()
    with caplog.at_level(logging.INFO, logger="openk3.serve"):
        engine = LLMEngine(model, load_tokenizer(ckpt, model.text_config), ServeConfig.from_options())
    assert not any("cache:" in r.getMessage() for r in caplog.records)
    info = engine.cache_info()
    summary = engine.cache_summary()
    assert summary.startswith(f"cache: {info['num_blocks']} MLA pages of {info['block_size']} tokens")
    assert f"{info['mla_pool_bytes'] / 2**20:.1f} MiB" in summary

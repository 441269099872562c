"""CPU threads of every `k3` command that runs a model (issue 20 item 2), and the rough edges of item 7 that live in
the CLI and the engine: --threads sets torch's thread count, the default honours OMP_NUM_THREADS and otherwise
shares the physical cores among the processes, the header says the count; `chat --show-template` reads no weights;
Ctrl-C leaves `chat` with one line; an engine does not log its cache pools at INFO."""

from __future__ import annotations

import argparse
import logging
import os

import pytest
import torch

from openk3.cli import main
from openk3.train.config import TrainConfig
from openk3.train.flags import add_train_arguments, config_from_args
from openk3.utils import physical_cores, pick_threads, set_threads


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


def test_default_is_the_available_physical_cores_shared_by_the_local_processes(monkeypatch):
    cores = physical_cores()
    assert 1 <= cores <= len(os.sched_getaffinity(0))
    assert pick_threads() == (cores, f"of {cores} cores")
    assert pick_threads(None, 2)[0] == max(1, cores // 2)
    assert pick_threads(None, 10 * cores)[0] == 1  # never 0
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert pick_threads(None, 2) == (3, f"OMP_NUM_THREADS=3; {cores} cores available")
    assert pick_threads(5, 2)[0] == 5  # --threads wins over the environment
    with pytest.raises(ValueError, match="--threads must be positive"):
        pick_threads(0)


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

"""The `k3` command line: init writes a loadable random checkpoint with no zero tensor, generate and info run,
bad input gives a clear error and exit code 2."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from fixture_paths import PLAIN
from safetensors.torch import load_file

from openk3 import K3ForCausalLM
from openk3.cli import main


def test_init_writes_nontrivial_checkpoint(tmp_path, capsys):
    assert main(["init", "--preset", "tiny", "--out", str(tmp_path), "--seed", "3"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    tensors = load_file(tmp_path / "model.safetensors")
    for key in ("gate.e_score_correction_bias", "self_attn.A_log", "self_attn.dt_bias", "_res_proj.weight"):
        assert any(key in k for k in tensors), key
    for name, t in tensors.items():
        assert not torch.all(t == 0), name
    # A_log is stored padded with exact zeros past the real heads, like the release.
    a_log = tensors["language_model.model.layers.0.self_attn.A_log"]
    assert a_log.shape == (64,) and torch.all(a_log[3:] == 0) and torch.all(a_log[:3] != 0)
    model = K3ForCausalLM.from_pretrained(tmp_path)
    assert model.num_parameters()[0] < 10_000_000
    # Seeds are reproducible.
    assert main(["init", "--preset", "tiny", "--out", str(tmp_path / "again"), "--seed", "3"]) == 0
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert all(torch.equal(again[k], tensors[k]) for k in tensors)


def test_generate_and_info(tmp_path, capsys):
    assert main(["init", "--preset", "tiny", "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    assert main(["generate", "--ckpt", str(tmp_path), "--prompt", "def f(x):", "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def f(x):")
    # Speculative decoding through the engine gives the same greedy text.
    assert main(["generate", "--ckpt", str(tmp_path), "--prompt", "def f(x):", "--max-new-tokens", "5",
                 "--speculative", "draft_model", "--draft-ckpt", str(tmp_path)]) == 0  # fmt: skip
    captured = capsys.readouterr()
    assert captured.out == out and "acceptance" in captured.err
    assert main(["info", "--preset", "k3"]) == 0
    out = capsys.readouterr().out
    assert "2,779,484,476,000" in out and "104,189,612,640" in out
    assert main(["info", "--ckpt", PLAIN]) == 0
    assert "KKKMKKKMM" in capsys.readouterr().out


def test_info_and_plan_accept_a_training_run_folder(tmp_path, capsys):
    """info and plan read a training run as serve, chat, generate and export do: its newest good checkpoint."""
    from openk3.train.checkpoint import latest_checkpoint

    run = str(tmp_path / "run")
    assert main(["train", "--preset", "tiny", "--data", "mqar", "--tokenizer", "byte", "--steps", "1", "--batch-size",
                 "2", "--seq-len", "32", "--eval-every", "1000", "--eval-batches", "1", "--sample-tokens", "0",
                 "--no-progress", "--out", run]) == 0  # fmt: skip
    ckpt = latest_checkpoint(run)
    for command in (["info"], ["plan", "--context", "1024"]):
        capsys.readouterr()
        assert main([*command, "--ckpt", ckpt]) == 0
        want = capsys.readouterr().out
        assert main([*command, "--ckpt", run]) == 0
        assert capsys.readouterr().out == want and want
    assert main(["info", "--ckpt", str(tmp_path / "empty-run")]) == 2  # a missing folder: exit 2, as before
    os.makedirs(tmp_path / "new-run" / "checkpoints")
    assert main(["plan", "--ckpt", str(tmp_path / "new-run")]) == 2
    assert "has no complete checkpoint yet" in capsys.readouterr().err


def test_errors_are_clear(tmp_path, capsys):
    assert main(["generate", "--ckpt", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["init", "--preset", "k3", "--out", str(tmp_path)]) == 2


def test_bench_without_the_checkout_names_the_path(tmp_path, monkeypatch, capsys):
    """`k3 bench` runs benchmarks/NAME.py of the checkout; an install without it fails clearly, naming the path."""
    from openk3 import cli

    assert os.path.isfile(os.path.join(cli.BENCHMARKS_DIR, "kda.py"))
    monkeypatch.setattr(cli, "BENCHMARKS_DIR", str(tmp_path / "benchmarks"))
    assert main(["bench", "ep", "--quick"]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "benchmarks" / "ep.py") in err and "source checkout" in err


def test_bench_runs_the_checkouts_scripts_as_children(tmp_path, monkeypatch, capfd):
    """The names are the scripts present in benchmarks/ (not the helpers they import); `k3 bench NAME ARGS` runs
    `python benchmarks/NAME.py ARGS` (its folder first on its import path, ours untouched) and returns its exit code;
    an unknown name is a clear error listing the names."""
    from openk3 import cli

    folder = tmp_path / "benchmarks"
    folder.mkdir()
    (folder / "helper.py").write_text("WORD = 'from a sibling'\n")
    (folder / "echo.py").write_text("import sys\nfrom helper import WORD\n\nif __name__ == \"__main__\":\n"
                                    "    print(WORD, *sys.argv[1:])\n    sys.exit(int(sys.argv[-1]))\n")  # fmt: skip
    monkeypatch.setattr(cli, "BENCHMARKS_DIR", str(folder))
    assert cli.benchmark_names() == ["echo"]
    path = list(sys.path)
    assert main(["bench", "echo", "--quick", "3"]) == 3
    assert capfd.readouterr().out == "from a sibling --quick 3\n"
    assert sys.path == path and "helper" not in sys.modules
    assert main(["bench", "nope"]) == 2
    assert "no benchmark 'nope'" in capfd.readouterr().err and "echo" in cli.benchmark_names()


def test_train_flags_come_from_train_config(tmp_path, capsys):
    """`k3 train`'s flags are TrainConfig's flag fields: types, defaults, switches, choices in --help, and on --resume
    the saved run's values except this launch's own settings (stop_after, progress, layout)."""
    import argparse
    import dataclasses

    from openk3.train.config import TrainConfig
    from openk3.train.flags import add_train_arguments, config_from_args

    def parse(*argv):
        p = argparse.ArgumentParser(prog="k3 train")
        add_train_arguments(p)
        return config_from_args(p.parse_args(["--out", str(tmp_path), *argv]))

    assert parse() == TrainConfig(out=str(tmp_path))
    cfg = parse("--steps", "7", "--lr", "0.01", "--micro-batch-size", "4", "--balance", "sign", "--no-progress",
                "--activation-checkpointing", "--stop-after", "3", "--dp", "2")  # fmt: skip
    assert (cfg.steps, cfg.lr, cfg.micro_batch_size, cfg.balance) == (7, 0.01, 4, "sign")
    assert (cfg.progress, cfg.activation_checkpointing, cfg.stop_after, cfg.dp) == (False, True, 3, 2)
    with pytest.raises(ValueError, match="--schedule must be one of"):
        parse("--schedule", "linear")

    cfg.save(str(tmp_path))
    resumed = parse("--resume", "--steps", "9", "--seq-len", "128")
    assert dataclasses.asdict(resumed) == {**dataclasses.asdict(cfg), "steps": 9, "seq_len": 128, "resume": True,
                                           "stop_after": None, "progress": True, "dp": 1}  # fmt: skip
    assert "--resume changes seq_len from 256 to 128" in capsys.readouterr().err

    help_text = subprocess.run([sys.executable, "-m", "openk3.cli", "train", "--help"], capture_output=True,
                               text=True, check=True).stdout  # fmt: skip
    flags = {"--preset", "--data", "--tokenizer", "--steps", "--stop-after", "--seed", "--balance", "--balance-bins",
             "--balance-ema", "--batch-size", "--micro-batch-size", "--seq-len", "--curriculum", "--lr", "--optimizer",
             "--schedule", "--warmup", "--weight-decay", "--grad-clip", "--device", "--precision", "--eval-every",
             "--eval-batches", "--save-every", "--keep-checkpoints", "--max-nonfinite", "--sample-tokens", "--dp",
             "--ep", "--cp", "--out", "--resume", "--activation-checkpointing", "--balance-exact-thresholds",
             "--no-progress", "--threads", "--vision-kinds", "--vision-eval-examples", "--contrastive-steps",
             "--contrastive-lr", "--vision-lr"}  # fmt: skip
    assert set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", help_text)) == flags | {"--help", "--nproc"}
    for choices in ("{k3,medium,small,tiny,tiny-vl}", "{bpe,byte}", "{quantile,sign,none}", "{wsd,cosine}", "{adamw,muon}",
                    "{auto,fp32,bf16}"):  # fmt: skip
        assert choices in help_text


def test_console_script_entry_point(tmp_path):
    out = subprocess.run([sys.executable, "-m", "openk3.cli", "info", "--preset", "tiny"], capture_output=True,
                         text=True, check=True)  # fmt: skip
    assert "parameters" in out.stdout


def test_chat_reads_stdin_and_streams_answers(tmp_path, monkeypatch, capsys):
    import io

    assert main(["init", "--preset", "tiny", "--out", str(tmp_path)]) == 0
    assert main(["chat", "--ckpt", str(tmp_path), "--show-template"]) == 0
    assert "### Assistant:" in capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/reset\nagain\n/exit\n"))
    assert main(["chat", "--ckpt", str(tmp_path), "--max-new-tokens", "4", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.count("k3> ") == 2  # two answers; /reset and /exit are commands
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", "--ckpt", str(tmp_path), "--max-new-tokens", "4", "--no-thinking"]) == 0
    assert "chat format (openk3-plain) has no thinking to turn off" in capsys.readouterr().err


def test_serve_command_answers_http(tmp_path):
    import socket
    import time

    import httpx2

    assert main(["init", "--preset", "tiny", "--out", str(tmp_path)]) == 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "openk3.cli", "serve", "--ckpt", str(tmp_path), "--port", str(port),
                             "--model-name", "tiny", "--max-model-len", "256"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx2.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx2.TransportError:
                time.sleep(0.1)
        r = httpx2.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "def", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_sandbox_commands_against_a_served_fleet(tmp_path, monkeypatch, capsys):
    """`k3 sandbox serve` owns the sandboxes; create, exec (stdout, stderr, stdin, exit code), snapshot, fork,
    restore, ls and rm are one request each; SIGTERM closes every sandbox and removes the socket."""
    import io
    import signal
    import time

    sock = str(tmp_path / "sb.sock")
    missing = str(tmp_path / "none.sock")
    assert main(["sandbox", "ls", "--socket", missing]) == 2
    assert "start one with `k3 sandbox serve`" in capsys.readouterr().err
    serve = ["sandbox", "serve", "--socket", sock, "--warm", "1", "--max-sandboxes", "4", "--memory-mb", "256"]
    proc = subprocess.Popen([sys.executable, "-m", "openk3.cli", *serve], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(sock):
            if proc.poll() is not None:
                err = proc.stderr.read()
                if "SandboxUnavailable" in err:
                    pytest.skip(f"namespace backend unavailable here: {err.strip().splitlines()[-1]}")
                raise AssertionError(err)
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        assert os.stat(sock).st_mode & 0o777 == 0o600

        def k3(*argv) -> tuple[int, str, str]:
            rc = main(["sandbox", argv[0], "--socket", sock, *argv[1:]])
            out, err = capsys.readouterr()
            return rc, out, err

        rc, sid, _ = k3("create")
        sid = sid.strip()
        assert rc == 0 and sid
        assert k3("exec", sid, "--", "sh", "-c", "echo out; echo err >&2; exit 3") == (3, "out\n", "err\n")
        monkeypatch.setattr("sys.stdin", io.StringIO("v1"))
        assert k3("exec", "--stdin", sid, "--", "sh", "-c", "cat > state.txt")[0] == 0
        rc, snap, _ = k3("snapshot", sid)
        snap = snap.strip()
        assert rc == 0 and snap
        assert k3("exec", sid, "--", "sh", "-c", "echo v2 > state.txt")[0] == 0
        rc, kids, _ = k3("fork", snap, "-n", "2")
        kids = kids.split()
        assert rc == 0 and len(kids) == 2
        assert k3("exec", kids[1], "--", "cat", "state.txt")[1] == "v1"
        assert k3("restore", sid, snap)[0] == 0
        assert k3("exec", sid, "--", "cat", "state.txt")[1] == "v1"
        rc, listing, _ = k3("ls")
        assert rc == 0 and all(i in listing for i in [sid, *kids]) and f"snapshot {snap}" in listing
        assert "3 live (0 paused), 1 warm of 4" in listing
        assert 'openk3_sandbox_op_seconds_count{op="fork"} 1.0' in k3("ls", "--metrics")[1]
        rc, _, err = k3("fork", snap, "-n", "2")
        assert rc == 1 and "CapacityError" in err  # 3 live + 2 > 4
        rc, out, _ = k3("rm", kids[0], kids[1], snap)
        assert rc == 0 and "deleted 0 unused layers" in out  # sid stands on the snapshot's layer
        rc, out, _ = k3("rm", sid)
        assert rc == 0 and "deleted 1 unused layers" in out
        assert k3("exec", sid, "--", "true")[0] == 2  # gone: a clear error, exit 2
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert not os.path.exists(sock)


def test_sandbox_bench_quick(tmp_path, capfd):
    """`k3 sandbox bench --quick` writes the issue's keys (and `k3 bench sandbox` is the same benchmark)."""
    import json

    from openk3.sandbox import NamespaceBackend, SandboxUnavailable

    try:
        NamespaceBackend().close()
    except SandboxUnavailable as err:
        pytest.skip(f"namespace backend unavailable here: {err}")
    out = tmp_path / "sb.json"
    assert main(["sandbox", "bench", "--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    keys = {"snapshot_ms", "restore_ms", "fork64_s", "create_ms_p50", "exec_true_ms_p50", "idle_sandboxes",
            "host_true_ms_p50", "memory_per_idle_sandbox_mb"}  # fmt: skip
    assert keys <= set(result) and all(result[k] > 0 for k in keys)
    assert result["idle_sandboxes"] == 8 and len(result["targets"]) == 6
    assert (tmp_path / "sb.md").read_text().startswith("# Sandbox benchmark")
    capfd.readouterr()
    assert main(["bench", "sandbox", "--help"]) == 0  # the benchmark's own --help, printed by the child
    assert "usage: k3 sandbox bench" in capfd.readouterr().out

"""`k3 train --nproc N` launches torchrun with `python -m openk3.train`: with --dp 2, --dp 2 --ep 2 and --cp 2 the
per-step losses, gradient norms and MaxVio equal the single-process run on the same seed (the global batch is the
same; each rank trains on its share), and every rank writes its shards of one DCP checkpoint that loads as a plain
model in one process."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from openk3.cli import main
from openk3.train.checkpoint import load_model

FLAGS = ["--preset", "tiny", "--data", "mqar", "--tokenizer", "byte", "--steps", "2", "--batch-size", "4",
         "--seq-len", "32", "--eval-every", "1000", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress"]  # fmt: skip


def metrics(run) -> list[dict]:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    run = str(tmp_path_factory.mktemp("single") / "run")
    assert main(["train", *FLAGS, "--out", run]) == 0
    return metrics(run)


@pytest.mark.parametrize(
    "layout", [["--nproc", "2", "--dp", "2"], ["--nproc", "4", "--dp", "2", "--ep", "2"], ["--nproc", "2", "--cp", "2"]]
)
def test_multi_process_training_matches_one_process(single, layout, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run = str(tmp_path / "run")
    assert main(["train", *FLAGS, "--out", run, *layout]) == 0
    rows = metrics(run)
    assert len(rows) == len(single) == 2
    for got, want in zip(rows, single):
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"])
        assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-4 * want["grad_norm"]
        assert got["max_vio"] == want["max_vio"]
    ckpt = os.path.join(run, "checkpoints", "step-00000002")
    shards = [f for f in os.listdir(ckpt) if f.endswith(".distcp")]
    assert len(shards) == int(layout[1])  # one file per rank: nothing was gathered to rank 0
    model = load_model(ckpt)[0]
    assert model.num_parameters()[0] > 0 and all(torch.isfinite(p).all() for p in model.parameters())


def test_resume_at_another_layout(single, tmp_path, monkeypatch):
    """Stop a 2 x 2 run after step 1, resume copies of it with 2 processes and with 1: step 2 matches the
    uninterrupted run."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    stopped = str(tmp_path / "stopped")
    assert main(["train", *FLAGS, "--out", stopped, "--stop-after", "1", "--nproc", "4", "--dp", "2", "--ep", "2"]) == 0
    assert os.path.isfile(os.path.join(stopped, "checkpoints", "step-00000001", ".metadata"))
    for resume_layout in (["--nproc", "2", "--dp", "2"], []):
        run = str(tmp_path / f"run{len(resume_layout)}")
        shutil.copytree(stopped, run)  # the run folder holds no absolute paths: a copy resumes like the original
        layout = resume_layout or ["--dp", "1"]
        assert main(["train", *FLAGS, "--out", run, "--resume", *layout]) == 0
        rows = metrics(run)
        assert [r["step"] for r in rows] == [1, 2]
        for got, want in zip(rows, single):
            assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (resume_layout, got["step"])


def test_torchrun_argv_passes_every_flag_but_nproc():
    """`k3 train|rl|distill --nproc N FLAGS` runs torchrun on the same FLAGS without --nproc (either spelling)."""
    import sys

    from openk3.parallel.launch import torchrun_argv

    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    argv = ["train", "--nproc", "4", "--dp", "2", "--nproc=4", "--out", "run"]
    assert torchrun_argv(4, argv) == [*head, "-m", "openk3.train", "--dp", "2", "--out", "run"]
    argv = ["--threads", "1", "distill", "--nproc", "4", "--ep", "2"]
    assert torchrun_argv(4, argv, command="distill", module="openk3.rl", module_args=["distill"]) == [
        *head, "-m", "openk3.rl", "distill", "--ep", "2"]  # fmt: skip

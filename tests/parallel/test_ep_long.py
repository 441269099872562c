"""The README's expert-parallel layouts (`k3 train --nproc 4 --dp 2 --ep 2`, `--nproc 2 --ep 2`) train 20 steps
through the real entry point (torchrun -m openk3.train) without hanging.

The EP hang came after step 7: a rank whose experts routing left without tokens dropped its reverse all-to-alls from the
backward while the others waited in them. Few tokens per step (4 sequences of 16) make such a step likely within 20:
with the fix reverted both layouts fail at step 12, every rank with a CollectiveError (ranks 1 and 3 waiting in
all_to_all_single on mesh_ep, ranks 0 and 2 in FSDP's reduce_scatter_single: the reported hang). A short collective
timeout turns a hang into that error, and the launch has its own deadline, so a hang can never leave the test suite
stuck. The step-10 checkpoint also runs mid-training here, at both layouts."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

import pytest

FLAGS = ["--preset", "tiny", "--data", "mqar", "--tokenizer", "byte", "--steps", "20", "--batch-size", "4",
         "--seq-len", "16", "--curriculum", "0", "--eval-every", "1000", "--eval-batches", "1", "--save-every", "1000",
         "--sample-tokens", "0", "--no-progress"]  # fmt: skip
COLLECTIVE_TIMEOUT_S = 20  # a healthy step here takes well under a second per collective
LAUNCH_DEADLINE_S = 240  # 20 steps take about 45 s with 4 processes on 2 busy cores


def _train(nproc: int, layout: list[str], out: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "openk3.train", *FLAGS, "--out", out, *layout]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENK3_COLLECTIVE_TIMEOUT_S": str(COLLECTIVE_TIMEOUT_S)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=LAUNCH_DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every rank: nothing is left running
        output, _ = proc.communicate()
        pytest.fail(
            f"{layout} still running after {LAUNCH_DEADLINE_S} s (a hang the watchdog missed):\n{output[-4000:]}"
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, output)


@pytest.mark.parametrize("nproc,layout", [(4, ["--dp", "2", "--ep", "2"]), (2, ["--ep", "2"])])
def test_readme_expert_parallel_layouts_train_20_steps(nproc, layout, tmp_path):
    out = str(tmp_path / "run")
    done = _train(nproc, layout, out)
    errors = [line for line in done.stdout.splitlines() if "CollectiveError" in line or "Error:" in line]
    assert done.returncode == 0, "\n".join(errors) or done.stdout[-4000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]  # it trained, not just ran

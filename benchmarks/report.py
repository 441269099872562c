"""What every benchmark here shares: the one report writer (`write_report`: OUT.json with the numbers, OUT.md with
the table, side by side) and the machine it ran on (`machine_info`, `load_info`, `measure_matmul`).

Benchmarks import it as a sibling (`from report import write_report`): `python benchmarks/NAME.py` puts the script's
folder first on `sys.path`. experiments/bench.py loads it by path for the experiments.

Where results go: a benchmark writes under runs/bench/ (`scratch_out`, ignored by git) unless `--out` names a path;
the committed results in benchmarks/results/ change only when asked for (`--out benchmarks/results/NAME`).
"""

from __future__ import annotations

import json
import os
import platform
import re

import torch

from openk3.train.throughput import matmul_gflops


def write_report(result: dict, out: str, markdown: str) -> None:
    """Write the JSON and the markdown report of one run: `out` is the JSON path or the path without its extension
    (`benchmarks/results/kda-cpu.json` and `benchmarks/results/kda-cpu` both write kda-cpu.json and kda-cpu.md,
    creating the folder). Prints each target's verdict first when `result` has `targets` (dicts with `target`,
    `measured` and `met`: True, False or None when not measurable)."""
    for t in result.get("targets", ()):
        verdict = "met" if t["met"] else "NOT met" if t["met"] is False else "n/a"
        print(f"target: {t['target']}: {t['measured']} -> {verdict}")
    prefix = out.removesuffix(".json")
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    with open(prefix + ".json", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    with open(prefix + ".md", "w", encoding="utf-8") as f:
        f.write(markdown)
    print(f"wrote {prefix}.json and {prefix}.md")


def scratch_out(name: str) -> str:
    """The default output of a benchmark run: runs/bench/NAME (.json and .md) under the current folder, which git
    ignores."""
    return os.path.join("runs", "bench", name)


def out_help(committed: str) -> str:
    """The `--out` help every benchmark gives: where a run writes by default and how to update committed results."""
    return (
        f"JSON path or the path without .json; the .md goes beside it (default: {scratch_out(committed)}.json, "
        f"not committed; --out benchmarks/results/{committed} replaces the committed results)"
    )


def targets_table(targets: list[dict], subject: str, na: str = "n/a") -> list[str]:
    """The "Targets" section every benchmark report opens with ("## Targets: SUBJECT"): one row per {"target",
    "measured", "met"}, where met None (not measured at full size) reads `na`."""
    lines = [f"## Targets: {subject}", "", "| target | measured | met |", "|---|---|---|"]
    for t in targets:
        met = "yes" if t["met"] else "**no**" if t["met"] is False else na
        lines.append(f"| {t['target']} | {t['measured']} | {met} |")
    return lines


def machine_info() -> dict:
    """CPU model, cores, torch and Python versions, torch's thread count and the load before the run."""
    model = platform.processor()
    try:
        with os.popen("lscpu") as lscpu:
            model = re.search(r"Model name:\s*(.+)", lscpu.read()).group(1).strip()
    except (AttributeError, OSError):
        pass
    return {"cpu": model, "cores": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "python": platform.python_version(), "load_before": load_info()}  # fmt: skip


def load_info() -> str:
    """Load average and CPU pressure: other processes on a shared machine inflate times (noted in results)."""
    parts = []
    for path in ("/proc/loadavg", "/proc/pressure/cpu"):
        try:
            with open(path) as f:
                parts.append(f.readline().rstrip("\n"))
        except OSError:
            pass
    return " | ".join(parts)


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]


def measure_matmul(quick: bool, dtypes) -> dict:
    """This machine's square-GEMM rate per dtype name (GFLOP/s), the ceiling each number is compared against: the
    trainer's MFU measurement (`openk3.train.throughput.matmul_gflops`), best over 3 s of 2048² products (a few
    on a small CPU; 512² for 0.05 s quick)."""
    n, seconds = (512, 0.05) if quick else (2048, 3.0)
    return {dtype_name(d): matmul_gflops(torch.device("cpu"), d, n=n, seconds=seconds) for d in dtypes}

"""The packages' dependency direction (`ALLOWED`: what each package may import), enforced by walking every import of
the package with ast."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "openk3"
# benchmarks/ is scripts beside the package: `k3 bench` runs them as scripts (cli.run_benchmark), nothing imports them.
BENCHMARKS = {p.stem for p in (ROOT.parent / "benchmarks").glob("*.py")}

# package -> openk3 packages it may import (itself always allowed)
ALLOWED = {
    "threads": set(),  # standard library only: imported before torch
    "utils": {"threads"},
    "config": {"utils"},
    "ops": {"utils"},
    "model": {"ops", "config", "utils"},
    "parallel": {"model", "ops", "config", "utils"},
    "data": {"utils"},
    "train": {"model", "ops", "parallel", "data", "config", "utils"},
    "serve": {"model", "ops", "parallel", "data", "config", "utils"},
    "sandbox": set(),
    "rl": {"serve", "train", "sandbox", "model", "data", "config", "utils"},
    "export": {"model", "data", "config", "utils"},
    "cli": None,  # anything
    "__init__": {"threads", "config", "model", "data"},
}
NO_DISTRIBUTED = {"threads", "utils", "config", "ops", "model", "data", "export"}


def _package(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).parts
    return rel[0].removesuffix(".py")


def _imports(path: pathlib.Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_dependency_direction():
    violations = []
    files = sorted(ROOT.rglob("*.py"))
    assert len(files) > 10 and {"kda", "serve", "ep", "report"} <= BENCHMARKS
    for path in files:
        pkg = _package(path)
        assert pkg in ALLOWED, f"{path}: package {pkg!r} is not in ALLOWED; add it with what it may import"
        for mod in _imports(path):
            parts = mod.split(".")
            if parts[0] in BENCHMARKS or parts[0] == "benchmarks":
                violations.append(f"{path.relative_to(ROOT)} imports {mod} (benchmarks/ is outside the package)")
            if parts[0] == "openk3" and len(parts) > 1:
                target = parts[1]
                if target == "cli" and pkg != "cli":
                    violations.append(f"{path.relative_to(ROOT)} imports {mod} (nothing may import cli)")
                elif ALLOWED[pkg] is not None and target != pkg and target not in ALLOWED[pkg]:
                    violations.append(f"{path.relative_to(ROOT)} imports {mod}")
            if pkg in NO_DISTRIBUTED and mod.startswith("torch.distributed"):
                violations.append(f"{path.relative_to(ROOT)} imports {mod} (single-device package)")
    assert not violations, "\n".join(violations)

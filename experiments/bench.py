"""The benchmarks' modules, for the experiments here: `from bench import distill, report`.

benchmarks/ is a folder of scripts, not a package, so each module is loaded from its file (benchmarks/NAME.py) and
registered under its own name, report.py first: the benchmark scripts import it as a sibling (`from report import
write_report`), which is how they run as `python benchmarks/NAME.py`. Nothing is added to `sys.path`.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def load(name: str) -> ModuleType:
    """benchmarks/NAME.py as the module NAME (loaded once)."""
    if name in sys.modules:
        return sys.modules[name]
    if name != "report":
        load("report")
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def __getattr__(name: str) -> ModuleType:
    """`from bench import distill` loads benchmarks/distill.py on first use."""
    if name.startswith("__") or not (BENCHMARKS / f"{name}.py").is_file():
        raise AttributeError(name)
    return load(name)

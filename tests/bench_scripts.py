"""The benchmark scripts' modules for their tests: `bench_scripts.load("kda")` is benchmarks/kda.py.

benchmarks/ is a folder of scripts beside the package, not a package: each is loaded from its file as the module
`bench_NAME`, after its sibling report.py as `report` (what the scripts import, `from report import write_report`,
as they do when run as `python benchmarks/NAME.py`). Nothing is added to `sys.path`.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def _load_file(module_name: str, path: pathlib.Path) -> ModuleType:
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def load(name: str) -> ModuleType:
    """benchmarks/NAME.py, loaded once."""
    _load_file("report", BENCHMARKS / "report.py")
    return _load_file(f"bench_{name}", BENCHMARKS / f"{name}.py")

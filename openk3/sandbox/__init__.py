"""Agent environments' isolation: the `Sandbox` protocol (base.py), the namespace backend (namespace.py, the default on
Linux) and the fleet (fleet.py). Knows nothing of models; imports nothing else of openk3.

    from openk3.sandbox import create_sandbox
    with create_sandbox(memory_mb=512) as sb:
        sb.write_file("/workspace/hello.py", "print('hi')")
        print(sb.exec("python3 hello.py").stdout)
        ref = sb.snapshot()
"""

from openk3.sandbox.base import (
    CALL_DEADLINE_S,
    DEFAULT_TIMEOUT_S,
    CapacityError,
    DirEntry,
    ExecResult,
    Sandbox,
    SandboxBusy,
    SandboxClosed,
    SandboxError,
    SandboxTimeout,
    SandboxUnavailable,
    SnapshotRef,
    State,
    Unsupported,
)
from openk3.sandbox.namespace import NamespaceBackend, create_sandbox
from openk3.sandbox.namespace_sandbox import NamespaceSandbox

__all__ = [
    "CALL_DEADLINE_S",
    "DEFAULT_TIMEOUT_S",
    "CapacityError",
    "DirEntry",
    "ExecResult",
    "Fleet",
    "NamespaceBackend",
    "NamespaceSandbox",
    "Sandbox",
    "SandboxBusy",
    "SandboxClosed",
    "SandboxError",
    "SandboxTimeout",
    "SandboxUnavailable",
    "SnapshotRef",
    "State",
    "Unsupported",
    "create_sandbox",
]  # fmt: skip


def __getattr__(name: str):
    # The fleet (and through it, optionally, Ray) loads on first use: plain sandbox users never pay for it.
    if name == "Fleet":
        from openk3.sandbox.fleet import Fleet

        return Fleet
    raise AttributeError(f"module 'openk3.sandbox' has no attribute {name!r}")

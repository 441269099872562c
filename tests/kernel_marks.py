"""The marks of the CPU kernel tests: skipped only where there is no C compiler at all (a compile error fails them
with the compiler's message), and run once per build of the kernels this CPU runs (conftest's `kernel_isa`)."""

import pytest

from openk3.ops import cpu_kernels

needs_compiler = pytest.mark.skipif(
    cpu_kernels.compiler() is None, reason="no C compiler ($CC, default cc, is not on PATH)"
)
needs_kernels = [needs_compiler, pytest.mark.usefixtures("kernel_isa")]

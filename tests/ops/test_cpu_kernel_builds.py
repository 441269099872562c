"""The builds of the CPU kernels (ops/cpu_kernels): every build the CPU runs is there where a compiler is (a compile
error fails, never a silent fall back), the default is the best build or the one OPENK3_CPU_ISA names, and every
vector path of the C source compiles, the x86 ones on any x86 machine and the Arm one with a cross compiler."""

from __future__ import annotations

import platform
import shutil

import pytest
from kernel_marks import needs_compiler

from openk3.ops import cpu_kernels


@needs_compiler
def test_the_kernels_build_where_a_compiler_exists(kernel_isa):
    """A compiler is there (else this module skips), so the default build and the one under test exist: a compile
    error is a failure with the compiler's message, never a silent fall back to the torch path."""
    assert cpu_kernels.available(), cpu_kernels.failure()
    assert cpu_kernels._lib.openk3_isa().decode().startswith(kernel_isa)
    assert cpu_kernels.info()["isa"] in cpu_kernels.features().isas()


def test_the_default_build_is_the_best_this_cpu_runs_unless_named(monkeypatch):
    runnable = cpu_kernels.features().isas()
    monkeypatch.delenv("OPENK3_CPU_ISA", raising=False)
    assert cpu_kernels.default_isa() == runnable[0]
    monkeypatch.setenv("OPENK3_CPU_ISA", "Portable")
    assert cpu_kernels.default_isa() == "portable"
    monkeypatch.setenv("OPENK3_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="OPENK3_CPU_ISA='sse9' is not one of"):
        cpu_kernels.default_isa()
    if "avx512" not in runnable:
        monkeypatch.setenv("OPENK3_CPU_ISA", "avx512")
        with pytest.raises(ValueError, match="this CPU runs only"):
            cpu_kernels.default_isa()


# Each vector path for a generic CPU of its kind (not -march=native: every path compiles on any x86 machine), and
# the string the build reports. "avx2" is the AVX-512 machine's flags with AVX-512 turned off.
X86_BUILDS = [("avx512", ["-march=x86-64-v4", "-mprefer-vector-width=512"]),
              ("avx2", ["-march=x86-64-v4", "-mno-avx512f"]), ("avx2", ["-march=x86-64-v3"]), ("portable", [])]  # fmt: skip


@needs_compiler
@pytest.mark.parametrize(("isa", "flags"), X86_BUILDS, ids=[" ".join(f) or "baseline" for _, f in X86_BUILDS])
def test_every_x86_vector_path_compiles(isa, flags, tmp_path):
    """Every path of the C source compiles warning-free (-Wall -Werror) whatever this machine runs, and takes the
    path its flags select."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"x86 flags; this machine is {platform.machine()}")
    out = str(tmp_path / "k.so")
    done = cpu_kernels.compile_source(cpu_kernels.compiler(), [*flags, "-fopenmp", "-Wall", "-Werror"], out)
    assert done.returncode == 0, done.stderr
    assert f"{isa}\0".encode() in (tmp_path / "k.so").read_bytes()


def test_the_arm_path_compiles(tmp_path):
    """The portable path as Arm builds it (NEON), with Debian's cross compiler (gcc-aarch64-linux-gnu)."""
    cc = shutil.which("aarch64-linux-gnu-gcc")
    if cc is None:
        pytest.skip("no aarch64-linux-gnu-gcc (Debian's gcc-aarch64-linux-gnu; .ci/run installs it)")
    out = str(tmp_path / "k.so")
    done = cpu_kernels.compile_source(cc, ["-march=armv8-a", "-fopenmp", "-Wall", "-Werror"], out)
    assert done.returncode == 0, done.stderr
    assert b"portable-neon\0" in (tmp_path / "k.so").read_bytes()


@needs_compiler
def test_a_compiler_without_openmp_builds_without_it_and_says_why(tmp_path, monkeypatch, caplog):
    """Apple clang takes no -fopenmp: the build goes on without it (one thread) and logs the compiler's words."""
    cc = tmp_path / "cc"
    cc.write_text(f"""#!/bin/sh
for a in "$@"; do [ "$a" = -fopenmp ] && {{ echo "clang: error: unsupported option '-fopenmp'" >&2; exit 1; }}; done
exec {cpu_kernels.compiler()} "$@"
""")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("OPENK3_CACHE", str(tmp_path / "cache"))
    lib, record = cpu_kernels._build("portable")
    assert lib.openk3_isa().decode().startswith("portable") and not record["openmp"]
    assert "without OpenMP" in caplog.text and "unsupported option '-fopenmp'" in caplog.text


@needs_compiler
def test_a_compile_error_is_raised_with_the_compilers_message(tmp_path, monkeypatch):
    bad = tmp_path / "bad.c"
    bad.write_text("int f(void) { return UNDECLARED_NAME; }\n")
    monkeypatch.setattr(cpu_kernels, "_SOURCE", str(bad))
    monkeypatch.setenv("OPENK3_CACHE", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="UNDECLARED_NAME"):
        cpu_kernels._build("portable")

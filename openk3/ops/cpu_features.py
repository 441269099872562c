"""What this CPU computes natively: its vector ISA (for the C kernels of `ops.cpu_kernels`) and whether it has bf16
arithmetic (for the choice between bf16 and fp32 compute on CPU, `ops.widen`).

    features()            -> CPUFeatures(arch, flags): read once from /proc/cpuinfo (Linux) or sysctl (macOS)
    features().isas()     -> the kernel builds this CPU runs, best first: ("avx512", "avx2", "portable") on a CPU
                             with AVX-512, ("avx2", "portable") on one with AVX2 + FMA only, ("portable",) elsewhere
    features().bf16_native -> whether the CPU multiplies bf16 in hardware (x86 AVX512-BF16 or AMX-BF16, Arm BF16)

Why bf16 arithmetic matters: without it the CPU math libraries have no bf16 GEMM path. On an AMD Zen 3 with AVX2
(measured for the issue that added this), torch's bf16 matmul ran at 0.8-1.1 GFLOP/s against 148 GFLOP/s in fp32,
so a bf16 checkpoint served in bf16 prefilled 4x slower than in fp32. On such a CPU openk3 computes bf16 models in
fp32 (`ops.widen`).
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from dataclasses import dataclass

# x86 flags (Linux /proc/cpuinfo names) that give bf16 arithmetic, and the Arm feature (Features: bf16).
X86_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
ARM_BF16_FLAGS = ("bf16",)
# macOS names the same features in sysctl (hw.optional.*); mapped onto the Linux names.
_SYSCTL_FLAGS = {"hw.optional.avx512f": "avx512f", "hw.optional.avx2_0": "avx2", "hw.optional.fma": "fma",
                 "hw.optional.f16c": "f16c", "hw.optional.arm.FEAT_BF16": "bf16", "hw.optional.neon": "asimd"}  # fmt: skip


@dataclass(frozen=True)
class CPUFeatures:
    arch: str  # platform.machine(): x86_64, aarch64, arm64, ...
    flags: frozenset[str]  # the CPU's feature flags, Linux /proc/cpuinfo names

    @property
    def x86(self) -> bool:
        return self.arch.lower() in ("x86_64", "amd64", "i686", "i386")

    @property
    def avx512(self) -> bool:
        return self.x86 and "avx512f" in self.flags

    @property
    def avx2(self) -> bool:
        """AVX2 with FMA (the C kernels' 8-lane path uses both)."""
        return self.x86 and {"avx2", "fma"} <= self.flags

    @property
    def bf16_native(self) -> bool:
        names = X86_BF16_FLAGS if self.x86 else ARM_BF16_FLAGS
        return any(f in self.flags for f in names)

    def isas(self) -> tuple[str, ...]:
        """The C kernel builds this CPU runs, best first (`ops.cpu_kernels` builds the first unless told otherwise)."""
        return (*(("avx512",) if self.avx512 else ()), *(("avx2",) if self.avx2 else ()), "portable")

    def summary(self) -> str:
        """One line for logs and `k3 info`: the ISA features that matter here and the bf16 verdict."""
        shown = [f for f in ("avx512f", "avx512_bf16", "amx_bf16", "avx2", "fma", "f16c", "asimd", "sve", "bf16")
                 if f in self.flags]  # fmt: skip
        bf16 = "bf16 arithmetic" if self.bf16_native else "no bf16 arithmetic"
        return f"{self.arch}: {' '.join(shown) or 'no vector features found'}; {bf16}"


def _linux_flags() -> set[str] | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return flags


def _sysctl_flags() -> set[str]:
    flags = set()
    for key, name in _SYSCTL_FLAGS.items():
        try:
            done = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=5, check=False)
        except (OSError, subprocess.SubprocessError):
            break
        if done.returncode == 0 and done.stdout.strip() == "1":
            flags.add(name)
    return flags


@functools.cache
def features() -> CPUFeatures:
    """This CPU's features (read once). OPENK3_CPU_BF16=0/1 overrides the bf16 verdict (to compare both paths on
    one machine)."""
    flags = _linux_flags()
    if flags is None:
        flags = _sysctl_flags()
    override = os.environ.get("OPENK3_CPU_BF16")
    if override in ("0", "1"):
        names = set(X86_BF16_FLAGS + ARM_BF16_FLAGS)
        flags = (flags - names) | (names if override == "1" else set())
    return CPUFeatures(platform.machine(), frozenset(flags))

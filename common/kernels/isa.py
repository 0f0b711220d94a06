"""Which instruction set this CPU runs: the one ISA detection every kernel build and dtype choice uses.

Nothing is compiled with ``-march=native``: the machines change between sessions (AVX2 only one day,
AVX-512 the next), so every module is built with explicit flags and named after its instruction set
(``tandem_cpu_avx512``, ``_avx2``, ``_generic``), and the CPU's flags choose which one loads. A cached
build therefore never runs on a CPU that lacks its instructions. ``TANDEM_CPU_ISA=avx2|avx512|generic``
forces a choice (tests use it to exercise the AVX2 path on an AVX-512 machine; a choice the CPU cannot run
is refused).
"""

from __future__ import annotations

import functools
from collections.abc import Set
from pathlib import Path

ISA_FLAGS: dict[str, list[str]] = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "generic": [],
}
# CPU flags (/proc/cpuinfo names) each build needs.
_REQUIRED = {
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"},
    "avx2": {"avx2", "fma", "f16c"},
    "generic": set(),
}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them; empty where /proc/cpuinfo is unreadable. Read once per
    process: the sampler asks for the kernels every step, and reading the file cost 0.35 ms each time."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def runnable_isas(flags: Set[str] | None = None) -> list[str]:
    """Every build this CPU can run, widest first (the override aside)."""
    flags = cpu_flags() if flags is None else flags
    return [isa for isa in ISA_FLAGS if _REQUIRED[isa] <= flags]


def best_isa(flags: Set[str] | None = None) -> str:
    """The widest instruction set whose build this CPU can run (``TANDEM_CPU_ISA`` forces one)."""
    flags = cpu_flags() if flags is None else flags
    from common.config.settings import kernel_setting

    forced = str(kernel_setting("cpu_isa"))  # TANDEM_CPU_ISA: checked against the choices there
    if forced:
        missing = _REQUIRED[forced] - flags
        if missing:
            raise ValueError(f"TANDEM_CPU_ISA={forced}: this CPU lacks {', '.join(sorted(missing))}")
        return forced
    return runnable_isas(flags)[0]

"""The machine a benchmark ran on, described in its report: CPU, cores, library versions, load."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what ``platform`` knows elsewhere."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


# The CPU flags that decide which kernels and dtypes run (Linux's names); every report states them.
VECTOR_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
                "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def present_flags(names: Sequence[str]) -> list[str]:
    """Which of ``names`` (Linux's CPU flag names) this CPU has, in that order (empty where /proc/cpuinfo
    is unreadable)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return []
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            return [f for f in names if f in have]
    return []


def vector_flags() -> list[str]:
    return present_flags(VECTOR_FLAGS)


def cpu_summary() -> str:
    """One line for a report: model name, usable cores, vector flags."""
    flags = vector_flags()
    return (f"{cpu_name()}, {len(os.sched_getaffinity(0))} usable cores; flags "
            f"{' '.join(flags) if flags else 'unknown'}")


def machine_description(threads: int) -> list[str]:
    import torch  # on use: `tandem` builds its parser from modules that import this one
    import transformers

    return [f"CPU: {cpu_name()}, {len(os.sched_getaffinity(0))} usable cores ({os.cpu_count()} online)",
            f"torch {torch.__version__} ({threads} thread{'s' if threads != 1 else ''}), "
            f"transformers {transformers.__version__}, Python {platform.python_version()}",
            f"native bf16 (AVX512-BF16): {torch.cpu._is_avx512_bf16_supported()}",
            f"load average at start (1/5/15 min): {load_average()}{oversubscription_warning(threads)}"]


def oversubscription_warning(threads: int) -> str:
    # OpenMP threads wait for each other at every op: when one is descheduled, all stall, so on a busy
    # machine more threads than idle cores can be several times slower than one thread.
    busy = os.getloadavg()[0]
    cores = len(os.sched_getaffinity(0))
    if threads <= 1 or busy + threads <= cores + 0.5:
        return ""
    return (f" — **warning**: load {busy:.1f} on {cores} cores; {threads} threads will stall each other "
            "(compare --threads 1)")


def load_average() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())

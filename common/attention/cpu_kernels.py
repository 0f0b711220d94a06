"""Compiled CPU kernels (``cpu_decode.cpp``), built on first use with torch's C++ extension loader.

The build needs a C++ compiler and ninja; it takes about a minute once, then loads from torch's
extension cache (``common.kernel_build``: concurrent builds by several processes wait on one lock, which a
killed build does not leave behind). Where the build is impossible the torch backend keeps its
pure-PyTorch path: ``paged_decode_kernel()`` returns None and says why once in the log.
``TANDEM_CPU_KERNELS=0`` turns the compiled path off (the benchmark's baseline, or to rule it out).

It is built with explicit instruction-set flags into a module named after that instruction set
(``tandem_cpu_decode_avx512``, ``_avx2``, ``_generic``; the CPU's flags pick one, as for the quantized
kernels), never ``-march=native`` under one fixed name: the machines change between sessions, and a
cached AVX-512 build loaded on an AVX2 machine dies with SIGILL.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from types import ModuleType

from common.config.settings import kernel_setting

log = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name(name) for name in ("cpu_decode.cpp", "cpu_kv_write.cpp")]
_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}


def kernels_enabled() -> bool:
    return bool(kernel_setting("cpu_kernels"))  # TANDEM_CPU_KERNELS, on the hot path: its variable alone


def paged_decode_kernel() -> ModuleType | None:
    """The extension module exposing ``paged_decode(query, key_cache, value_cache, block_tables, seq_lens,
    scale)``, or None when disabled or not buildable here (decided once per process)."""
    if not kernels_enabled():
        return None
    if "decode" in _state:  # every decode layer asks: no lock once decided
        return _state["decode"]
    with _lock:
        if "decode" not in _state:
            _state["decode"] = _build()
        return _state["decode"]


def _build() -> ModuleType | None:
    try:
        from common.kernel_build import load_kernel_module
        from common.quant.cpu_kernels import ISA_FLAGS, best_isa

        isa = best_isa()
        # -fopenmp: at::parallel_for is inline OpenMP; the library it needs (libgomp.so.1) is the one torch
        # already loaded, so kernel and torch share one thread pool. The ISA flags are explicit and part of
        # the module's name, so a cached build only ever loads on a CPU that has its instructions.
        # -ffast-math (compile only, never at link, so the process keeps IEEE denormals): vectorised exp
        # from glibc's vector math library and reassociated fp32 sums; scores are finite (only rows
        # < seq_len are read), so finite-math assumptions hold.
        flags = ["-O3", "-fopenmp", "-ffast-math", *ISA_FLAGS[isa]]
        functions = ["paged_decode", "write_kv", "decode_rows_address", "decode_splits_heads"]
        module = load_kernel_module(f"tandem_cpu_decode_{isa}", _SOURCES, functions, flags)
    except Exception as exc:  # no compiler, no ninja, a failed build: the torch path serves instead
        log.warning("compiled CPU decode attention unavailable (%s: %s); using the PyTorch path",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None
    return module

"""The compiled CPU kernels, one build per instruction set, picked at run time.

One module from six sources: ``cpu_base.cpp`` (the vector layer), ``cpu_quant.cpp``, ``cpu_quant_a8.cpp``,
``cpu_quant_panel.cpp``, ``cpu_amx.cpp``, ``cpu_gemv.cpp``. The AVX-512 build also holds AVX512-VNNI,
AVX512-BF16 and AMX inner loops, chosen by the CPU at run time (``int8_panel_path()``,
``dense_panel_path()``).

The machines Tandem runs on change (AVX2 only one day, AVX-512 the next), so nothing is compiled with
``-march=native``: the source is built with explicit flags into a module named after its instruction set
(``tandem_quant_avx512``, ``tandem_quant_avx2``, ``tandem_quant_generic``), and the CPU's flags choose
which one loads. A cached build therefore never runs on a CPU that lacks its instructions.
``TANDEM_CPU_ISA=avx2|avx512|generic`` forces a choice (tests use it to exercise the AVX2 path on an
AVX-512 machine; a choice the CPU cannot run is refused). The first build takes about a minute.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

# One translation unit, in this order: the vector layer, then the kernels standing on it.
_SOURCES = [Path(__file__).with_name(name) for name in
            ("cpu_base.cpp", "cpu_quant.cpp", "cpu_quant_a8.cpp", "cpu_quant_panel.cpp", "cpu_amx.cpp", "cpu_gemv.cpp")]
_FUNCTIONS = ["isa", "int4_matmul", "int8_matmul", "int4_matmul_a8", "int8_matmul_a8", "int4_dequantize",
              "int8_dequantize", "dense_matmul", "int8_matmul_panel", "int4_matmul_panel",
              "int8_panel_path", "dense_matmul_panel", "dense_panel_path",
              "int8_matmul_panel_amx", "int4_matmul_panel_amx", "int8_dequantize_panel", "int4_dequantize_panel"]
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
_lock = threading.Lock()
_modules: dict[str, ModuleType] = {}


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux names them; empty where /proc/cpuinfo is unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def runnable_isas(flags: set[str] | None = None) -> list[str]:
    """Every build this CPU can run, widest first (the override aside)."""
    flags = cpu_flags() if flags is None else flags
    return [isa for isa in ISA_FLAGS if _REQUIRED[isa] <= flags]


def best_isa(flags: set[str] | None = None) -> str:
    """The widest instruction set whose build this CPU can run (``TANDEM_CPU_ISA`` forces one)."""
    flags = cpu_flags() if flags is None else flags
    forced = os.environ.get("TANDEM_CPU_ISA", "").strip().lower()
    if forced:
        if forced not in ISA_FLAGS:
            raise ValueError(f"TANDEM_CPU_ISA={forced!r}; choose one of {', '.join(ISA_FLAGS)}")
        missing = _REQUIRED[forced] - flags
        if missing:
            raise ValueError(f"TANDEM_CPU_ISA={forced}: this CPU lacks {', '.join(sorted(missing))}")
        return forced
    return runnable_isas(flags)[0]


def quant_kernels(isa: str | None = None) -> ModuleType:
    """The extension module for ``isa`` (default: ``best_isa()``), built on first use.

    Raises RuntimeError naming the cause when it cannot be built (no compiler, no ninja): quantized
    weights on CPU need it, and start-up should say so rather than fall back to a slow path silently.
    """
    isa = best_isa() if isa is None else isa
    if isa in _modules:
        return _modules[isa]
    with _lock:
        if isa not in _modules:
            _modules[isa] = _build(isa)
        return _modules[isa]


def _build(isa: str) -> ModuleType:
    try:
        from common.kernel_build import load_kernel_module

        # -fopenmp: at::parallel_for is inline OpenMP and shares torch's thread pool (libgomp).
        flags = ["-O3", "-fopenmp", *ISA_FLAGS[isa]]
        module = load_kernel_module(f"tandem_quant_{isa}", _SOURCES, _FUNCTIONS, flags)
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise RuntimeError(f"the quantized CPU kernels ({isa}) could not be built: {type(exc).__name__}: "
                           f"{first}; --quantization on CPU needs a C++ compiler and ninja") from exc
    log.info("quantized CPU kernels: %s", module.isa())
    return module


NO_AMX = 1 << 62  # a row threshold no call reaches: AMX off
_amx_state: dict[str, bool] = {}


def amx_enabled(ops: ModuleType) -> bool:
    """Whether the AMX loops run (``TANDEM_CPU_AMX=auto|on|off``): auto where the CPU and its kernel grant
    AMX tiles (``ops.dense_panel_path() == "amx"``), on: that or an error, off: never."""
    mode = os.environ.get("TANDEM_CPU_AMX", "auto").strip().lower() or "auto"
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"TANDEM_CPU_AMX={mode!r}; choose one of auto, on, off")
    key = f"{mode}:{ops.__name__}"
    if key not in _amx_state:
        amx = ops.dense_panel_path() == "amx"
        if mode == "on" and not amx:
            raise RuntimeError("TANDEM_CPU_AMX=on but this CPU (or its kernel, or this build) grants no AMX tiles")
        _amx_state[key] = amx and mode != "off"
    return _amx_state[key]


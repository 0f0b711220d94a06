"""The quantized and float panel kernels on CPU, one build per instruction set, picked at run time.

Their sources (``cpu_base.cpp``, the vector layer, then ``cpu_quant.cpp``, ``cpu_quant_a8.cpp``,
``cpu_quant_panel.cpp``, ``cpu_amx.cpp``, ``cpu_gemv.cpp``) are compiled into Tandem's one CPU kernel module,
``tandem_cpu_<isa>`` (common/cpu_kernel_module.py, beside the fused ops and the one-call decode step). The
AVX-512 build also holds AVX512-VNNI, AVX512-BF16 and AMX inner loops, chosen by the CPU at run time
(``int8_panel_path()``, ``dense_panel_path()``).

The machines Tandem runs on change (AVX2 only one day, AVX-512 the next), so nothing is compiled with
``-march=native``: the module is built with explicit flags and named after its instruction set
(``tandem_cpu_avx512``, ``tandem_cpu_avx2``, ``tandem_cpu_generic``), and the CPU's flags choose which one
loads. A cached build therefore never runs on a CPU that lacks its instructions.
``TANDEM_CPU_ISA=avx2|avx512|generic`` forces a choice (tests use it to exercise the AVX2 path on an
AVX-512 machine; a choice the CPU cannot run is refused). The first build takes about a minute.
"""

from __future__ import annotations

import logging
from types import ModuleType

from common.cpu_kernel_module import ISA_FLAGS, best_isa, build_error, cpu_flags, cpu_kernels, runnable_isas

log = logging.getLogger(__name__)
__all__ = ["ISA_FLAGS", "NO_AMX", "amx_enabled", "best_isa", "cpu_flags", "quant_kernels", "runnable_isas"]

_logged: set[str] = set()


def quant_kernels(isa: str | None = None) -> ModuleType:
    """The CPU kernel module for ``isa`` (default: ``best_isa()``; common/cpu_kernel_module.py), built on
    first use.

    Raises RuntimeError naming the cause when it cannot be built (no compiler, no ninja): quantized
    weights on CPU need it, and start-up should say so rather than fall back to a slow path silently.
    """
    isa = best_isa() if isa is None else isa
    module = cpu_kernels(isa)
    if module is None:
        raise RuntimeError(f"the quantized CPU kernels ({isa}) could not be built: {build_error(isa)}; "
                           "--quantization on CPU needs a C++ compiler and ninja")
    if isa not in _logged:
        _logged.add(isa)
        log.info("quantized CPU kernels: %s", module.isa())
    return module


NO_AMX = 1 << 62  # a row threshold no call reaches: AMX off
_amx_state: dict[str, bool] = {}


def amx_enabled(ops: ModuleType) -> bool:
    """Whether the AMX loops run (``TANDEM_CPU_AMX=auto|on|off``): auto where the CPU and its kernel grant
    AMX tiles (``ops.dense_panel_path() == "amx"``), on: that or an error, off: never."""
    from common.config.settings import kernel_setting

    mode = str(kernel_setting("cpu_amx"))  # TANDEM_CPU_AMX
    key = f"{mode}:{ops.__name__}"
    if key not in _amx_state:
        amx = ops.dense_panel_path() == "amx"
        if mode == "on" and not amx:
            raise RuntimeError("TANDEM_CPU_AMX=on but this CPU (or its kernel, or this build) grants no AMX tiles")
        _amx_state[key] = amx and mode != "off"
    return _amx_state[key]


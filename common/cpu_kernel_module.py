"""Tandem's CPU kernels in one compiled module per instruction set (``tandem_cpu_<isa>``): the quantized and
float panel kernels (common/quant/cpu_*.cpp, in namespace ``tq``), the fused layer ops
(common/model/cpu_fused.cpp and the paged K/V write, namespace ``tf``) and the one-call decode step
(common/model/cpu_step.cpp), in one translation unit.

The step calls the other kernels' functions directly, so its unit holds their sources anyway; exporting
them from it too, instead of building a module for each, compiles those sources once rather than twice in
every kernel build (docs/cpu-kernels.md has a cold build's times), and the op-by-op path and the step run
the very same machine code. Paged decode attention keeps a module of its own (common/attention/cpu_kernels.py):
it is built with other flags (-ffast-math).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from common.kernel_build import OptionalModules, Source

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
    from common.config.settings import kernel_setting

    forced = str(kernel_setting("cpu_isa"))  # TANDEM_CPU_ISA: checked against the choices there
    if forced:
        missing = _REQUIRED[forced] - flags
        if missing:
            raise ValueError(f"TANDEM_CPU_ISA={forced}: this CPU lacks {', '.join(sorted(missing))}")
        return forced
    return runnable_isas(flags)[0]


_COMMON = Path(__file__).parent
_QUANT_FILES = ("cpu_base.cpp", "cpu_quant.cpp", "cpu_quant_a8.cpp", "cpu_quant_panel.cpp", "cpu_amx.cpp",
                "cpu_gemv.cpp")
# The headers, then each kernel file in its own namespace (their vector helpers share names), then the step.
SOURCES: list[Source] = [
    _COMMON / "model" / "cpu_step_includes.h",
    *(("tq", _COMMON / "quant" / name) for name in _QUANT_FILES),
    ("tf", _COMMON / "model" / "cpu_fused.cpp"),
    ("tf", _COMMON / "attention" / "cpu_kv_write.cpp"),
    _COMMON / "model" / "cpu_step.cpp",
]
QUANT_FUNCTIONS = ("isa", "int4_matmul", "int8_matmul", "int4_matmul_a8", "int8_matmul_a8", "int4_dequantize",
                   "int8_dequantize", "dense_matmul", "int8_matmul_panel", "int4_matmul_panel", "int8_panel_path",
                   "dense_matmul_panel", "dense_panel_path", "int8_matmul_panel_amx", "int4_matmul_panel_amx",
                   "int8_dequantize_panel", "int4_dequantize_panel")
FUSED_FUNCTIONS = ("add_rms_norm", "silu_mul", "rotary_", "rotary_write_kv_", "argmax_rows")
STEP_FUNCTIONS = ("decode_step_plan", "decode_step_run", "decode_step_free", "decode_step_profile",
                  "decode_step_times")
_BUILDS = OptionalModules(
    "tandem_cpu", SOURCES,
    [*(f"tq::{f}" for f in QUANT_FUNCTIONS), *(f"tf::{f}" for f in FUSED_FUNCTIONS), *STEP_FUNCTIONS],
    "the CPU kernels", "float models run their slower paths; quantized ones cannot load")


def cpu_kernels(isa: str | None = None) -> ModuleType | None:
    """The module for ``isa`` (default: the widest this CPU runs), built once; None where it cannot be
    built (no compiler or ninja: ``build_error`` says why)."""
    isa = best_isa() if isa is None else isa
    return _BUILDS.get(isa, ISA_FLAGS[isa])


def build_error(isa: str) -> str:
    """Why the module for ``isa`` could not be built ("" if it was, or was not tried)."""
    return _BUILDS.error(isa)

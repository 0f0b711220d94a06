"""Tandem's compiled CPU kernels: two modules per instruction set, their loaders, and the AMX switch.

- ``tandem_cpu_<isa>`` (``cpu_kernels``): the quantized and float panel kernels (``cpu_base.cpp`` and the
  ``cpu_quant*.cpp`` / ``cpu_amx.cpp`` / ``cpu_gemv.cpp`` files and a mixture of experts' routed experts on
  those panels, ``cpu_moe.cpp``, namespace ``tq``), the fused layer ops and
  the paged K/V write (``cpu_fused.cpp``, ``cpu_kv_write.cpp``, namespace ``tf``) and the one-call decode
  step (``cpu_step.cpp``), in one translation unit. The step calls the other kernels directly, so its unit
  holds their sources anyway; exporting them from it too compiles them once rather than twice, and the
  op-by-op path and the step run the very same machine code.
- ``tandem_cpu_decode_<isa>`` (``paged_decode_kernel``): paged decode attention (``cpu_decode.cpp``), built
  apart because it is compiled with ``-ffast-math`` (vectorised exp, reassociated fp32 sums over finite
  scores), which the linears must not be.

Both are built by ``common.kernels.build`` (one cache, one lock scheme) for the instruction set that
``common.kernels.isa`` picks. **One error behaviour**: a module that cannot be built (no compiler or ninja)
is logged once and its loader returns None, so an optional fast path gives way to PyTorch's; what cannot run
without it (quantized weights on CPU: ``quant_kernels``) raises at start-up, naming the cause.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

from common.config.settings import kernel_setting
from common.kernels.build import OptionalModules, Source
from common.kernels.isa import ISA_FLAGS, best_isa

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_QUANT_FILES = ("cpu_base.cpp", "cpu_quant.cpp", "cpu_quant_a8.cpp", "cpu_quant_panel.cpp", "cpu_amx.cpp",
                "cpu_gemv.cpp", "cpu_moe.cpp")
# The headers, then each kernel file in its own namespace (their vector helpers share names), then the step.
SOURCES: list[Source] = [
    _HERE / "cpu_step_includes.h",
    _HERE / "amx_tiles.h",
    *(("tq", _HERE / name) for name in _QUANT_FILES),
    ("tf", _HERE / "cpu_fused.cpp"),
    ("tf", _HERE / "cpu_kv_write.cpp"),
    _HERE / "cpu_step.cpp",
]
QUANT_FUNCTIONS = ("isa", "int4_matmul", "int8_matmul", "int4_matmul_a8", "int8_matmul_a8", "int4_dequantize",
                   "int8_dequantize", "dense_matmul", "int8_matmul_panel", "int4_matmul_panel", "int8_panel_path",
                   "dense_matmul_panel", "dense_panel_path", "int8_matmul_panel_amx", "int4_matmul_panel_amx",
                   "int8_dequantize_panel", "int4_dequantize_panel", "moe_experts", "moe_experts_packed")
FUSED_FUNCTIONS = ("add_rms_norm", "silu_mul", "rotary_", "rotary_write_kv_", "argmax_rows", "sample_rows")
STEP_FUNCTIONS = ("decode_step_plan", "decode_step_run", "decode_step_free", "decode_step_profile",
                  "decode_step_times")
# -fno-math-errno: exp vectorises through glibc's vector math without -ffast-math's reassociation of the
# dtype roundings.
_BUILDS = OptionalModules(
    "tandem_cpu", SOURCES,
    [*(f"tq::{f}" for f in QUANT_FUNCTIONS), *(f"tf::{f}" for f in FUSED_FUNCTIONS), *STEP_FUNCTIONS],
    ["-O3", "-fopenmp", "-fno-math-errno"],
    "the CPU kernels", "float models run their slower paths; quantized ones cannot load")
# -ffast-math (compile only, never at link, so the process keeps IEEE denormals): vectorised exp and
# reassociated fp32 sums; scores are finite (only rows < seq_len are read), so finite-math assumptions hold.
_DECODE = OptionalModules(
    "tandem_cpu_decode",
    [_HERE / "amx_tiles.h", _HERE / "cpu_decode.cpp", _HERE / "cpu_kv_write.cpp", _HERE / "cpu_prefill_attn.cpp"],
    ["paged_decode", "paged_decode_widened", "set_cascade", "write_kv", "decode_rows_address", "decode_splits_heads",
     "paged_prefill", "paged_prefill_widened", "paged_prefill_bf16dot", "prefill_amx_ready", "prefill_bf16dot_ready",
     "prefill_f32_ready"],
    ["-O3", "-fopenmp", "-ffast-math"],
    "compiled CPU decode attention", "using the PyTorch path")


def cpu_kernels(isa: str | None = None) -> ModuleType | None:
    """The linears / fused ops / step module for ``isa`` (default: the widest this CPU runs), built once;
    None where it cannot be built (``build_error`` says why)."""
    isa = best_isa() if isa is None else isa
    return _BUILDS.get(isa, ISA_FLAGS[isa])


def build_error(isa: str) -> str:
    """Why the module for ``isa`` could not be built ("" if it was, or was not tried)."""
    return _BUILDS.error(isa)


def kernels_enabled() -> bool:
    return bool(kernel_setting("cpu_kernels"))  # TANDEM_CPU_KERNELS, on the hot path: its variable alone


def paged_decode_kernel() -> ModuleType | None:
    """The module exposing ``paged_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, window)``
    (window 0: the whole sequence; w: the last w positions),
    or None when ``TANDEM_CPU_KERNELS=0`` or it cannot be built here (decided once per process)."""
    if not kernels_enabled():
        return None
    isa = best_isa()
    module = _DECODE.get(isa, ISA_FLAGS[isa])
    if module is not None:
        _apply_cascade(module)
    return module


_cascade_applied: dict[int, str] = {}


def _apply_cascade(module: ModuleType) -> None:
    """Cascade decode attention (cpu_decode.cpp's PrefixState) as ``TANDEM_CPU_CASCADE`` says: auto, where it runs
    (fp32 on the AVX-512 and AVX2 builds, bf16 where the CPU has AVX512-BF16); on, that or an error where the build
    has no vector path; off, never. Applied when the variable's value changes."""
    mode = str(kernel_setting("cpu_cascade"))
    if _cascade_applied.get(id(module)) == mode:
        return
    runs = bool(module.set_cascade(mode != "off"))
    if mode == "on" and not runs:
        raise RuntimeError("TANDEM_CPU_CASCADE=on, but cascade decode attention needs the AVX-512 or AVX2 kernel "
                           "build")
    _cascade_applied[id(module)] = mode


_logged: set[str] = set()


def quant_kernels(isa: str | None = None) -> ModuleType:
    """``cpu_kernels(isa)``, for what cannot run without it: raises RuntimeError naming the cause when it
    cannot be built (quantized weights on CPU need it, and start-up should say so rather than fall back to
    a slow path silently)."""
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
    mode = str(kernel_setting("cpu_amx"))  # TANDEM_CPU_AMX
    key = f"{mode}:{ops.__name__}"
    if key not in _amx_state:
        amx = ops.dense_panel_path() == "amx"
        if mode == "on" and not amx:
            raise RuntimeError("TANDEM_CPU_AMX=on but this CPU (or its kernel, or this build) grants no AMX tiles")
        _amx_state[key] = amx and mode != "off"
    return _amx_state[key]

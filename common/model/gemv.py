"""Float linear methods on CPU at decode sizes: Tandem's GEMV kernels, the library's matmul above them.

A decode step multiplies each weight matrix by a handful of rows, so it is bound by streaming the weights
from DRAM; oneDNN's and MKL's GEMVs stream well below the machine's bandwidth (benchmarks/results has the
figures), so Tandem multiplies float weights with its own kernels there (``common/kernels/cpu/cpu_gemv.cpp``).

- ``PanelMethod`` (where out_features is a multiple of 16): the weight held in 16-row panels
  (``pack_panels``), multiplied by ``dense_matmul_panel``: each thread streams whole panels, ``vdpbf16ps``
  on AVX512-BF16. Above the rows where tiles unpacked from the panels through torch's GEMM measured faster
  here at start-up (``_panel_max_rows``; fp32 always, bf16 without AMX), tiles are unpacked for it; where
  torch's GEMM on row-major weights beat the panels below ``PANEL_MIN_CROSSOVER`` rows (``gemm_crossover``)
  weights stay row-major (``GemvMethod``, ``panels_pay``). Where the CPU grants
  AMX, from ``AMX_MIN_ROWS`` rows the bf16 panels go straight into AMX tiles
  (``common/kernels/cpu/cpu_amx.cpp``: the bf16 panel layout is the tile unit's B layout) at every row count, but
  from the prefill sizes where oneDNN's bf16 GEMM on a prepacked copy measured no slower here
  (``onednn_bf16_rows``, ``TANDEM_CPU_ONEDNN``).
  ``TANDEM_CPU_AMX=auto|on|off``. A tied LM head runs panels too and the token lookup reads its rows
  (``TiedEmbedding``): one copy of the matrix. ``TANDEM_CPU_PANELS=off`` keeps row-major weights.
- ``GemvMethod`` (other shapes, and float weights where panels do not pay): ``dense_matmul``, row-major tiles
  with software prefetch, up to the rows where it measured faster than the GEMM used above it here
  (``_gemv_max_rows``); above, fp32 weights also held prepacked in oneDNN's blocked layout where oneDNN's GEMM
  measured faster than ``F.linear`` here (``onednn_pays``, ``TANDEM_CPU_ONEDNN``; vLLM's CPU path too), else
  ``F.linear`` (row-bucketed for 16-bit activations, common/model/row_buckets.py).

The registry (common/quant/registry.py) picks them for float layers on CPU: ``TANDEM_CPU_GEMV=auto|on|off``
(auto: where the kernels build; on: or a start-up error; off: the library's matmuls only). Within a path
each row's result does not depend on the rows beside it. Where AMX runs from 2 rows, a 1-row decode
(``vdpbf16ps``) and a multi-row call (AMX tiles) sum in a different order, so in bf16 a speculative
verification row can differ from the plain decode row in the last bit (fp32 panels have one path: rows equal).
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from common.config.settings import kernel_setting
from common.kernels.cpu import NO_AMX, amx_enabled
from common.model import start_races
from common.model.linear import Linear, LinearMethod, StepWeights, TorchMethod
from common.model.row_buckets import bucket_rows, bucket_values, on_bucketed_rows
from common.model.start_races import (  # the races' timing and reading rules (re-exported for callers)
    PROBE_SHAPE,
    crossover_rows,
    onednn_from_rows,
    retime,
    retime_losses_beside_wins,
    retime_out_of_order,
)
from common.quant.cpu_linear import GEMV_MAX_ROWS, TILE_ELEMENTS  # one limit for float and packed weights
from common.quant.panels import PANEL_ROWS

if TYPE_CHECKING:
    from torch import nn

    from common.quant.formats import QuantizedWeight

log = logging.getLogger(__name__)

_FLOATS = (torch.float32, torch.bfloat16)
_state: dict[str, ModuleType | None] = {}
_limits: dict[str, int] = {}


def gemv_mode() -> str:
    return str(kernel_setting("cpu_gemv"))  # TANDEM_CPU_GEMV


def gemv_kernels() -> ModuleType | None:
    """The compiled kernels (``dense_matmul``), or None where they cannot be built (decided once)."""
    if "ops" not in _state:
        from common.kernels.cpu import quant_kernels

        try:
            _state["ops"] = quant_kernels()
        except RuntimeError as exc:
            log.warning("CPU GEMV kernel unavailable (%s); linear layers use torch's matmul", exc)
            _state["ops"] = None
    return _state["ops"]


class GemvMethod(TorchMethod):
    """Float weights, row-major: ``dense_matmul`` up to the rows where it measured faster than torch's GEMM
    here (``_gemv_max_rows``), ``TorchMethod``'s ``F.linear`` above it (row-bucketed for 16-bit activations:
    common/model/row_buckets.py)."""

    name = "gemv"

    def __init__(self, ops: ModuleType, bucketed: bool) -> None:
        super().__init__(bucketed)
        self._ops = ops
        self._max_rows = GEMV_MAX_ROWS  # set for the weight's dtype once it is loaded
        self._onednn: torch.Tensor | None = None  # the weight in oneDNN's layout, where its GEMM pays (onednn_pays)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        weight, bias = layer.weight, layer.bias
        if (x.shape[0] <= self._max_rows and x.dtype in _FLOATS and weight.dtype in _FLOATS
                and x.device.type == "cpu"):
            y = self._ops.dense_matmul(x if x.is_contiguous() else x.contiguous(), weight)
            return y if bias is None else y + bias
        blocked = self._onednn
        if blocked is not None and x.dtype == torch.float32 and x.device.type == "cpu":
            return onednn_linear(x, blocked, bias)
        return super().apply(layer, x)

    def process_weights_after_loading(self, layer: Linear, packed: QuantizedWeight | None) -> None:
        layer.weight.data = layer.weight.data.contiguous()  # the GEMV streams rows as they lie
        dtype = layer.weight.dtype
        if dtype in _FLOATS:
            if layer.weight.device.type == "cpu" and layer.weight.numel() and onednn_pays(dtype):
                # A second copy of the weight, in oneDNN's layout (a buffer, so the layer's weight_bytes counts
                # it): the GEMV and the one-call step stream the row-major one. (An empty weight, a layer another
                # pipeline rank holds, has no oneDNN primitive.)
                self._onednn = onednn_pack(layer.weight.detach())
                layer.register_buffer("onednn_weight", self._onednn, persistent=False)
            self._max_rows = _gemv_max_rows(self._ops, dtype)

    def refresh(self, layer: Linear) -> None:
        self._onednn = layer._buffers.get("onednn_weight")

    def describe(self) -> str:
        return f"{self.name}, oneDNN above {self._max_rows} rows" if self._onednn is not None else self.name

    def step_weights(self, layer: Linear, dtype: torch.dtype) -> StepWeights | None:
        """fp32 weights with fp32 activations: the one-call step runs ``dense_matmul``'s tiles on them (kind 33)
        up to the same row limit; bf16 row-major weights keep the op-by-op path."""
        weight = layer.weight
        if dtype != torch.float32 or weight.dtype != torch.float32:
            return None
        empty = torch.empty(0)
        return StepWeights((weight.detach(), empty, empty), 33, layer.in_features, self._max_rows, NO_AMX)


# The row counts probed for the row-major GEMV's limit. GEMV_MAX_ROWS (8) was the quantized kernels' measured
# limit and float weights took it too; on the 2-core AVX-512/AMX Xeon (session 26, fp32, SmolLM2's weights
# streamed from DRAM) dense_matmul beat MKL's GEMM up to 12 rows and tied at 16 (30 layers: 12 rows 29.9 vs
# 38.2 ms), and a served decode step of 9-12 rows took 66-75 ms against 42 ms at 8.
GEMV_PROBES = (GEMV_MAX_ROWS, 12, 16, 24, 32)


def _gemv_max_rows(ops: ModuleType, dtype: torch.dtype) -> int:
    """Rows up to which ``GemvMethod`` multiplies row-major ``dtype`` weights with ``dense_matmul`` in this
    process (measured once, against the GEMM that runs above it: oneDNN's where it pays, else torch's)."""
    key = f"gemv_{dtype}"
    if key not in _limits:
        onednn = onednn_pays(dtype)
        timings = retime_out_of_order(measure_gemv(ops, dtype, onednn),
                                      lambda probes: measure_gemv(ops, dtype, onednn, probes))
        _limits[key] = crossover_rows(timings)
        log.info("row-major %s weights: Tandem's GEMV up to %d rows here; %s above", dtype, _limits[key],
                 "oneDNN's GEMM on prepacked weights" if onednn else "torch's GEMM")
    return _limits[key]


def measure_gemv(ops: ModuleType, dtype: torch.dtype, onednn: bool = False,
                 probes: tuple[int, ...] = GEMV_PROBES) -> dict[int, tuple[float, float]]:
    """Per probed row count, the best of a few timings of (``dense_matmul``, the GEMM: oneDNN's on the weight
    prepacked with ``onednn``, else torch's) on one row-major weight (the panels' probe shape)."""
    versus = (onednn_pack, onednn_linear) if onednn else None
    return start_races.race(dtype, probes, lambda w: w, lambda x, w: ops.dense_matmul(x, w), versus)


# oneDNN's GEMM on weights prepacked in its blocked layout (the path vLLM's CPU backend takes for float weights).
# On the 2-core AVX-512/AMX Xeon (session 27, fp32, 30 layers of SmolLM2's shapes streamed, 2 threads) it beat
# torch's F.linear (MKL on row-major weights) 1.3x at 16-24 rows, 1.2x at 32 and 128, 1.04-1.09x at 48-384, and
# Tandem's GEMV from 12 rows; 1 thread: 1.2-1.6x from 8 rows. Rows come out the same whatever the rows beside
# them (checked at 17-257 rows). Measured where it runs, not assumed: ONEDNN_PROBES.
ONEDNN_PROBES = (16, 64, 256)


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's prepacked linear (CPU builds with mkldnn)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """A row-major ``[N, K]`` weight in oneDNN's blocked layout for ``onednn_linear`` (a copy)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def onednn_linear(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W^T (+ bias)`` with W prepacked by ``onednn_pack``."""
    return torch.ops.mkldnn._linear_pointwise(x, blocked, bias, "none", [], "")


def _onednn_mode() -> str:
    """``TANDEM_CPU_ONEDNN`` where oneDNN can run: on, off or auto (to measure); without oneDNN's linear in this
    torch build, off, or a start-up error for on."""
    mode = str(kernel_setting("cpu_onednn"))
    if mode != "off" and not onednn_available():
        if mode == "on":
            raise RuntimeError("TANDEM_CPU_ONEDNN=on but this torch build has no oneDNN linear (torch.ops.mkldnn)")
        return "off"
    return mode


def onednn_pays(dtype: torch.dtype) -> bool:
    """Whether row-major ``dtype`` weights are also held prepacked for oneDNN's GEMM in this process
    (``TANDEM_CPU_ONEDNN``): fp32 only; auto: where oneDNN measured no slower than ``F.linear`` at every
    ``ONEDNN_PROBES`` row count here (once); on: always (a start-up error without it); off: never."""
    mode = _onednn_mode() if dtype == torch.float32 else "off"
    if mode != "auto":
        return mode == "on"
    key = f"onednn_{dtype}"
    if key not in _limits:
        def race(probes: tuple[int, ...]) -> dict[int, tuple[float, float]]:
            return start_races.race(dtype, probes, onednn_pack, onednn_linear)

        # A probe oneDNN lost while it won another is timed again before it turns oneDNN off (retime).
        timings = retime(race(ONEDNN_PROBES), race, lambda t: tuple(
            m for m in sorted(t) if t[m][0] > t[m][1] and any(a <= b for a, b in t.values())))
        _limits[key] = int(all(ours <= theirs for ours, theirs in timings.values()))
        log.info("%s GEMM above the GEMV's rows: %s here (%s)", dtype,
                 "oneDNN on prepacked weights" if _limits[key] else "torch's F.linear (oneDNN was not faster)",
                 ", ".join(f"{m} rows {a * 1e3:.2f} vs {b * 1e3:.2f} ms" for m, (a, b) in sorted(timings.items())))
    return bool(_limits[key])


PANEL_MAX_ROWS = 256  # up to here the panel kernel; above, oneDNN / MKL on unpacked tiles (measured faster)

# The row counts probed for bf16 panels against oneDNN's bf16 GEMM on a prepacked copy (prefill sizes). On a 2-core
# AVX-512/AMX Xeon (session 29) oneDNN took SmolLM2's four projections in 4.7 ms a layer at 1,536 rows against the
# panels' 6.4 in AMX tiles (384 rows: 1.43 vs 1.48), and calls above 256 rows sent to it prefilled 4 x 384 tokens
# in 0.82x the panels' time; at decode sizes the panels stay (they stream the weights; oneDNN's GEMV does not). On a
# 2-core Zen 4 EPYC (session 34: AVX512-BF16, no AMX, two threads) against the panels' vdpbf16ps: 256 rows 4.49 vs
# 4.87 ms a layer, 1,024 rows 17.6 vs 20.4, 2,048 rows 36.3 vs 46.2.
AMX_ONEDNN_PROBES = (256, 512, 1024, 2048)


def onednn_bf16_rows(ops: ModuleType) -> int:
    """Rows from which a bf16 ``PanelMethod`` layer multiplies with oneDNN's GEMM on a prepacked copy of its weight
    (``TANDEM_CPU_ONEDNN``), where the panels run in AMX tiles or on AVX512-BF16 (``dense_panel_path``): auto: the
    smallest of ``AMX_ONEDNN_PROBES`` from which oneDNN measured no slower than the panels at it and every larger
    probe here (once); on: the smallest probe; off, neither path (AVX2's panels: no measurement), no oneDNN, or
    oneDNN slower at the largest probe: ``NO_AMX`` (never)."""
    native = _amx_min_rows(ops) < NO_AMX or ops.dense_panel_path() == "avx512bf16"
    mode = _onednn_mode() if native else "off"
    if mode != "auto":
        return AMX_ONEDNN_PROBES[0] if mode == "on" else NO_AMX
    if "onednn_bf16_rows" not in _limits:
        amx_rows = _amx_min_rows(ops)
        def race(probes: tuple[int, ...]) -> dict[int, tuple[float, float]]:
            return start_races.race(torch.bfloat16, probes, pack_panels,
                         lambda x, p: ops.dense_matmul_panel(x, p, amx_rows, False),
                         versus=(onednn_pack, onednn_linear))

        timings = retime_losses_beside_wins(race(AMX_ONEDNN_PROBES), race)
        _limits["onednn_bf16_rows"] = onednn_from_rows(timings)
        log.info("bf16 GEMM %s on panels %s here (%s)", "in AMX tiles" if amx_rows < NO_AMX else "in AVX512-BF16",
                 "at every size" if _limits["onednn_bf16_rows"] >= NO_AMX
                 else f"below {_limits['onednn_bf16_rows']} rows, oneDNN's on a prepacked copy from there",
                 ", ".join(f"{m} rows {a * 1e3:.2f} vs {b * 1e3:.2f} ms" for m, (a, b) in sorted(timings.items())))
    return _limits["onednn_bf16_rows"]


# from 2 rows AMX tiles (where the CPU has them) beat vdpbf16ps (measured: benchmarks/results/2026-12-01-amx/RESULTS.md)
AMX_MIN_ROWS = 2


def _amx_min_rows(ops: ModuleType) -> int:
    """Rows from which ``dense_matmul_panel`` runs AMX tiles (``TANDEM_CPU_AMX``; never: ``NO_AMX``)."""
    if "amx_min_rows" not in _limits:
        _limits["amx_min_rows"] = AMX_MIN_ROWS if amx_enabled(ops) else NO_AMX
    return _limits["amx_min_rows"]


def amx_min_rows() -> int:
    """Rows from which bf16 panels multiply in AMX tiles in this process (``NO_AMX``: never; the one-call
    decode step, common/model/decode_step.py, follows the same threshold)."""
    ops = gemv_kernels()
    return NO_AMX if ops is None else _amx_min_rows(ops)


def panel_max_rows(dtype: torch.dtype = torch.bfloat16) -> int:
    """Rows up to which ``PanelMethod`` multiplies ``dtype`` panels as they lie in this process (0: no
    kernels); the one-call decode step (common/model/decode_step.py) follows the same limit."""
    ops = gemv_kernels()
    return 0 if ops is None else _panel_max_rows(ops, dtype)


def _panel_max_rows(ops: ModuleType, dtype: torch.dtype = torch.bfloat16) -> int:
    """Rows up to which ``dtype`` panels multiply as they lie: bf16 with AMX at any count; otherwise as far as the
    panel kernel measured faster here than what takes the rows above it, tiles unpacked from the panels through
    torch's GEMM (``tiled_matmul``; at every count where it won at the largest of ``TILED_PROBES``), and at
    least as far as it beat torch's GEMM on row-major weights (``gemm_crossover``).

    Session 34 (2-core AMD EPYC, Zen 4: AVX512-BF16, no AMX, one thread): the race against the row-major GEMM
    alone read 32-256 rows from start to start (within 10% of the panels from 64 rows up: 4.25 vs 4.61 ms a
    layer of SmolLM2's shapes at 99 rows), but above the limit the layer unpacks tiles, 2-3x the panels' time
    up to 128 rows (99 rows 13.6 ms) and still 1.1-1.25x at 512-1,024: a server that read 64 prefilled a 99-token turn
    in 420-550 ms where one that read 128 or 256 took ~240."""
    if dtype == torch.bfloat16 and _amx_min_rows(ops) < NO_AMX:
        return NO_AMX
    key = f"panel_limit_{dtype}"
    if key not in _limits:
        gemm = gemm_crossover(ops, dtype)
        limit = gemm
        probes = tuple(m for m in TILED_PROBES if m > gemm)
        if probes:
            timings = retime_out_of_order(measure_tiled(ops, dtype, probes),
                                          lambda again: measure_tiled(ops, dtype, again))
            if timings[probes[0]][0] <= timings[probes[0]][1]:  # the panels beat the tiles past the GEMM's limit
                tiled = crossover_rows(timings)
                limit = NO_AMX if tiled == probes[-1] else tiled
        _limits[key] = limit
        log.info("%s panels multiply up to %s rows here (torch's GEMM on row-major weights from %d); unpacked "
                 "tiles through torch's GEMM above", dtype, "any number of" if limit == NO_AMX else limit, gemm)
    return _limits[key]


def gemm_crossover(ops: ModuleType, dtype: torch.dtype) -> int:
    """Rows up to which the panel kernel measured faster here than torch's GEMM on row-major weights (at most
    ``PANEL_MAX_ROWS``): whether weights are worth holding in panels at all (``panels_pay``)."""
    key = f"measured_{dtype}"
    if key not in _limits:
        timings = retime_out_of_order(measure_crossover(ops, dtype),
                                      lambda probes: measure_crossover(ops, dtype, probes))
        _limits[key] = crossover_rows(timings)
    return _limits[key]


# The row counts probed for the crossover, at most PANEL_MAX_ROWS. On a 2-core AVX2 EPYC (Zen 3, MKL) the
# fp32 panels won up to 256 rows; on a 2-core AVX-512/AMX Xeon (session 25) MKL's fp32 GEMM won from 32 rows,
# by 1.7x at 256-384 (a 384-token prefill 592 -> 370 ms): so the limit is measured where it runs.
CROSSOVER_PROBES = (8, 16, 32, 64, 128, PANEL_MAX_ROWS)
# The row counts probed for where the panels lose to the tiles unpacked from them (``_panel_max_rows``).
TILED_PROBES = (128, 256, 512)


def measure_crossover(ops: ModuleType, dtype: torch.dtype,
                      probes: tuple[int, ...] = CROSSOVER_PROBES) -> dict[int, tuple[float, float]]:
    """Per probed row count, the best of a few timings of (the panel kernel, torch's GEMM) on one weight."""
    return start_races.race(dtype, probes, pack_panels, lambda x, p: ops.dense_matmul_panel(x, p, NO_AMX, False))


def measure_tiled(ops: ModuleType, dtype: torch.dtype, probes: tuple[int, ...] = TILED_PROBES,
                  ) -> dict[int, tuple[float, float]]:
    """Per probed row count, the best of a few timings of (the panel kernel, ``tiled_matmul`` on the same panels:
    what multiplies the rows above the panels' limit)."""
    n = PROBE_SHAPE[0]
    # three timings a side, not five: its probes are the largest (every start-up of a node pays for them) and a
    # probe out of order is timed again (retime_out_of_order)
    return start_races.race(dtype, probes, pack_panels, lambda x, p: ops.dense_matmul_panel(x, p, NO_AMX, False),
                 (pack_panels, lambda x, p: tiled_matmul(p, x, n, bucketed=False)), timings=3)


def tiled_matmul(panels: torch.Tensor, x: torch.Tensor, out_features: int, bucketed: bool) -> torch.Tensor:
    """``x`` times the weight in ``panels``, cache-sized tiles of them unpacked to row-major for torch's GEMM, in
    the panels' dtype (``bucketed``: the rows padded to their bucket first, common/model/row_buckets.py)."""
    m, k = x.shape
    rows = bucket_rows(m) if bucketed else m
    xs = x.to(panels.dtype)
    if rows != m:
        xs = torch.cat([xs, xs.new_zeros(rows - m, k)])
    step = max(1, TILE_ELEMENTS // (k * PANEL_ROWS))  # panels per tile
    out = torch.empty(rows, out_features, dtype=xs.dtype)
    for p0 in range(0, panels.shape[0], step):
        p1 = min(panels.shape[0], p0 + step)
        torch.mm(xs, unpack_panels(panels, p0, p1).T, out=out[:, p0 * PANEL_ROWS : p1 * PANEL_ROWS])
    return out[:m] if rows != m else out


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> bf16 ``[N/16, K/2, 16, 2]`` or fp32 ``[N/16, K, 16]`` (``dense_matmul_panel``'s layout)."""
    n, k = weight.shape
    if weight.dtype == torch.bfloat16:
        return weight.reshape(n // PANEL_ROWS, PANEL_ROWS, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return weight.reshape(n // PANEL_ROWS, PANEL_ROWS, k).permute(0, 2, 1).contiguous()


def unpack_panels(panels: torch.Tensor, p0: int = 0, p1: int | None = None) -> torch.Tensor:
    """Panels ``p0 .. p1`` back to row-major ``[(p1 - p0) * 16, K]``."""
    part = panels[p0:p1]
    if part.dim() == 4:
        return part.permute(0, 2, 1, 3).reshape(part.shape[0] * PANEL_ROWS, part.shape[1] * 2)
    return part.permute(0, 2, 1).reshape(part.shape[0] * PANEL_ROWS, part.shape[1])


class PanelMethod(LinearMethod):
    """Float weights held in 16-row panels (``dense_matmul_panel``): one contiguous stream per panel at decode
    sizes, ``vdpbf16ps`` where the CPU has AVX512-BF16, AMX tiles from ``AMX_MIN_ROWS`` rows at every size
    where it grants them. Otherwise, above the measured crossover (prefill) cache-sized tiles are unpacked
    to row-major and multiplied by torch's GEMM. The layer holds only the panels (buffer ``panels``);
    ``float_out`` layers return the fp32 sums."""

    name = "panels"

    def __init__(self, ops: ModuleType, bucketed: bool) -> None:
        self._ops = ops
        self.bucketed = bucketed  # tiles see bucketed row counts (common/model/row_buckets.py)
        self._max_rows = 0  # set by refresh, once the panels' dtype is known (measured for it alone)
        self._amx_rows = _amx_min_rows(ops)
        # bf16 in AMX tiles: from this many rows, oneDNN's GEMM on a prepacked copy (onednn_bf16_rows)
        self._onednn_rows = NO_AMX
        self._onednn: torch.Tensor | None = None

    @staticmethod
    def fits(layer: Linear) -> bool:
        w = layer.weight
        return (w.dtype in _FLOATS and w.device.type == "cpu" and layer.out_features % PANEL_ROWS == 0
                and layer.in_features % 2 == 0)

    _panels: torch.Tensor  # the layer's buffer, held here too: a decode step makes ~120 calls

    def process_weights_after_loading(self, layer: Linear, packed: QuantizedWeight | None) -> None:
        weight = layer.weight.detach()
        panels = pack_panels(weight)
        if weight.dtype == torch.bfloat16 and weight.numel() and not layer.float_out:
            self._onednn_rows = onednn_bf16_rows(self._ops)
            if self._onednn_rows < NO_AMX:
                # A second copy of the weight for prefill-sized calls, in oneDNN's layout (a buffer, so the layer's
                # weight_bytes counts it); decode rows and the one-call step stream the panels.
                layer.register_buffer("onednn_weight", onednn_pack(weight), persistent=False)
        layer.drop_weight()
        layer.register_buffer("panels", panels, persistent=False)
        self.refresh(layer)

    def refresh(self, layer: Linear) -> None:
        self._panels = layer.get_buffer("panels")
        self._max_rows = _panel_max_rows(self._ops, self._panels.dtype)
        self._onednn = layer._buffers.get("onednn_weight")

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        panels = self._panels
        blocked = self._onednn
        if blocked is not None and x.shape[0] >= self._onednn_rows and x.dtype == torch.bfloat16:
            xc = x if x.is_contiguous() else x.contiguous()
            if not self.bucketed:
                return onednn_linear(xc, blocked, layer.bias)

            def gemm(rows: torch.Tensor, packed: torch.Tensor = blocked) -> torch.Tensor:
                return onednn_linear(rows, packed, layer.bias)

            return on_bucketed_rows(gemm, xc)  # oneDNN builds kernels per row count (common/model/row_buckets.py)
        if x.dtype in _FLOATS and x.shape[0] <= self._max_rows:
            y = self._ops.dense_matmul_panel(x if x.is_contiguous() else x.contiguous(), panels, self._amx_rows,
                                             layer.float_out)
        else:
            y = self._tiled(layer, panels, x)
        return y if layer.bias is None else y + layer.bias

    def warm_buckets(self, layer: Linear, max_rows: int) -> int:
        """Run oneDNN's GEMM once at every row bucket from its first row count up to ``max_rows`` (zero rows), so
        that it builds its kernels for them now and not in a served step (+15-20 ms a first step at a new bucket,
        session 33); the number of calls."""
        if self._onednn is None or not self.bucketed:
            return 0
        buckets = bucket_values(self._onednn_rows, max_rows)
        for m in buckets:
            self.apply(layer, torch.zeros(m, layer.in_features, dtype=torch.bfloat16))
        return len(buckets)

    def _tiled(self, layer: Linear, panels: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        out = tiled_matmul(panels, x, layer.out_features, self.bucketed)
        return out.to(torch.float32 if layer.float_out else x.dtype)

    def step_weights(self, layer: Linear, dtype: torch.dtype) -> StepWeights | None:
        panels = self._panels
        if panels.dtype != dtype:
            return None
        empty = torch.empty(0)
        return StepWeights((panels, empty, empty), 16 if dtype == torch.bfloat16 else 32, layer.in_features,
                           self._max_rows, self._amx_rows)

    def rows(self, layer: Linear, ids: torch.Tensor) -> torch.Tensor | None:
        rows = self._panels[ids // PANEL_ROWS, :, ids % PANEL_ROWS]  # [n, K/2, 2] or [n, K]
        return rows.reshape(ids.shape[0], layer.in_features)

    def describe(self) -> str:
        onednn = f", oneDNN from {self._onednn_rows} rows" if self._onednn is not None else ""
        return f"panels of {PANEL_ROWS} rows{onednn}"


def warm_onednn_buckets(model: nn.Module, max_rows: int) -> int:
    """``PanelMethod.warm_buckets`` for one layer of each weight shape in ``model`` (layers of one shape share
    oneDNN's kernels); the number of GEMM calls it took."""
    seen: set[tuple[int, int, bool]] = set()
    calls = 0
    for layer in model.modules():
        if isinstance(layer, Linear) and isinstance(layer.method, PanelMethod):
            key = (layer.in_features, layer.out_features, layer.bias is not None)
            if key not in seen:
                warmed = layer.method.warm_buckets(layer, max_rows)
                if warmed:
                    seen.add(key)
                    calls += warmed
    return calls


def panel_mode(dtype: torch.dtype) -> bool:
    """``TANDEM_CPU_PANELS=auto|on|off``: ``dtype`` weights in 16-row panels where they fit; auto: where they
    pay (``panels_pay``), on: always."""
    mode = str(kernel_setting("cpu_panels"))
    if mode == "off":
        return False
    ops = gemv_kernels()
    return mode == "on" or ops is None or panels_pay(ops, dtype)


# Panels hold the only copy of a weight, so above their crossover every call unpacks tiles for torch's GEMM.
# Where the panel kernel stops winning below this many rows, row-major weights serve better: on the AVX-512/AMX
# Xeon (fp32, crossover 16 rows) a batch of 48 decoded 1.33x faster and a 384-token prompt prefilled 1.6x
# faster with row-major weights (``GemvMethod``), batch 1 ~20% slower (session 25) until the one-call decode step took
# row-major fp32 weights too (session 26: batch 1 18-20 ms, faster than panels' 25).
PANEL_MIN_CROSSOVER = 64


def panels_pay(ops: ModuleType, dtype: torch.dtype) -> bool:
    """Whether ``dtype`` weights are worth holding in panels here: the panel kernel beats torch's GEMM on
    row-major weights up to at least ``PANEL_MIN_CROSSOVER`` rows (bf16 with AMX always)."""
    if dtype == torch.bfloat16 and _amx_min_rows(ops) < NO_AMX:
        return True
    return gemm_crossover(ops, dtype) >= PANEL_MIN_CROSSOVER


def wanted(device: torch.device) -> bool:
    """Whether the loader should use the GEMV layers on ``device`` (``TANDEM_CPU_GEMV``)."""
    mode = gemv_mode()
    if mode == "off" or device.type != "cpu":
        return False
    if gemv_kernels() is None:
        if mode == "on":
            raise RuntimeError("TANDEM_CPU_GEMV=on but the CPU kernels could not be built (see the log)")
        return False
    return True

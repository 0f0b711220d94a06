"""Packed linear methods on CPU.

``PackedCPUMethod`` (``tandem_cpu``) runs Tandem's kernels (``cpu_quant.cpp``; A8: ``cpu_quant_a8.cpp``): up to
``GEMV_MAX_ROWS`` activation rows (decode) stream the packed weight once and multiply in registers; larger
batches (prefill, big decode batches) dequantize a slice of rows at a time into a cache-sized tile in the
activation dtype and hand it to torch's GEMM, so they run near GEMM speed while DRAM serves packed bytes.

``A8Method`` (``tandem_a8``, the CPU default) run on int8 activations: each row of x
is rounded to int8 in blocks of 32 (one fp32 scale each, as llama.cpp's Q8 activations) and the packed
weights meet it in integer dot products. Matrices whose rows are a multiple of 16 are held in 16-row panels
(``common/quant/panels.py``) and one kernel serves every batch size (AVX512-VNNI ``vpdpbusd`` where the CPU
has it, ``cpu_quant_panel.cpp``); other shapes keep the row-major GEMV (``cpu_quant_a8.cpp``) up to
``GEMV_MAX_ROWS`` rows and the float path above. The activations' rounding costs a small relative error per
product (docs/quantization.md has the measured error and the perplexity).

``TorchInt4Method`` / ``TorchInt8Method`` wrap PyTorch's own weight-only ops
(``aten._weight_int4pack_mm_for_cpu``, ``aten._weight_int8pack_mm``): well kept, and fast with bf16
activations on AVX-512, but they run a scalar loop for fp32 activations (docs/quantization.md has the
figures), which is why they are not the default.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from common.kernels.cpu import NO_AMX, amx_enabled, quant_kernels
from common.kernels.isa import cpu_flags
from common.model.linear import StepWeights
from common.quant.formats import Int4Weight, Int8Weight, QuantizedWeight
from common.quant.linear import PackedMethod
from common.quant.panels import (
    PANEL_ROWS,
    pack_int4_panels,
    pack_int8_panels,
    panels_fit,
    unpack_int8_panels,
)

if TYPE_CHECKING:
    from common.model.linear import Linear

GEMV_MAX_ROWS = 8  # above this, dequantize-and-GEMM wins (measured on AVX2 and AVX-512)
PANEL_MAX_ROWS_NO_VNNI = 64  # panels without VNNI beat dequantize-and-GEMM up to here (AVX2 build)
AMX_QUANT_MIN_ROWS = 16  # from here (bf16 activations, AMX granted) dequantized chunks through AMX tiles win
TILE_ELEMENTS = 1 << 19  # weights per dequantized tile: 2 MiB of fp32, stays in L2+L3


NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def bf16_gemm_native() -> bool:
    """Whether this CPU multiplies bf16 natively. Without it oneDNN's bf16 GEMMs ran far below fp32's rate at
    prefill shapes (2-core AVX2 EPYC, session 16; the figures: docs/cpu-kernels.md), so the dequantized tiles
    are multiplied in fp32 there, and only the result is rounded to bf16."""
    return bool(cpu_flags() & NATIVE_BF16_FLAGS)


def _tiled_gemm(x: torch.Tensor, rows: int, dequantize: Callable[[int, int, torch.dtype], torch.Tensor]
                ) -> torch.Tensor:
    # x: [M, K]; dequantize(row0, row1, dtype) -> [row1 - row0, K] in x's dtype (fp32, or bf16 where native)
    k = x.shape[1]
    step = max(1, TILE_ELEMENTS // k)
    if x.dtype is not torch.float32 and not (x.dtype is torch.bfloat16 and bf16_gemm_native()):
        x = x.float()
    out = torch.empty(x.shape[0], rows, dtype=x.dtype)
    for row0 in range(0, rows, step):
        row1 = min(rows, row0 + step)
        torch.mm(x, dequantize(row0, row1, x.dtype).T, out=out[:, row0:row1])
    return out


class PackedCPUMethod(PackedMethod):
    """Tandem's kernels (``tandem_cpu``): GEMV up to ``GEMV_MAX_ROWS`` rows, dequantize-and-GEMM above.

    A decode step calls a hundred of these, so the hot path reads its kernel arguments from one plain
    tuple (``_args``, rebuilt by ``refresh`` whenever the buffers are moved or replaced) rather than through
    ``nn.Module`` buffer lookups.
    """

    name = "tandem_cpu"
    int8_activations = False  # the GEMV rounds x to int8 blocks (``tandem_a8``)
    _names: tuple[str, ...]
    _args: tuple[torch.Tensor, ...] = ()

    def pack(self, layer: Linear, weight: QuantizedWeight) -> None:
        assert isinstance(weight, Int4Weight | Int8Weight)
        ops = quant_kernels()
        int4 = isinstance(weight, Int4Weight)
        if self.int8_activations:
            self._gemv = ops.int4_matmul_a8 if int4 else ops.int8_matmul_a8
        else:
            self._gemv = ops.int4_matmul if int4 else ops.int8_matmul
        self._dequant = ops.int4_dequantize if int4 else ops.int8_dequantize
        self._names = ("q", "scales", "zeros") if int4 else ("q", "scales")
        for name in self._names:
            layer.register_buffer(name, getattr(weight, name).contiguous(), persistent=False)

    def refresh(self, layer: Linear) -> None:
        self._args = tuple(layer.get_buffer(name) for name in self._names)

    def matmul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > GEMV_MAX_ROWS:
            return _tiled_gemm(x.contiguous(), layer.out_features, self._dequantize).to(x.dtype)
        if x.dtype is torch.float16:  # the kernels read fp32 or bf16 as they are; fp16 is widened
            return self._gemv(x.float().contiguous(), *self._args, self._group_size).half()
        return self._gemv(x if x.is_contiguous() else x.contiguous(), *self._args, self._group_size)

    def _dequantize(self, row0: int, row1: int, dtype: torch.dtype) -> torch.Tensor:
        return self._dequant(*self._args, self._group_size, row0, row1, dtype)


class A8Method(PackedCPUMethod):
    """``tandem_a8``: int8-rounded activations, and where the shape allows (out_features a multiple of 16)
    weights in 16-row panels (``common/quant/panels.py``), so every batch size runs the panel kernels'
    integer dot products (AVX512-VNNI ``vpdpbusd`` where the CPU has it). Without VNNI, batches above
    ``PANEL_MAX_ROWS_NO_VNNI`` rows dequantize and GEMM instead (measured on the AVX2 build: ``vpmaddubsw``
    loses to a float GEMM at prefill sizes). Other shapes keep the row-major GEMV (up to ``GEMV_MAX_ROWS``)."""

    name = "tandem_a8"
    int8_activations = True
    panels = False
    panel_rows = 0  # rows up to which the panel loop runs (beyond: dequantize and GEMM)
    amx_rows = NO_AMX  # rows from which bf16 activations run AMX tiles

    def pack(self, layer: Linear, weight: QuantizedWeight) -> None:
        assert isinstance(weight, Int4Weight | Int8Weight)
        n, k = weight.shape
        self.panels = panels_fit(n, k)
        if not self.panels:
            super().pack(layer, weight)
            return
        int4 = isinstance(weight, Int4Weight)
        weight = (Int4Weight(*pack_int4_panels(weight), weight.group_size) if isinstance(weight, Int4Weight)
                  else Int8Weight(*pack_int8_panels(weight), weight.group_size))  # the buffers held
        super().pack(layer, weight)
        ops = quant_kernels()
        self._panel = ops.int4_matmul_panel if int4 else ops.int8_matmul_panel
        self._dequant_panel = ops.int4_dequantize_panel if int4 else ops.int8_dequantize_panel
        self.panel_rows = 1 << 62 if ops.int8_panel_path() == "vnni" else PANEL_MAX_ROWS_NO_VNNI
        amx = amx_enabled(ops) and k % 32 == 0
        self._amx = (ops.int4_matmul_panel_amx if int4 else ops.int8_matmul_panel_amx) if amx else None
        self.amx_rows = AMX_QUANT_MIN_ROWS if amx else NO_AMX

    def matmul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if not self.panels:
            return super().matmul(layer, x)
        if x.shape[0] >= self.amx_rows and x.dtype is torch.bfloat16 and self._amx is not None:
            return self._amx(x if x.is_contiguous() else x.contiguous(), *self._args, self._group_size)
        if x.shape[0] > self.panel_rows:
            return _tiled_gemm(x.contiguous(), layer.out_features, self._dequantize).to(x.dtype)
        if x.dtype is torch.float16:
            return self._panel(x.float().contiguous(), *self._args, self._group_size).half()
        return self._panel(x if x.is_contiguous() else x.contiguous(), *self._args, self._group_size)

    def _dequantize(self, row0: int, row1: int, dtype: torch.dtype) -> torch.Tensor:
        if not self.panels:
            return super()._dequantize(row0, row1, dtype)
        return self._dequant_panel(*self._args, self._group_size, row0, row1, dtype)

    def step_weights(self, layer: Linear, dtype: torch.dtype) -> StepWeights | None:
        if not self.panels:
            return None
        empty = torch.empty(0)
        # from its AMX threshold on (bf16), AMX tiles at every row count: the step's own loop
        max_rows = 1 << 62 if dtype == torch.bfloat16 and self._amx is not None else self.panel_rows
        if self.format == "int4":
            q, scales, zeros = self._args
            return StepWeights((q, scales, zeros), 4, self._group_size, max_rows, self.amx_rows)
        q, scales = self._args
        return StepWeights((q, scales, empty), 8, self._group_size, max_rows, self.amx_rows)

    def int8_q(self, layer: Linear) -> torch.Tensor | None:
        return unpack_int8_panels(layer.get_buffer("q")) if self.panels else layer.get_buffer("q")

    def rows(self, layer: Linear, ids: torch.Tensor) -> torch.Tensor | None:
        if self.format != "int8" or not self.panels:
            return super().rows(layer, ids)
        q, scales = self._args
        rows = unpack_int8_panels(q, ids).float()
        if scales.dim() == 1:
            return rows * scales[ids, None]
        s = scales[ids // PANEL_ROWS, :, ids % PANEL_ROWS]  # [n, K/G]
        return (rows.view(ids.shape[0], s.shape[1], -1) * s[..., None]).view(ids.shape[0], -1)


class TorchInt4Method(PackedMethod):
    """PyTorch's int4 weight-only op: its packed layout, and its zero convention ``(q - 8) * s + z'``."""

    name = "torch"

    def __init__(self, dtype: torch.dtype) -> None:
        self._dtype = dtype  # the activations' (its scales and zeros are held in it)

    def pack(self, layer: Linear, weight: QuantizedWeight) -> None:
        assert isinstance(weight, Int4Weight)
        codes = weight.unpack().to(torch.int32)
        layer.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1),
                              persistent=False)
        scales = weight.scales.float()
        # ours: s * q + z; torch's: (q - 8) * s + z' -> z' = z + 8 s. [K / group, N, 2] in the activation dtype.
        zeros = weight.zeros.float() + 8 * scales
        layer.register_buffer("scales_and_zeros",
                              torch.stack([scales.T, zeros.T], dim=-1).to(self._dtype).contiguous(), persistent=False)

    def matmul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        sz = layer.get_buffer("scales_and_zeros")
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(sz.dtype).contiguous(), layer.get_buffer("packed"),
                                                       self._group_size, sz)
        return y.to(x.dtype)


class TorchInt8Method(PackedMethod):
    """PyTorch's int8 weight-only op (one scale per output channel only)."""

    name = "torch"

    def __init__(self, dtype: torch.dtype) -> None:
        self._dtype = dtype

    def pack(self, layer: Linear, weight: QuantizedWeight) -> None:
        assert isinstance(weight, Int8Weight)
        if weight.group_size != weight.shape[1]:
            raise ValueError("torch's int8 weight-only op takes one scale per output channel, not groups")
        layer.register_buffer("q", weight.q.contiguous(), persistent=False)
        layer.register_buffer("scales", weight.scales.view(-1).to(self._dtype), persistent=False)

    def matmul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        scales = layer.get_buffer("scales")
        return torch._weight_int8pack_mm(x.to(scales.dtype).contiguous(), layer.get_buffer("q"), scales).to(x.dtype)

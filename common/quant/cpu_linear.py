"""Quantized linear layers on CPU.

``Int4LinearCPU`` / ``Int8LinearCPU`` run Tandem's kernels (``cpu_quant.cpp``; A8: ``cpu_quant_a8.cpp``): up to
``GEMV_MAX_ROWS`` activation rows (decode) stream the packed weight once and multiply in registers; larger
batches (prefill, big decode batches) dequantize a slice of rows at a time into a cache-sized tile in the
activation dtype and hand it to torch's GEMM, so they run near GEMM speed while DRAM serves packed bytes.

``Int4LinearA8`` / ``Int8LinearA8`` (``tandem_a8``, the CPU default) run on int8 activations: each row of x
is rounded to int8 in blocks of 32 (one fp32 scale each, as llama.cpp's Q8 activations) and the packed
weights meet it in integer dot products. Matrices whose rows are a multiple of 16 are held in 16-row panels
(``common/quant/panels.py``) and one kernel serves every batch size (AVX512-VNNI ``vpdpbusd`` where the CPU
has it, ``cpu_quant_panel.cpp``); other shapes keep the row-major GEMV (``cpu_quant_a8.cpp``) up to
``GEMV_MAX_ROWS`` rows and the float path above. The activations' rounding costs about 0.5% relative error
per product (docs/quantization.md has the perplexity).

``Int4LinearTorch`` / ``Int8LinearTorch`` wrap PyTorch's own weight-only ops
(``aten._weight_int4pack_mm_for_cpu``, ``aten._weight_int8pack_mm``): well kept, and fast with bf16
activations on AVX-512, but they run a scalar loop for fp32 activations (docs/quantization.md has the
figures), which is why they are not the default.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from common.quant.cpu_kernels import NO_AMX, amx_enabled, cpu_flags, quant_kernels
from common.quant.formats import Int4Weight, Int8Weight
from common.quant.linear import QuantizedLinear
from common.quant.panels import (
    PANEL_ROWS,
    pack_int4_panels,
    pack_int8_panels,
    panels_fit,
    unpack_int8_panels,
)

GEMV_MAX_ROWS = 8  # above this, dequantize-and-GEMM wins (measured on AVX2 and AVX-512)
PANEL_MAX_ROWS_NO_VNNI = 64  # panels without VNNI beat dequantize-and-GEMM up to here (AVX2 build)
AMX_QUANT_MIN_ROWS = 16  # from here (bf16 activations, AMX granted) dequantized chunks through AMX tiles win
TILE_ELEMENTS = 1 << 19  # weights per dequantized tile: 2 MiB of fp32, stays in L2+L3


NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def bf16_gemm_native() -> bool:
    """Whether this CPU multiplies bf16 natively. Without it oneDNN's bf16 GEMMs ran at a fifth of fp32's rate
    (2-core AVX2 EPYC, session 16: 16-20 against 77-88 GFLOP/s at prefill shapes), so the dequantized tiles
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


class _PackedCPU(QuantizedLinear):
    """Tandem's kernels: GEMV up to ``GEMV_MAX_ROWS`` rows, dequantize-and-GEMM above.

    A decode step calls a hundred of these, so the hot path reads its kernel arguments from one plain
    tuple (``_args``, rebuilt whenever the buffers are moved or replaced) rather than through
    ``nn.Module.__getattr__`` buffer lookups.
    """

    kernel_name = "tandem_cpu"
    int8_activations = False  # the GEMV rounds x to int8 blocks (the ``tandem_a8`` layers)
    _buffer_names: tuple[str, ...]

    def __init__(self, weight: Int4Weight | Int8Weight, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        ops = quant_kernels()
        int4 = isinstance(weight, Int4Weight)
        if self.int8_activations:
            self._gemv = ops.int4_matmul_a8 if int4 else ops.int8_matmul_a8
        else:
            self._gemv = ops.int4_matmul if int4 else ops.int8_matmul
        self._dequant = ops.int4_dequantize if int4 else ops.int8_dequantize
        self._buffer_names = ("q", "scales", "zeros") if int4 else ("q", "scales")
        for name in self._buffer_names:
            self.register_buffer(name, getattr(weight, name).contiguous(), persistent=False)
        self._args = self._pack_args()

    def _pack_args(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.get_buffer(name) for name in self._buffer_names)

    def _apply(self, fn: Callable[..., torch.Tensor], recurse: bool = True) -> _PackedCPU:  # type: ignore[override]
        super()._apply(fn, recurse)
        self._args = self._pack_args()
        return self

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > GEMV_MAX_ROWS:
            return _tiled_gemm(x.contiguous(), self.out_features, self._dequantize).to(x.dtype)
        if x.dtype is torch.float16:  # the kernels read fp32 or bf16 as they are; fp16 is widened
            return self._gemv(x.float().contiguous(), *self._args, self.group_size).half()
        return self._gemv(x if x.is_contiguous() else x.contiguous(), *self._args, self.group_size)

    def _dequantize(self, row0: int, row1: int, dtype: torch.dtype) -> torch.Tensor:
        return self._dequant(*self._args, self.group_size, row0, row1, dtype)


class Int4LinearCPU(_PackedCPU):
    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)


class Int8LinearCPU(_PackedCPU):
    q: torch.Tensor
    scales: torch.Tensor

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)


class _Panels:
    """``tandem_a8``'s layers: int8-rounded activations, and where the shape allows (out_features a multiple
    of 16) weights in 16-row panels (``common/quant/panels.py``), so every batch size runs the panel kernels'
    integer dot products (AVX512-VNNI ``vpdpbusd`` where the CPU has it). Without VNNI, batches above
    ``PANEL_MAX_ROWS_NO_VNNI`` rows dequantize and GEMM instead (measured on the AVX2 build: ``vpmaddubsw``
    loses to a float GEMM at prefill sizes). Other shapes keep the row-major GEMV (up to ``GEMV_MAX_ROWS``)."""

    kernel_name = "tandem_a8"
    int8_activations = True
    panels: bool
    out_features: int
    in_features: int
    group_size: int
    _args: tuple[torch.Tensor, ...]

    def __init__(self, weight: Int4Weight | Int8Weight, bias: torch.Tensor | None) -> None:
        n, k = weight.shape
        self.panels = panels_fit(n, k)
        if self.panels:
            weight = (Int4Weight(*pack_int4_panels(weight), weight.group_size) if isinstance(weight, Int4Weight)
                      else Int8Weight(*pack_int8_panels(weight), weight.group_size))  # the buffers held
        super().__init__(weight, bias)  # type: ignore[call-arg]
        if self.panels:
            self.out_features, self.in_features = n, k
            ops = quant_kernels()
            int4 = isinstance(weight, Int4Weight)
            self._panel = ops.int4_matmul_panel if int4 else ops.int8_matmul_panel
            self._dequant_panel = ops.int4_dequantize_panel if int4 else ops.int8_dequantize_panel
            self._panel_rows = 1 << 62 if ops.int8_panel_path() == "vnni" else PANEL_MAX_ROWS_NO_VNNI
            amx = amx_enabled(ops) and k % 32 == 0
            self._amx = (ops.int4_matmul_panel_amx if int4 else ops.int8_matmul_panel_amx) if amx else None
            self._amx_rows = AMX_QUANT_MIN_ROWS if amx else NO_AMX

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if not self.panels:
            return super().matmul(x)  # type: ignore[misc]
        if x.shape[0] >= self._amx_rows and x.dtype is torch.bfloat16 and self._amx is not None:
            return self._amx(x if x.is_contiguous() else x.contiguous(), *self._args, self.group_size)
        if x.shape[0] > self._panel_rows:
            return _tiled_gemm(x.contiguous(), self.out_features, self._dequantize).to(x.dtype)
        if x.dtype is torch.float16:
            return self._panel(x.float().contiguous(), *self._args, self.group_size).half()
        return self._panel(x if x.is_contiguous() else x.contiguous(), *self._args, self.group_size)

    def _dequantize(self, row0: int, row1: int, dtype: torch.dtype) -> torch.Tensor:
        if not self.panels:
            return super()._dequantize(row0, row1, dtype)  # type: ignore[misc]
        return self._dequant_panel(*self._args, self.group_size, row0, row1, dtype)


class Int4LinearA8(_Panels, Int4LinearCPU):
    pass


class Int8LinearA8(_Panels, Int8LinearCPU):
    def _int8_q(self) -> torch.Tensor:
        return unpack_int8_panels(self.q) if self.panels else self.q

    def int8_rows(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.panels:
            return super().int8_rows(ids)
        q, scales = self._args
        rows = unpack_int8_panels(q, ids).float()
        if scales.dim() == 1:
            return rows * scales[ids, None]
        s = scales[ids // PANEL_ROWS, :, ids % PANEL_ROWS]  # [n, K/G]
        return (rows.view(ids.shape[0], s.shape[1], -1) * s[..., None]).view(ids.shape[0], -1)


class Int4LinearTorch(QuantizedLinear):
    """PyTorch's int4 weight-only op: its packed layout, and its zero convention ``(q - 8) * s + z'``."""

    kernel_name = "torch"
    packed: torch.Tensor
    scales_and_zeros: torch.Tensor

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(weight, bias)
        codes = weight.unpack().to(torch.int32)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1),
                             persistent=False)
        scales = weight.scales.float()
        # ours: s * q + z; torch's: (q - 8) * s + z' -> z' = z + 8 s. [K / group, N, 2] in the activation dtype.
        zeros = weight.zeros.float() + 8 * scales
        self.register_buffer("scales_and_zeros", torch.stack([scales.T, zeros.T], dim=-1).to(dtype).contiguous(),
                             persistent=False)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        xs = x.to(self.scales_and_zeros.dtype).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xs, self.packed, self.group_size, self.scales_and_zeros)
        return y.to(x.dtype)


class Int8LinearTorch(QuantizedLinear):
    """PyTorch's int8 weight-only op (one scale per output channel only)."""

    kernel_name = "torch"
    q: torch.Tensor
    scales: torch.Tensor

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(weight, bias)
        if weight.group_size != weight.shape[1]:
            raise ValueError("torch's int8 weight-only op takes one scale per output channel, not groups")
        self.register_buffer("q", weight.q.contiguous(), persistent=False)
        self.register_buffer("scales", weight.scales.view(-1).to(dtype), persistent=False)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int8pack_mm(x.to(self.scales.dtype).contiguous(), self.q, self.scales)
        return y.to(x.dtype)

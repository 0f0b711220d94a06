"""W8A8 dynamic: int8 weights times int8 activations quantized per token on the fly, on CPU and CUDA.

``torch._int_mm`` is the integer GEMM (oneDNN with VNNI on CPU, cuBLAS on CUDA); one fp32 rescale by the
token's and the channel's scales follows. Several times the fp32/bf16 GEMM rate at large batches; the
activations are rounded, so it is an option (``--quantization w8a8``), not int8's default.
``formats.reference_w8a8_matmul`` is its math.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from common.quant.formats import Int8Weight, QuantizedWeight, quantize_rows_int8
from common.quant.linear import PackedMethod

if TYPE_CHECKING:
    from common.model.linear import Linear

CUDA_INT_MM_MIN_ROWS = 16


class W8A8Method(PackedMethod):
    """One scale per output channel (integer sums cannot take per-group scales)."""

    name = "int_mm"

    def pack(self, layer: Linear, weight: QuantizedWeight) -> None:
        assert isinstance(weight, Int8Weight)
        if weight.group_size != weight.shape[1]:
            raise ValueError("W8A8 takes one weight scale per output channel, not groups")
        layer.register_buffer("q_t", weight.q.T.contiguous(), persistent=False)  # [K, N]: _int_mm's b
        layer.register_buffer("scales", weight.scales.view(1, -1).float(), persistent=False)

    def int8_q(self, layer: Linear) -> torch.Tensor | None:
        return layer.get_buffer("q_t").T

    def matmul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_rows_int8(x)
        m = xq.shape[0]
        if xq.is_cuda and m <= CUDA_INT_MM_MIN_ROWS:  # cuBLAS int8 GEMM wants more than 16 rows
            xq = torch.nn.functional.pad(xq, (0, 0, 0, CUDA_INT_MM_MIN_ROWS + 1 - m))
        return (torch._int_mm(xq, layer.get_buffer("q_t"))[:m] * (xs * layer.get_buffer("scales"))).to(x.dtype)

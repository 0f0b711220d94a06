"""W8A8 dynamic: int8 weights times int8 activations quantized per token on the fly, on CPU and CUDA.

``torch._int_mm`` is the integer GEMM (oneDNN with VNNI on CPU, cuBLAS on CUDA); one fp32 rescale by the
token's and the channel's scales follows. Several times the fp32/bf16 GEMM rate at large batches; the
activations are rounded, so it is an option (``--quantization w8a8``), not int8's default.
``formats.reference_w8a8_matmul`` is its math.
"""

from __future__ import annotations

import torch

from common.quant.formats import Int8Weight, quantize_rows_int8
from common.quant.linear import QuantizedLinear

CUDA_INT_MM_MIN_ROWS = 16


class Int8LinearW8A8(QuantizedLinear):
    """One scale per output channel (integer sums cannot take per-group scales)."""

    kernel_name = "int_mm"
    q_t: torch.Tensor
    scales: torch.Tensor

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        if weight.group_size != weight.shape[1]:
            raise ValueError("W8A8 takes one weight scale per output channel, not groups")
        self.register_buffer("q_t", weight.q.T.contiguous(), persistent=False)  # [K, N]: _int_mm's b
        self.register_buffer("scales", weight.scales.view(1, -1).float(), persistent=False)

    def _int8_q(self) -> torch.Tensor:
        return self.q_t.T

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_rows_int8(x)
        m = xq.shape[0]
        if xq.is_cuda and m <= CUDA_INT_MM_MIN_ROWS:  # cuBLAS int8 GEMM wants more than 16 rows
            xq = torch.nn.functional.pad(xq, (0, 0, 0, CUDA_INT_MM_MIN_ROWS + 1 - m))
        return (torch._int_mm(xq, self.q_t)[:m] * (xs * self.scales)).to(x.dtype)

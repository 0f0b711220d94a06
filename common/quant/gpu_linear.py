"""Quantized linear layers on CUDA.

- ``TritonLinear``: int8 / int4 weight-only through ``triton_kernels.weight_only_matmul`` (Tandem's layouts
  as they are, GGUF blocks included).
- ``Int4LinearTinyGemm``: PyTorch's tinygemm int4 op (``aten._weight_int4pack_mm``, bf16, sm80+), with its
  own packing and zero convention ``(q - 8) * s + z'``.
- ``FP8LinearScaledMM``: e4m3 weights with per-channel scales; activations quantized per token on the fly;
  ``torch._scaled_mm`` with row-wise scales (Hopper / Ada). ``formats.reference_fp8_matmul`` is its math.

Imported only when a CUDA model is quantized; the ``gpu``-marked tests run them against the references.
"""

from __future__ import annotations

import torch

from common.quant.formats import FP8Weight, Int4Weight, Int8Weight, quantize_rows_fp8
from common.quant.linear import QuantizedLinear

TINYGEMM_INNER_K_TILES = 2  # K must be a multiple of 16 * inner_k_tiles: 32 divides every accepted layer


class TritonLinear(QuantizedLinear):
    kernel_name = "triton"
    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None

    def __init__(self, weight: Int8Weight | Int4Weight, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        self.register_buffer("q", weight.q.contiguous(), persistent=False)
        self.register_buffer("scales", weight.scales.contiguous(), persistent=False)
        zeros = weight.zeros.contiguous() if isinstance(weight, Int4Weight) else None
        self.register_buffer("zeros", zeros, persistent=False)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        from common.quant.triton_kernels import weight_only_matmul

        return weight_only_matmul(x, self.q, self.scales, self.zeros, self.group_size).to(x.dtype)


class Int4LinearTinyGemm(QuantizedLinear):
    kernel_name = "torch"
    packed: torch.Tensor
    scales_and_zeros: torch.Tensor

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        codes = weight.unpack().to(torch.int32)
        # tinygemm's input: uint8 [N, K/2], even k in the high nibble
        pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack(pairs, TINYGEMM_INNER_K_TILES),
                             persistent=False)
        scales = weight.scales.float()
        zeros = weight.zeros.float() + 8 * scales
        self.register_buffer("scales_and_zeros",
                             torch.stack([scales.T, zeros.T], dim=-1).to(torch.bfloat16).contiguous(), persistent=False)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm(x.to(torch.bfloat16).contiguous(), self.packed, self.group_size,
                                               self.scales_and_zeros)
        return y.to(x.dtype)


class FP8LinearScaledMM(QuantizedLinear):
    kernel_name = "scaled_mm"
    q: torch.Tensor
    scales: torch.Tensor

    def __init__(self, weight: FP8Weight, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        self.register_buffer("q", weight.q.contiguous(), persistent=False)  # [N, K]; .T is column-major
        self.register_buffer("scales", weight.scales.view(1, -1).float().contiguous(), persistent=False)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_rows_fp8(x)
        # row-wise scaling wants a bf16 output; [M, 1] x [1, N] scales
        y = torch._scaled_mm(xq, self.q.T, scale_a=xs, scale_b=self.scales, out_dtype=torch.bfloat16)
        return y.to(x.dtype)

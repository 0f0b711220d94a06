"""Packed linear methods on CUDA.

- ``TritonMethod``: int8 / int4 weight-only through ``triton_kernels.weight_only_matmul`` (Tandem's layouts
  as they are, GGUF blocks included).
- ``TinyGemmMethod``: PyTorch's tinygemm int4 op (``aten._weight_int4pack_mm``, bf16, sm80+), with its
  own packing and zero convention ``(q - 8) * s + z'``.
- ``ScaledMMMethod``: e4m3 weights with per-channel scales; activations quantized per token on the fly;
  ``torch._scaled_mm`` with row-wise scales (Hopper / Ada). ``formats.reference_fp8_matmul`` is its math.

Imported only when a CUDA model is quantized; the ``gpu``-marked tests run them against the references.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from common.quant.formats import FP8Weight, Int4Weight, Int8Weight, QuantizedWeight, quantize_rows_fp8
from common.quant.linear import PackedMethod

if TYPE_CHECKING:
    from common.model.linear import Linear

TINYGEMM_INNER_K_TILES = 2  # K must be a multiple of 16 * inner_k_tiles: 32 divides every accepted layer


class TritonMethod(PackedMethod):
    name = "triton"

    def pack(self, layer: Linear, weight: QuantizedWeight) -> None:
        assert isinstance(weight, Int8Weight | Int4Weight)
        layer.register_buffer("q", weight.q.contiguous(), persistent=False)
        layer.register_buffer("scales", weight.scales.contiguous(), persistent=False)
        if isinstance(weight, Int4Weight):
            layer.register_buffer("zeros", weight.zeros.contiguous(), persistent=False)

    def matmul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        from common.kernels.triton.quant import weight_only_matmul

        zeros = layer.get_buffer("zeros") if self.format == "int4" else None
        return weight_only_matmul(x, layer.get_buffer("q"), layer.get_buffer("scales"), zeros,
                                  self._group_size).to(x.dtype)


class TinyGemmMethod(PackedMethod):
    name = "torch"

    def pack(self, layer: Linear, weight: QuantizedWeight) -> None:
        assert isinstance(weight, Int4Weight)
        codes = weight.unpack().to(torch.int32)
        # tinygemm's input: uint8 [N, K/2], even k in the high nibble
        pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
        layer.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack(pairs, TINYGEMM_INNER_K_TILES),
                              persistent=False)
        scales = weight.scales.float()
        zeros = weight.zeros.float() + 8 * scales
        layer.register_buffer("scales_and_zeros",
                              torch.stack([scales.T, zeros.T], dim=-1).to(torch.bfloat16).contiguous(),
                              persistent=False)

    def matmul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm(x.to(torch.bfloat16).contiguous(), layer.get_buffer("packed"),
                                               self._group_size, layer.get_buffer("scales_and_zeros"))
        return y.to(x.dtype)


class ScaledMMMethod(PackedMethod):
    name = "scaled_mm"

    def pack(self, layer: Linear, weight: QuantizedWeight) -> None:
        assert isinstance(weight, FP8Weight)
        layer.register_buffer("q", weight.q.contiguous(), persistent=False)  # [N, K]; .T is column-major
        layer.register_buffer("scales", weight.scales.view(1, -1).float().contiguous(), persistent=False)

    def matmul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_rows_fp8(x)
        # row-wise scaling wants a bf16 output; [M, 1] x [1, N] scales
        y = torch._scaled_mm(xq, layer.get_buffer("q").T, scale_a=xs, scale_b=layer.get_buffer("scales"),
                             out_dtype=torch.bfloat16)
        return y.to(x.dtype)

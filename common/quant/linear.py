"""The base of the packed linear methods, and ``ReferenceMethod``: any packed format on any device.

A packed method takes the layer's ``QuantizedWeight`` (``common/quant/formats.py``) at processing time,
keeps its tensors as the layer's (non-persistent) buffers in the layout its kernel wants, so
``model.buffers()`` counts the real weight bytes and ``model.to(device)`` moves them, and drops the float
weight. ``ReferenceMethod`` multiplies through the dequantized weight: correct everywhere, the oracle of the
tests, and the fallback where no kernel exists.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING

import torch
from torch import nn

from common.model.linear import LinearMethod
from common.quant.formats import FP8Weight, Int4Weight, Int8Weight, QuantizedWeight

if TYPE_CHECKING:
    from common.model.linear import Linear


def weight_format(weight: QuantizedWeight) -> str:
    if isinstance(weight, Int4Weight):
        return "int4"
    return "int8" if isinstance(weight, Int8Weight) else "fp8"


class PackedMethod(LinearMethod):
    """Shapes, format and group of the packed weight; the bias added after the kernel's matmul."""

    _group_size: int

    def process_weights_after_loading(self, layer: Linear, packed: QuantizedWeight | None) -> None:
        if packed is None:
            raise ValueError(f"the {self.name} linear method needs a packed weight")
        if tuple(packed.shape) != (layer.out_features, layer.in_features):
            raise ValueError(f"packed weight {tuple(packed.shape)} for a {layer.out_features} x "
                             f"{layer.in_features} layer")
        self.format = weight_format(packed)
        self._group_size = getattr(packed, "group_size", layer.in_features)
        layer.drop_weight()
        self.pack(layer, packed)
        self.refresh(layer)

    @abstractmethod
    def pack(self, layer: Linear, weight: QuantizedWeight) -> None:
        """Register the kernel's buffers on ``layer`` from ``weight`` (on the layer's device)."""

    @abstractmethod
    def matmul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x: [M, in_features] -> [M, out_features], both in x's dtype, no bias."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(layer, x)
        return y if layer.bias is None else y + layer.bias

    def rows(self, layer: Linear, ids: torch.Tensor) -> torch.Tensor | None:
        """Dequantized fp32 rows of an int8 weight (the values GGUF's Q8_0 rows hold)."""
        if self.format != "int8":
            return None
        q = self.int8_q(layer)
        if q is None:
            return None
        scales = layer.get_buffer("scales").float().reshape(layer.out_features, -1)
        n = ids.shape[0]
        rows = q[ids].float().view(n, scales.shape[1], -1) * scales[ids].unsqueeze(-1)
        return rows.view(n, layer.in_features)

    def int8_q(self, layer: Linear) -> torch.Tensor | None:
        """An int8 weight's codes, row-major ``[N, K]`` (None: not held that way)."""
        return layer.get_buffer("q")

    @property
    def group_size(self) -> int | None:
        return self._group_size

    def describe(self) -> str:
        return f"{self.format} (group {self._group_size}), {self.name}"


class ReferenceMethod(PackedMethod):
    """Any format, any device: dequantize, then ``F.linear`` in x's dtype."""

    name = "reference"

    def pack(self, layer: Linear, weight: QuantizedWeight) -> None:
        self._kind = type(weight)
        layer.register_buffer("q", weight.q, persistent=False)
        layer.register_buffer("scales", weight.scales, persistent=False)
        if isinstance(weight, Int4Weight):
            layer.register_buffer("zeros", weight.zeros, persistent=False)

    def matmul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.dequantize(layer).to(x.dtype))

    def dequantize(self, layer: Linear) -> torch.Tensor:
        q, scales = layer.get_buffer("q"), layer.get_buffer("scales")
        if self._kind is Int8Weight:
            return Int8Weight(q, scales, self._group_size).dequantize()
        if self._kind is Int4Weight:
            return Int4Weight(q, scales, layer.get_buffer("zeros"), self._group_size).dequantize()
        return FP8Weight(q, scales).dequantize()

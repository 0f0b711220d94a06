"""``QuantizedLinear``: what replaces ``nn.Linear`` when the weights are packed, one interface for all.

``forward(x [..., in_features]) -> [..., out_features]`` in x's dtype, like ``nn.Linear``, so the model
code is the same with float and packed weights. Each implementation keeps its packed tensors as
(non-persistent) buffers, in the layout its kernel wants, so ``model.buffers()`` counts the real weight
bytes and ``model.to(device)`` would move them. ``ReferenceLinear`` multiplies through the dequantized
weight: correct on every device, the oracle of the tests, and the fallback where no kernel exists.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

import torch
from torch import nn

from common.quant.formats import FP8Weight, Int4Weight, Int8Weight, QuantizedWeight


class QuantizedLinear(nn.Module):
    """Base: shapes, optional float bias, and the reshape around a 2-D matmul."""

    kernel_name: ClassVar[str]

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.format = type(weight).__name__.removesuffix("Weight").lower()  # int8 | int4 | fp8
        self.group_size = getattr(weight, "group_size", self.in_features)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        if x.dim() == 2 and self.bias is None:  # the model's flat batches: no reshapes
            return self.matmul(x)
        lead = x.shape[:-1]
        y = self.matmul(x.reshape(-1, self.in_features))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    @abstractmethod
    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, in_features] -> [M, out_features], both in x's dtype."""

    def int8_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized fp32 rows ``[n, in_features]`` of an int8 weight (a tied embedding's lookup)."""
        if self.format != "int8":
            raise ValueError(f"int8_rows of a {self.format} weight")
        q = self._int8_q()
        scales = self.get_buffer("scales").float().reshape(self.out_features, -1)
        n = ids.shape[0]
        rows = q[ids].float().view(n, scales.shape[1], -1) * scales[ids].unsqueeze(-1)
        return rows.view(n, self.in_features)

    def _int8_q(self) -> torch.Tensor:
        return self.get_buffer("q")  # [N, K]

    @property
    def weight_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers(recurse=False))

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size != self.in_features else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"
                f"{group}, kernel={self.kernel_name}")


class ReferenceLinear(QuantizedLinear):
    """Any format, any device: dequantize, then ``F.linear`` in x's dtype."""

    kernel_name = "reference"
    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        self._weight = weight
        for name, tensor in _tensors(weight).items():
            self.register_buffer(name, tensor, persistent=False)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.dequantize().to(x.dtype))

    def dequantize(self) -> torch.Tensor:
        w = self._weight
        if isinstance(w, Int8Weight):
            return Int8Weight(self.q, self.scales, w.group_size).dequantize()
        if isinstance(w, Int4Weight):
            return Int4Weight(self.q, self.scales, self.zeros, w.group_size).dequantize()
        return FP8Weight(self.q, self.scales).dequantize()


def _tensors(weight: QuantizedWeight) -> dict[str, torch.Tensor]:
    out = {"q": weight.q, "scales": weight.scales}
    if isinstance(weight, Int4Weight):
        out["zeros"] = weight.zeros
    return out

"""Which ``QuantizedLinear`` runs a packed weight: by format and device, or by name.

``auto`` takes the first entry for the device. CPU: Tandem's kernels with int8-rounded activations at decode
sizes (``tandem_a8``) or float activations (``tandem_cpu``), PyTorch's ops
(``torch``), W8A8 integer GEMM (``int_mm``, what ``--quantization w8a8`` runs), ``reference``. CUDA:
Triton weight-only kernels for int8/int4 (``triton``), PyTorch's tinygemm int4 op (``torch``),
``torch._scaled_mm`` for fp8 (``scaled_mm``), ``reference``. Classes are imported lazily, so
``import common.quant.registry`` needs neither a compiler, CUDA nor Triton.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from common.quant.formats import FP8Weight, Int4Weight, Int8Weight, QuantizedWeight

if TYPE_CHECKING:
    from common.quant.linear import QuantizedLinear

KERNEL_FLAG = "--quantization-kernel"
# (format, device type) -> kernel names, preferred first
KERNELS: dict[tuple[str, str], tuple[str, ...]] = {
    ("int4", "cpu"): ("tandem_a8", "tandem_cpu", "torch", "reference"),
    ("int8", "cpu"): ("tandem_a8", "tandem_cpu", "torch", "int_mm", "reference"),
    ("fp8", "cpu"): ("reference",),
    ("int4", "cuda"): ("triton", "torch", "reference"),
    ("int8", "cuda"): ("triton", "int_mm", "reference"),
    ("fp8", "cuda"): ("scaled_mm", "reference"),
}


def weight_format(weight: QuantizedWeight) -> str:
    if isinstance(weight, Int4Weight):
        return "int4"
    return "int8" if isinstance(weight, Int8Weight) else "fp8"


def kernel_names(fmt: str, device: torch.device) -> tuple[str, ...]:
    return KERNELS.get((fmt, device.type), ("reference",))


def make_linear(weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype,
                kernel: str = "auto") -> QuantizedLinear:
    """A ``QuantizedLinear`` for ``weight`` on ``device`` with ``dtype`` activations."""
    fmt = weight_format(weight)
    names = kernel_names(fmt, device)
    name = names[0] if kernel == "auto" else kernel
    if name not in names:
        raise ValueError(f"{KERNEL_FLAG} {kernel!r} cannot run {fmt} weights on {device.type}; "
                         f"choose auto or one of {', '.join(names)}")
    weight = _to_device(weight, device)
    bias = None if bias is None else bias.to(device=device, dtype=dtype)
    if name == "reference":
        from common.quant.linear import ReferenceLinear

        return ReferenceLinear(weight, bias)
    if name == "int_mm":
        from common.quant.w8a8_linear import Int8LinearW8A8

        assert isinstance(weight, Int8Weight)
        return Int8LinearW8A8(weight, bias)
    if device.type == "cpu":
        from common.quant import cpu_linear

        if isinstance(weight, Int4Weight):
            if name == "torch":
                return cpu_linear.Int4LinearTorch(weight, bias, dtype)
            return (cpu_linear.Int4LinearA8 if name == "tandem_a8" else cpu_linear.Int4LinearCPU)(weight, bias)
        assert isinstance(weight, Int8Weight)
        if name == "torch":
            return cpu_linear.Int8LinearTorch(weight, bias, dtype)
        return (cpu_linear.Int8LinearA8 if name == "tandem_a8" else cpu_linear.Int8LinearCPU)(weight, bias)
    from common.quant import gpu_linear

    if isinstance(weight, FP8Weight):
        return gpu_linear.FP8LinearScaledMM(weight, bias)
    if isinstance(weight, Int4Weight) and name == "torch":
        return gpu_linear.Int4LinearTinyGemm(weight, bias)
    return gpu_linear.TritonLinear(weight, bias)


def _to_device(weight: QuantizedWeight, device: torch.device) -> QuantizedWeight:
    if isinstance(weight, Int4Weight):
        return Int4Weight(weight.q.to(device), weight.scales.to(device), weight.zeros.to(device), weight.group_size)
    if isinstance(weight, Int8Weight):
        return Int8Weight(weight.q.to(device), weight.scales.to(device), weight.group_size)
    return FP8Weight(weight.q.to(device), weight.scales.to(device))

"""Which ``LinearMethod`` runs a layer: by weight format, device and CPU features, or by name.

Packed formats by a table (``auto`` takes the first entry the device runs, ``--quantization-kernel`` names
one); float layers by the kernel settings:

- float, CPU: ``panels`` (16-row panels, where out_features is a multiple of 16) and ``gemv`` (row-major)
  where Tandem's CPU kernels build and ``TANDEM_CPU_GEMV`` allows (``TANDEM_CPU_PANELS=off``: no panels),
  else ``torch`` (``F.linear``); 16-bit activations get row buckets (common/model/row_buckets.py).
  CUDA: ``torch``.
- int4 / int8, CPU: Tandem's kernels with int8-rounded activations (``tandem_a8``) or float activations
  (``tandem_cpu``), PyTorch's ops (``torch``), W8A8 integer GEMM (``int_mm``, what ``--quantization w8a8``
  runs), ``reference``. CUDA: Triton weight-only kernels (``triton``), PyTorch's tinygemm int4 op
  (``torch``), ``int_mm``, ``reference``.
- fp8: ``torch._scaled_mm`` on CUDA (``scaled_mm``), ``reference``.

Methods are imported lazily, so ``import common.quant.registry`` needs neither a compiler, CUDA nor Triton.
Adding a method: its class (``common/model/linear.py`` says where) and an entry here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from common.quant.formats import FP8Weight, Int4Weight, Int8Weight, QuantizedWeight
from common.quant.linear import weight_format

if TYPE_CHECKING:
    from common.model.linear import Linear, LinearMethod

KERNEL_FLAG = "--quantization-kernel"
# (format, device type) -> method names, preferred first
KERNELS: dict[tuple[str, str], tuple[str, ...]] = {
    ("int4", "cpu"): ("tandem_a8", "tandem_cpu", "torch", "reference"),
    ("int8", "cpu"): ("tandem_a8", "tandem_cpu", "torch", "int_mm", "reference"),
    ("fp8", "cpu"): ("reference",),
    ("int4", "cuda"): ("triton", "torch", "reference"),
    ("int8", "cuda"): ("triton", "int_mm", "reference"),
    ("fp8", "cuda"): ("scaled_mm", "reference"),
}
__all__ = ["KERNELS", "KERNEL_FLAG", "float_method", "kernel_names", "packed_method", "weight_format"]


def kernel_names(fmt: str, device: torch.device) -> tuple[str, ...]:
    return KERNELS.get((fmt, device.type), ("reference",))


def float_method(layer: Linear, device: torch.device, dtype: torch.dtype, panels: bool = True) -> LinearMethod:
    """The method for a float layer on ``device`` with ``dtype`` activations. ``panels``: whether this
    caller lets weights leave row-major (a model sliced afterwards does not)."""
    from common.model import gemv, row_buckets
    from common.model.linear import TorchMethod

    bucketed = row_buckets.wanted(device, dtype)
    if not gemv.wanted(device):  # TANDEM_CPU_GEMV=auto|on|off, and the kernels' build
        return TorchMethod(bucketed)
    ops = gemv.gemv_kernels()
    assert ops is not None  # gemv.wanted
    if panels and gemv.PanelMethod.fits(layer) and gemv.panel_mode(layer.weight.dtype):
        return gemv.PanelMethod(ops, bucketed)
    return gemv.GemvMethod(ops, bucketed)


def packed_method(weight: QuantizedWeight, device: torch.device, dtype: torch.dtype,
                  kernel: str = "auto") -> LinearMethod:
    """The method for ``weight`` on ``device`` with ``dtype`` activations (``kernel``: by name, or auto)."""
    fmt = weight_format(weight)
    names = kernel_names(fmt, device)
    name = names[0] if kernel == "auto" else kernel
    if name not in names:
        raise ValueError(f"{KERNEL_FLAG} {kernel!r} cannot run {fmt} weights on {device.type}; "
                         f"choose auto or one of {', '.join(names)}")
    if name == "reference":
        from common.quant.linear import ReferenceMethod

        return ReferenceMethod()
    if name == "int_mm":
        from common.quant.w8a8_linear import W8A8Method

        return W8A8Method()
    if device.type == "cpu":
        from common.quant import cpu_linear

        if name == "torch":
            return cpu_linear.TorchInt4Method(dtype) if isinstance(weight, Int4Weight) \
                else cpu_linear.TorchInt8Method(dtype)
        return cpu_linear.A8Method() if name == "tandem_a8" else cpu_linear.PackedCPUMethod()
    from common.quant import gpu_linear

    if isinstance(weight, FP8Weight):
        return gpu_linear.ScaledMMMethod()
    if isinstance(weight, Int4Weight) and name == "torch":
        return gpu_linear.TinyGemmMethod()
    return gpu_linear.TritonMethod()


def to_device(weight: QuantizedWeight, device: torch.device) -> QuantizedWeight:
    if isinstance(weight, Int4Weight):
        return Int4Weight(weight.q.to(device), weight.scales.to(device), weight.zeros.to(device), weight.group_size)
    if isinstance(weight, Int8Weight):
        return Int8Weight(weight.q.to(device), weight.scales.to(device), weight.group_size)
    return FP8Weight(weight.q.to(device), weight.scales.to(device))

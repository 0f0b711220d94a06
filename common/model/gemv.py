"""Float linear layers on CPU at decode sizes: Tandem's GEMV kernel, the library's matmul above it.

A decode step multiplies each weight matrix by a handful of rows, so it is bound by streaming the weights
from DRAM. Measured on a 2-core AVX-512 EPYC (30 matrices of each SmolLM2 shape, out of cache, 2 threads):
oneDNN's bf16 GEMV streams 11-14 GB/s and MKL's fp32 one 12 GB/s; ``dense_matmul`` (``common/quant/cpu_gemv.cpp``, the
quantized kernels' tiling with software prefetch) streams 17-18 GB/s bf16 and 24-25 GB/s fp32, of the
machine's ~30 GB/s read bandwidth. Rows beyond ``GEMV_MAX_ROWS`` go to ``F.linear`` (row-bucketed for
16-bit activations, common/model/row_buckets.py).

``gemv_linears(model)`` swaps every plain ``nn.Linear`` for ``GemvLinear`` (a subclass: same parameters)
and points the tied LM head at ``linear`` too. ``TANDEM_CPU_GEMV=auto|on|off`` (auto: on CPU where the
kernels build; on: or a start-up error; off: the library's matmuls only). Each row's result does not depend
on how many rows share the call, so speculative verification rows equal plain decode rows.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

import torch
from torch import nn

from common.model.row_buckets import linear_bucketed
from common.quant.cpu_linear import GEMV_MAX_ROWS  # one limit for float and packed weights

log = logging.getLogger(__name__)

_FLOATS = (torch.float32, torch.bfloat16)
_state: dict[str, ModuleType | None] = {}


def gemv_mode() -> str:
    mode = os.environ.get("TANDEM_CPU_GEMV", "auto").strip().lower() or "auto"
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"TANDEM_CPU_GEMV={mode!r}; choose one of auto, on, off")
    return mode


def gemv_kernels() -> ModuleType | None:
    """The compiled kernels (``dense_matmul``), or None where they cannot be built (decided once)."""
    if "ops" not in _state:
        from common.quant.cpu_kernels import quant_kernels

        try:
            _state["ops"] = quant_kernels()
        except RuntimeError as exc:
            log.warning("CPU GEMV kernel unavailable (%s); linear layers use torch's matmul", exc)
            _state["ops"] = None
    return _state["ops"]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           bucketed: bool = False) -> torch.Tensor:
    """``F.linear``, through ``dense_matmul`` for up to ``GEMV_MAX_ROWS`` rows of fp32/bf16 on CPU."""
    ops = _state.get("ops")
    if (ops is not None and x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS and x.dtype in _FLOATS
            and weight.dtype in _FLOATS and x.device.type == "cpu" and weight.is_contiguous()):
        y = ops.dense_matmul(x if x.is_contiguous() else x.contiguous(), weight)
        return y if bias is None else y + bias
    return linear_bucketed(x, weight, bias) if bucketed else nn.functional.linear(x, weight, bias)


class GemvLinear(nn.Linear):
    """``nn.Linear`` through ``linear`` (the GEMV at decode sizes); ``bucketed``: row buckets above it."""

    bucketed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.bucketed)


class GemvBucketedLinear(GemvLinear):
    bucketed = True


def gemv_linears(model: nn.Module, bucketed: bool) -> int:
    """Swap ``model``'s plain (and row-bucketed) ``nn.Linear`` layers for GEMV ones in place; how many.

    The model's tied LM head (``compute_logits`` over the embedding) is pointed at ``linear`` as well."""
    from common.model.row_buckets import BucketedLinear

    cls = GemvBucketedLinear if bucketed else GemvLinear
    count = 0
    for module in model.modules():
        if type(module) in (nn.Linear, BucketedLinear):
            module.__class__ = cls
            count += 1
    if hasattr(model, "head_matmul"):
        object.__setattr__(model, "head_matmul", linear)  # a plain attribute (nn.Module's typing says Module)
    return count


def wanted(device: torch.device) -> bool:
    """Whether the loader should use the GEMV layers on ``device`` (``TANDEM_CPU_GEMV``)."""
    mode = gemv_mode()
    if mode == "off" or device.type != "cpu":
        return False
    if gemv_kernels() is None:
        if mode == "on":
            raise RuntimeError("TANDEM_CPU_GEMV=on but the CPU kernels could not be built (see the log)")
        return False
    return True

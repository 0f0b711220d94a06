"""Keep Triton out of processes that run no Triton kernel.

torch imports ``triton`` on its own whenever it is installed (``torch._dynamo`` probes it when a model is
first built), and at exit libtriton's nanobind bindings then print screens of ``nanobind: leaked ...``
reports. A CPU process runs a Triton kernel only with ``--attention-backend triton`` or
``--quantization-kernel triton`` under ``TRITON_INTERPRET=1`` (the kernel tests); every other one blocks
the import before torch loads, so torch sees "no Triton" and nothing is printed at exit.
"""

from __future__ import annotations

import os
import sys

from common.config.settings import ModelSettings

# Backends and kernels that run Triton code (common/kernels/triton/attention.py, common/kernels/triton/quant.py;
# flash_attn and flashinfer use the Triton paged-KV helpers too).
TRITON_ATTENTION = ("triton", "flash_attn", "flashinfer")


def runs_triton(settings: ModelSettings) -> bool:
    """Whether a process with these settings may run a Triton kernel."""
    if not settings.device.startswith("cpu"):
        return True  # CUDA: Triton kernels are chosen by device (attention, packed weights)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return interpreted and (settings.attention_backend in TRITON_ATTENTION
                            or settings.quantization_kernel == "triton")


def block_unused_triton(settings: ModelSettings) -> bool:
    """Make ``import triton`` fail in this process when no Triton kernel can run; call before torch loads.
    Returns whether it was blocked (a module set to None in ``sys.modules`` raises ImportError on import)."""
    if runs_triton(settings) or "triton" in sys.modules:
        return False
    sys.modules["triton"] = None  # type: ignore[assignment]
    return True

"""Which quantization a model runs with: ``--quantization`` / ``TANDEM_QUANTIZATION`` as a typed config.

- ``none``: the weights as loaded, in the model dtype.
- ``auto``: a GGUF source keeps its own quantization (Q4_0/Q4_1 blocks -> int4, Q8_0 -> int8, other
  tensors as floats); any other source is ``none``.
- ``int8``: weight-only int8, one symmetric scale per output channel (GGUF Q8_0 blocks load as they are).
- ``int4``: weight-only 4-bit in groups of ``--quantization-group-size`` (32, 64, 128) with a scale and a
  zero each; GGUF Q4_0/Q4_1 blocks load as they are when the group size is 32. The LM head is int8 (as
  llama.cpp keeps its output matrix at 8 bits): it is one matrix, and the one most sensitive to rounding.
- ``w8a8``: int8 weights (per channel) times int8 activations quantized per token on the fly, integer
  GEMM (``torch._int_mm``): the fastest at large batches; the activations are rounded too.
- ``fp8``: float8 e4m3 with per-channel scales through ``torch._scaled_mm`` (CUDA, compute capability
  >= 8.9); the LM head stays in the model dtype.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

INT4_GROUP_SIZES = (32, 64, 128)  # the int4 formats' groups (common/quant/formats.py packs them)

FLAG = "--quantization"
GROUP_FLAG = "--quantization-group-size"


class QuantMethod(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    INT8 = "int8"
    INT4 = "int4"
    W8A8 = "w8a8"
    FP8 = "fp8"


class QuantizationError(ValueError):
    """A quantization this model or this hardware cannot run; the message names the flag and why."""


@dataclass(frozen=True)
class QuantConfig:
    method: QuantMethod = QuantMethod.NONE
    group_size: int = 32  # int4 only

    def __post_init__(self) -> None:
        if self.group_size not in INT4_GROUP_SIZES:
            raise QuantizationError(f"{GROUP_FLAG} {self.group_size}: choose one of "
                                    f"{', '.join(map(str, INT4_GROUP_SIZES))}")

    @classmethod
    def parse(cls, method: str | QuantMethod | QuantConfig, group_size: int = 32) -> QuantConfig:
        """From the setting's string (``"int4"``), naming the flag and the choices when it is wrong."""
        if isinstance(method, QuantConfig):
            return method
        if isinstance(method, QuantMethod):
            return cls(method, group_size)
        try:
            return cls(QuantMethod(method.strip().lower()), group_size)
        except ValueError:
            raise QuantizationError(f"{FLAG} {method!r}: choose one of "
                                    f"{', '.join(m.value for m in QuantMethod)}") from None

    @property
    def enabled(self) -> bool:
        return self.method is not QuantMethod.NONE

    def describe(self) -> str:
        return f"int4 (group {self.group_size})" if self.method is QuantMethod.INT4 else self.method.value

"""Which weights a quantization packs, and from what (gpt-fast's ``quantize.py``, as weights, not modules).

``check_quantization`` runs before any weight is read and refuses, naming the flag and the reason, what
the hardware or the model cannot run. ``packed_weights`` then gives each projection (fused q/k/v, o, fused
gate/up, down) and the LM head its packed weight: where the checkpoint came from a GGUF file whose blocks
map onto a packed format (``gguf_blocks``), those bytes as published; otherwise the float weight quantized
here. The after-load pass (common/model/prepare.py) hands each to the method the registry picks. The token
embedding stays a float lookup table (only the rows of the step's tokens are read; it is no part of the
weight stream), unless the model ties it to a GGUF Q8_0 head loaded as published: then the lookup reads
the head's packed rows (``TiedEmbedding``, the same values) and the float table is freed.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING

import torch

from common.model.linear import Linear
from common.quant.config import FLAG, GROUP_FLAG, INT4_GROUP_SIZES, QuantConfig, QuantizationError, QuantMethod
from common.quant.formats import (
    SUB_BLOCK,
    Int4Weight,
    Int8Weight,
    QuantizedWeight,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)

if TYPE_CHECKING:
    from common.config.model_config import ModelConfig
    from common.model.llama import LlamaForCausalLM
    from common.quant.gguf_blocks import GGUFBlocks

log = logging.getLogger(__name__)

# our fused module (inside a decoder layer) -> the Hugging Face modules whose rows it concatenates
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper: FP8 tensor cores, torch._scaled_mm


def linear_in_features(config: ModelConfig) -> dict[str, int]:
    """Each quantized matrix's input width (what a group size must divide)."""
    return {"self_attn.qkv_proj": config.hidden_size, "self_attn.o_proj": config.q_size,
            "mlp.gate_up_proj": config.hidden_size, "mlp.down_proj": config.intermediate_size,
            "lm_head": config.hidden_size,
            **({"experts' down_proj": config.moe.intermediate_size} if config.moe is not None else {})}


def check_quantization(config: QuantConfig, model: ModelConfig, device: torch.device | str) -> None:
    """Raise ``QuantizationError`` (naming the flag and the reason) for what cannot run here."""
    if not config.enabled:
        return
    if model.moe is not None and (config.method not in (QuantMethod.INT8, QuantMethod.INT4)
                                  or torch.device(device).type != "cpu"):
        raise QuantizationError(f"{FLAG} {config.method.value}: {model.model_type}'s routed experts are packed as "
                                f"int8 or int4 on CPU only; serve it in floats or with {FLAG} int8 / int4 on CPU")
    device = torch.device(device)
    if config.method is QuantMethod.FP8:
        if device.type != "cuda" or not torch.cuda.is_available():
            raise QuantizationError(f"{FLAG} fp8 needs a CUDA GPU with FP8 tensor cores (compute capability "
                                    f">= 8.9: Ada, Hopper); the device is {device}. Use int8 or int4 on CPU")
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_MIN_CAPABILITY:
            raise QuantizationError(f"{FLAG} fp8 needs compute capability >= 8.9 for torch._scaled_mm; "
                                    f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}")
        return
    widths = linear_in_features(model)
    for name, width in widths.items():
        if width % SUB_BLOCK:
            raise QuantizationError(f"{FLAG} {config.method.value}: {name} has {width} input features, "
                                    f"not a multiple of {SUB_BLOCK} (the packed kernels' block)")
    if config.method is QuantMethod.INT4:
        bad = {name: width for name, width in widths.items() if name != "lm_head" and width % config.group_size}
        if bad:
            name, width = next(iter(bad.items()))
            fits = [g for g in INT4_GROUP_SIZES if all(w % g == 0 for w in widths.values())]
            raise QuantizationError(f"{GROUP_FLAG} {config.group_size} does not divide {name}'s {width} input "
                                    f"features; group sizes that fit this model: {', '.join(map(str, fits))}")
    if device.type == "cpu":
        from common.kernels.cpu import quant_kernels

        try:
            quant_kernels()
        except RuntimeError as exc:
            raise QuantizationError(f"{FLAG} {config.method.value}: {exc}") from exc
    elif device.type == "cuda" and importlib.util.find_spec("triton") is None and config.method is not QuantMethod.W8A8:
        raise QuantizationError(f"{FLAG} {config.method.value} on CUDA runs Triton kernels; install triton "
                                f"(or choose --quantization-kernel reference)")


def packed_weights(model: LlamaForCausalLM, config: QuantConfig, gguf: GGUFBlocks | None = None
                   ) -> dict[str, tuple[QuantizedWeight, bool]]:
    """The packed weight of each matrix ``config`` quantizes, by module name (``layers.3.mlp.down_proj``,
    ``lm_head``), with whether it is the GGUF file's own bytes; matrices left out stay in floats.
    ``gguf``: the checkpoint's source blocks, if any. Reads the layers' float weights as loaded."""
    out: dict[str, tuple[QuantizedWeight, bool]] = {}
    if not config.enabled:
        return out
    for i, layer in enumerate(model.layers):
        for ours, theirs in FUSED.items():
            if ours.startswith("mlp.") and not hasattr(layer.get_submodule("mlp"), "down_proj"):
                continue  # a mixture of experts' routed layer: its experts are packed by their own strategy
            path, linear = f"layers.{i}.{ours}", layer.get_submodule(ours)
            if not isinstance(linear, Linear):  # a row-parallel layer (common/parallel): its matmul is packed
                path, linear = f"{path}.linear", linear.get_submodule("linear")
            assert isinstance(linear, Linear)
            sources = [f"model.layers.{i}.{name}.weight" for name in theirs]
            weight, from_gguf = _weight_for(config, linear.weight, sources, gguf, head=False)
            if weight is not None:
                out[path] = (weight, from_gguf)
    head = model.lm_head
    if head.out_features:
        source = "model.embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"
        weight, from_gguf = _weight_for(config, head.weight, [source], gguf, head=True)
        if weight is not None:
            out["lm_head"] = (weight, from_gguf)
    direct = sum(from_gguf for _, from_gguf in out.values())
    log.info("quantization %s: %d matrices from GGUF blocks as published, %d quantized at load",
             config.describe(), direct, len(out) - direct)
    return out


def kernel_for(config: QuantConfig, kernel: str) -> str:
    """The ``--quantization-kernel`` a packed layer asks the registry for (W8A8 runs the integer GEMM)."""
    return "int_mm" if config.method is QuantMethod.W8A8 and kernel == "auto" else kernel


def _weight_for(config: QuantConfig, weight: torch.Tensor, sources: list[str], gguf: GGUFBlocks | None,
                head: bool) -> tuple[QuantizedWeight | None, bool]:
    """The packed weight for one matrix (None: keep it in floats) and whether it is GGUF's own bytes."""
    method = config.method
    # W8A8's integer GEMM takes one scale per output channel: GGUF's 32-weight groups do not fit it.
    published = None if method is QuantMethod.W8A8 else _published(sources, gguf)
    if published is not None:
        is_int4 = isinstance(published, Int4Weight)
        if method is QuantMethod.AUTO:
            return published, True
        if method is QuantMethod.INT8 and not is_int4:
            return published, True
        # int4: the published 4-bit blocks when the groups match; the head keeps its 8 (or 4) bits.
        groups_match = isinstance(published, Int4Weight) and published.group_size == config.group_size
        if method is QuantMethod.INT4 and (groups_match or head):
            return published, True
    w = weight.detach().float()
    if method in (QuantMethod.INT8, QuantMethod.W8A8) or (method is QuantMethod.INT4 and head):
        return quantize_int8(w), False
    if method is QuantMethod.INT4:
        return quantize_int4(w, config.group_size), False
    if method is QuantMethod.FP8 and not head:
        return quantize_fp8(w), False
    return None, False  # auto without GGUF blocks; fp8's LM head


def _published(sources: list[str], gguf: GGUFBlocks | None) -> QuantizedWeight | None:
    """The GGUF blocks of all ``sources`` concatenated by rows, when they share one packed format."""
    if gguf is None:
        return None
    parts = [gguf.packed(name) for name in sources]
    if any(p is None for p in parts):
        return None
    if all(isinstance(p, Int4Weight) for p in parts):
        int4 = [p for p in parts if isinstance(p, Int4Weight)]
        if len({p.group_size for p in int4}) == 1:
            return Int4Weight(torch.cat([p.q for p in int4]), torch.cat([p.scales for p in int4]),
                              torch.cat([p.zeros for p in int4]), int4[0].group_size)
    if all(isinstance(p, Int8Weight) for p in parts):
        int8 = [p for p in parts if isinstance(p, Int8Weight)]
        if len({p.group_size for p in int8}) == 1:
            return Int8Weight(torch.cat([p.q for p in int8]), torch.cat([p.scales for p in int8]),
                              int8[0].group_size)
    return None

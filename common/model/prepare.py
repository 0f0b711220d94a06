"""The one pass after loading: each ``Linear`` gets its method, the tied lookup its rows, the model its executors.

``prepare_model`` runs once on a model whose float weights are loaded (and, on a parallel rank, sliced):

1. each projection and the LM head get the ``LinearMethod`` the registry (common/quant/registry.py) picks
   for their weight's format on this device and CPU: the packed weight ``quantizer.packed_weights`` gives
   (GGUF blocks as published, or quantized at load), else the float weight as loaded;
   A mixture of experts' routed experts get their way of running on this device (``experts_for``);
2. a tied model's token lookup reads the LM head's rows through its method (``TiedEmbedding``) where the
   head holds them exactly (16-row float panels; GGUF Q8_0 rows as published), and the float table is freed;
3. the fused elementwise ops (common/model/fused_ops.py) and, on CPU, glibc malloc set to keep step buffers
   (common/kernels/host_malloc.py) and the one-call decode step (common/model/decode_step.py), which reads each
   method's public ``step_weights``.

Nothing swaps a module's class, and nothing after this pass reads a method's private state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from common.model.linear import Linear, TiedEmbedding

if TYPE_CHECKING:
    from common.model.llama import LlamaForCausalLM
    from common.quant.config import QuantConfig
    from common.quant.formats import QuantizedWeight
    from common.quant.gguf_blocks import GGUFBlocks


def prepare_model(model: LlamaForCausalLM, device: torch.device | str, quant: QuantConfig | None = None,
                  gguf: GGUFBlocks | None = None, kernel: str = "auto", panels: bool = True,
                  decode_step: bool = True) -> None:
    """Methods for every layer, the tied lookup, the fused ops and the decode step (see the module docstring).

    ``panels``: float layers may leave row-major (16-row panels on CPU). ``decode_step``: build the one-call
    CPU step where it applies."""
    device = torch.device(device)
    dtype = model.dtype
    packed: dict[str, tuple[QuantizedWeight, bool]] = {}
    kernel_name = kernel
    if quant is not None and quant.enabled:
        from common.quant.quantizer import kernel_for, packed_weights

        packed = packed_weights(model, quant, gguf)
        kernel_name = kernel_for(quant, kernel)
    from common.quant.registry import float_method, packed_method, to_device

    model.lm_head.float_out = True  # logits go to sampling in fp32
    for name, layer in model.named_modules():
        if not isinstance(layer, Linear):
            continue
        if name in packed:
            weight = to_device(packed[name][0], device)
            layer.set_method(packed_method(weight, device, dtype, kernel_name), weight)
        else:
            layer.set_method(float_method(layer, device, dtype, panels))
    from common.model.moe import SparseMoE, experts_for, packed_experts_for

    for layer in model.modules():  # a mixture of experts' routed experts: this device's way (common/model/moe.py)
        if isinstance(layer, SparseMoE):
            layer.set_experts(packed_experts_for(layer, quant.method.value, quant.group_size)
                              if quant is not None and quant.enabled else experts_for(layer, device))
    _tie_lookup(model, dtype, published_head="lm_head" in packed and packed["lm_head"][1])
    from common.model.fused_ops import fused_ops_for

    model.fused_ops = fused_ops_for(device)  # TANDEM_FUSED_OPS=auto|on|off
    if device.type == "cpu":
        from common.kernels.host_malloc import keep_step_buffers

        keep_step_buffers()  # TANDEM_CPU_MALLOC=auto|on|off: no page faults on every step's activations
    if decode_step and device.type == "cpu":
        from common.model.decode_step import DecodeStep

        model.decode_step = DecodeStep.for_model(model)  # TANDEM_DECODE_STEP=auto|on|off


def _tie_lookup(model: LlamaForCausalLM, dtype: torch.dtype, published_head: bool) -> None:
    """A tied model's lookup through the head's rows where they are the table's exact values: float panels
    (the same floats), or a head packed from GGUF's Q8_0 rows as published (the checkpoint's own values;
    a head quantized here keeps the float table, or the lookup would inherit the rounding)."""
    from common.model.gemv import PanelMethod

    head, embed = model.lm_head, model.embed_tokens
    if not model.config.tie_word_embeddings or not isinstance(embed, nn.Embedding) or embed.num_embeddings == 0:
        return
    if isinstance(head.method, PanelMethod) or (published_head and head.format == "int8"):
        model.embed_tokens = TiedEmbedding(head, dtype)

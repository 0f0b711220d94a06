"""The model families Tandem runs, by Hugging Face ``model_type``: the one place a family is added.

A ``Family`` says what a checkpoint of that ``model_type`` is to Tandem's one model (common/model/llama.py):

- which architectural options its ``config.json`` turns on (``ArchOptions``: biases, q/k norms, each layer's
  sliding attention window), read as transformers reads them, and the defaults transformers gives fields the
  file leaves out;
- what in that file Tandem cannot honour, refused with a ``ValueError`` that names the field (an activation
  other than SiLU, a ``layer_types`` entry other than full or sliding attention) instead of running and
  answering something else;
- how the checkpoint's per-layer weight names land in the model (``fused_weights``: the Hugging Face
  projections that stream into one fused matrix; every other name is the model's own).

``common.config.model_config.ModelConfig.from_dict`` reads the fields every family shares (sizes, heads,
``head_dim``, RoPE, token ids) and asks the family for the rest; ``common.model.loader`` takes its weight map.
A family whose options already exist is one entry in ``FAMILIES``; a new option is a ``ModelConfig`` field
plus its code in the shared layers (docs/models.md). Pure Python: the gateway reads configs through it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

Raw = Mapping[str, Any]  # a config.json, as parsed

# The Llama checkpoint layout: separate q/k/v and gate/up projections, which the loader copies into the
# model's fused qkv_proj and gate_up_proj as they stream in. Hugging Face module -> (ours, part), where part
# indexes the fused matrix's row blocks (qkv: q, k, v; gate_up: gate, up).
SPLIT_PROJECTIONS: Mapping[str, tuple[str, int]] = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}

# transformers' ACT2FN: both names are torch's SiLU, the only activation the MLP implements (fused_ops.silu_mul).
SILU = ("silu", "swish")


@dataclass(frozen=True)
class ArchOptions:
    """The architectural options a family's config turns on (``ModelConfig`` fields of the same names)."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over head_dim of each q and k head, before rotary (Qwen3)
    # Per layer, the sliding attention window (None: the whole sequence); () when no layer has one. A token at
    # position p attends to positions p - window + 1 .. p: transformers' sliding_window_overlay
    # (kv_idx > q_idx - sliding_window) on its causal mask.
    layer_windows: tuple[int | None, ...] = ()


Windows = tuple[int | None, ...]


def _no_window(raw: Raw) -> Windows:
    return ()


@dataclass(frozen=True)
class Family:
    """What one Hugging Face ``model_type`` is to Tandem (see the module docstring)."""

    model_type: str
    architecture: str  # transformers' class, as config.json's ``architectures`` names it
    options: Callable[[Raw], ArchOptions]
    rms_norm_eps: float = 1e-6  # where config.json leaves it out (transformers' default for every family here)
    head_dim: int | None = None  # where config.json leaves it out (None: hidden_size / num_attention_heads)
    # Each layer's attention window, as transformers' modeling code of this family sets it (() : none has one).
    layer_windows: Callable[[Raw], Windows] = _no_window
    fused_weights: Mapping[str, tuple[str, int]] = field(default_factory=lambda: SPLIT_PROJECTIONS)

    def read(self, raw: Raw) -> ArchOptions:
        """The options of this config, refusing (``ValueError`` naming the field) what Tandem cannot honour."""
        act = raw.get("hidden_act", "silu")
        if act not in SILU:
            raise ValueError(f"hidden_act {act!r} is not supported ({self.model_type}): Tandem's MLP implements "
                             f"silu only")
        windows = self.layer_windows(raw)
        for window in windows:
            if window is not None and window < 1:
                raise ValueError(f"sliding_window must be >= 1 where a layer uses it, got {window}")
        return replace(self.options(raw), layer_windows=windows)


def _llama_options(raw: Raw) -> ArchOptions:
    # Llama's `attention_bias` puts a bias on q, k, v and o alike.
    bias = bool(raw.get("attention_bias", False))
    return ArchOptions(qkv_bias=bias, o_bias=bias, mlp_bias=bool(raw.get("mlp_bias", False)))


def _qwen2_options(raw: Raw) -> ArchOptions:
    return ArchOptions(qkv_bias=True)  # always on q/k/v, never on o or the MLP


def _qwen3_options(raw: Raw) -> ArchOptions:
    bias = bool(raw.get("attention_bias", False))  # q, k, v and o alike; the MLP has none
    return ArchOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)


def _phi3_options(raw: Raw) -> ArchOptions:
    # Phi-3 has no biases; its rotary may cover only part of each head (Phi-3.5 / Phi-4-mini), which Tandem's
    # rotary does not implement.
    params: Raw = raw.get("rope_parameters") or {}
    factor = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if factor != 1.0:
        raise ValueError(f"partial_rotary_factor {factor} is not supported (phi3): Tandem's rotary embeds the "
                         f"whole head_dim")
    return ArchOptions()


def _mistral_windows(raw: Raw) -> Windows:
    # MistralModel builds a sliding-window mask for every layer whenever sliding_window is set (layer_types,
    # which transformers only warns about here, is ignored).
    window = raw.get("sliding_window")
    return () if window is None else (int(window),) * int(raw["num_hidden_layers"])


def _qwen_windows(raw: Raw) -> Windows:
    """Qwen2 / Qwen3: the window counts only with ``use_sliding_window``, and only for the layers ``layer_types``
    marks ``sliding_attention`` (when absent: those from ``max_window_layers`` on, transformers' default 28)."""
    num_layers = int(raw["num_hidden_layers"])
    window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"layer_types {unknown} are not supported: Tandem runs full_attention and "
                             f"sliding_attention layers")
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} num_hidden_layers")
    if window is None:
        return ()
    if layer_types is None:  # Qwen2Config's default: sliding from max_window_layers on
        first = int(raw.get("max_window_layers", 28))
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    windows = tuple(int(window) if kind == "sliding_attention" else None for kind in layer_types)
    return windows if any(w is not None for w in windows) else ()


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM", _llama_options),
    # transformers' Mistral has no biases and never reads attention_bias / mlp_bias: neither does Tandem.
    Family("mistral", "MistralForCausalLM", lambda raw: ArchOptions(), layer_windows=_mistral_windows),
    Family("qwen2", "Qwen2ForCausalLM", _qwen2_options, layer_windows=_qwen_windows),
    Family("qwen3", "Qwen3ForCausalLM", _qwen3_options, head_dim=128, layer_windows=_qwen_windows),
    # Phi-3: q/k/v and gate/up already fused in the checkpoint, under the model's own names (no weight map); a
    # window on every layer when sliding_window is set, as Mistral.
    Family("phi3", "Phi3ForCausalLM", _phi3_options, rms_norm_eps=1e-5, layer_windows=_mistral_windows,
           fused_weights={}),
)}

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def family(model_type: str) -> Family:
    """The family of ``model_type``, or a ``ValueError`` naming the field and the supported ones."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}") from None

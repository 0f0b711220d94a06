"""The model families Tandem runs, by Hugging Face ``model_type``: the one place a family is added.

A ``Family`` says what a checkpoint of that ``model_type`` is to Tandem's one model (common/model/llama.py):

- which architectural options its ``config.json`` turns on (``ArchOptions``: biases, q/k norms), read as
  transformers reads them, and the defaults transformers gives fields the file leaves out;
- what in that file Tandem cannot honour, refused with a ``ValueError`` that names the field (a sliding window
  in use, an activation other than SiLU) instead of running and answering something else;
- how the checkpoint's per-layer weight names land in the model (``fused_weights``: the Hugging Face
  projections that stream into one fused matrix; every other name is the model's own).

``common.config.model_config.ModelConfig.from_dict`` reads the fields every family shares (sizes, heads,
``head_dim``, RoPE, token ids) and asks the family for the rest; ``common.model.loader`` takes its weight map.
A family whose options already exist is one entry in ``FAMILIES``; a new option is a ``ModelConfig`` field
plus its code in the shared layers (docs/models.md). Pure Python: the gateway reads configs through it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
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


def _no_window(raw: Raw) -> int | None:
    return None


@dataclass(frozen=True)
class Family:
    """What one Hugging Face ``model_type`` is to Tandem (see the module docstring)."""

    model_type: str
    architecture: str  # transformers' class, as config.json's ``architectures`` names it
    options: Callable[[Raw], ArchOptions]
    rms_norm_eps: float = 1e-6  # where config.json leaves it out (transformers' default for every family here)
    head_dim: int | None = None  # where config.json leaves it out (None: hidden_size / num_attention_heads)
    # The attention window some layer of this config uses (None: every layer attends to the whole sequence).
    sliding_window: Callable[[Raw], int | None] = _no_window
    fused_weights: Mapping[str, tuple[str, int]] = field(default_factory=lambda: SPLIT_PROJECTIONS)

    def read(self, raw: Raw) -> ArchOptions:
        """The options of this config, refusing (``ValueError`` naming the field) what Tandem cannot honour."""
        act = raw.get("hidden_act", "silu")
        if act not in SILU:
            raise ValueError(f"hidden_act {act!r} is not supported ({self.model_type}): Tandem's MLP implements "
                             f"silu only")
        window = self.sliding_window(raw)
        if window is not None:
            # Tandem's attention has no window yet (issue 36): every layer would attend to the whole sequence
            # and answer other tokens than the model's.
            raise ValueError(f"sliding_window {window} is in use ({self.model_type}) and Tandem does not "
                             f"implement sliding-window attention yet; a config without one (sliding_window "
                             f"null, or use_sliding_window false where the family has it) runs")
        return self.options(raw)


def _llama_options(raw: Raw) -> ArchOptions:
    # Llama's `attention_bias` puts a bias on q, k, v and o alike.
    bias = bool(raw.get("attention_bias", False))
    return ArchOptions(qkv_bias=bias, o_bias=bias, mlp_bias=bool(raw.get("mlp_bias", False)))


def _qwen2_options(raw: Raw) -> ArchOptions:
    return ArchOptions(qkv_bias=True)  # always on q/k/v, never on o or the MLP


def _qwen3_options(raw: Raw) -> ArchOptions:
    bias = bool(raw.get("attention_bias", False))  # q, k, v and o alike; the MLP has none
    return ArchOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)


def _mistral_window(raw: Raw) -> int | None:
    # MistralModel builds a sliding-window mask for every layer whenever sliding_window is set.
    window = raw.get("sliding_window")
    return None if window is None else int(window)


def _qwen_window(raw: Raw) -> int | None:
    """Qwen2 / Qwen3: the window counts only with ``use_sliding_window``, and only for the layers ``layer_types``
    marks ``sliding_attention`` (when absent: those from ``max_window_layers`` on, transformers' default 28)."""
    window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"layer_types {unknown} are not supported: Tandem runs full_attention layers")
    if window is None:
        return None
    if layer_types is None:
        num_layers = int(raw["num_hidden_layers"])
        return int(window) if num_layers > int(raw.get("max_window_layers", 28)) else None
    return int(window) if "sliding_attention" in layer_types else None


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM", _llama_options),
    # transformers' Mistral has no biases and never reads attention_bias / mlp_bias: neither does Tandem.
    Family("mistral", "MistralForCausalLM", lambda raw: ArchOptions(), sliding_window=_mistral_window),
    Family("qwen2", "Qwen2ForCausalLM", _qwen2_options, sliding_window=_qwen_window),
    Family("qwen3", "Qwen3ForCausalLM", _qwen3_options, head_dim=128, sliding_window=_qwen_window),
)}

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def family(model_type: str) -> Family:
    """The family of ``model_type``, or a ``ValueError`` naming the field and the supported ones."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}") from None

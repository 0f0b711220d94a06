"""The model families Tandem runs, by Hugging Face ``model_type``: the one place a family is added.

A ``Family`` says what a checkpoint of that ``model_type`` is to Tandem's one model (common/model/llama.py):

- which architectural options its ``config.json`` turns on (``ArchOptions``: biases, q/k norms, each layer's
  sliding attention window, Gemma's sandwich norms, GELU, scalings and soft-caps), read as transformers reads
  them, and the defaults transformers gives fields the file leaves out;
- what in that file Tandem cannot honour, refused with a ``ValueError`` that names the field (an activation
  other than SiLU, a ``layer_types`` entry other than full or sliding attention) instead of running and
  answering something else;
- how the checkpoint's per-layer weight names land in the model (``fused_weights``: the Hugging Face
  projections that stream into one fused matrix; ``experts``: where a mixture of experts keeps each
  expert's projections, stacked into the model's per-layer expert tensors; every other name is the
  model's own).

``common.config.model_config.ModelConfig.from_dict`` reads the fields every family shares (sizes, heads,
``head_dim``, RoPE, token ids) and asks the family for the rest; ``common.model.loader`` takes its weight map.
A family whose options already exist is one entry in ``FAMILIES``; a new option is a ``ModelConfig`` field
plus its code in the shared layers (docs/models.md). Pure Python: the gateway reads configs through it.
"""

from __future__ import annotations

import enum
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

# transformers' ACT2FN: both names are torch's SiLU (fused_ops.silu_mul).
SILU = ("silu", "swish")


class Activation(enum.Enum):
    """The gated MLP's activation: ``down(act(gate) * up)``."""

    SILU = "silu"  # Llama, Mistral, Qwen, Phi-3 (fused_ops.silu_mul)
    # transformers' GELUTanh (``gelu_pytorch_tanh``): torch's gelu(approximate="tanh"), Gemma 2 / 3
    # (fused_ops.gelu_tanh_mul). ``gelu_new`` / ``gelu_python_tanh`` compute the same curve another way, not
    # bit for bit: refused.
    GELU_TANH = "gelu_pytorch_tanh"


@dataclass(frozen=True)
class ArchOptions:
    """The architectural options a family's config turns on (``ModelConfig`` fields of the same names)."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over head_dim of each q and k head, before rotary (Qwen3)
    attention_sinks: bool = False  # a learned logit per query head in every softmax's denominator (gpt-oss)
    # Per layer, the sliding attention window (None: the whole sequence); () when no layer has one. A token at
    # position p attends to positions p - window + 1 .. p: transformers' sliding_window_overlay
    # (kv_idx > q_idx - sliding_window) on its causal mask.
    layer_windows: tuple[int | None, ...] = ()
    activation: Activation = Activation.SILU
    # Gemma 2 / 3: every RMSNorm scales by (1 + weight), in fp32 before the cast back (Gemma's RMSNorm) ...
    unit_offset_norms: bool = False
    # ... and the layer is sandwiched: attention's and the MLP's outputs are normed before their residual adds
    # (post_attention_layernorm, post_feedforward_layernorm), the MLP's input by pre_feedforward_layernorm.
    sandwich_norms: bool = False
    embed_scale: float | None = None  # token embeddings times this (Gemma: sqrt(hidden_size)); None: unscaled
    query_pre_attn_scalar: float | None = None  # attention scale query_pre_attn_scalar ** -0.5 (None: head_dim's)
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap) before the mask (Gemma 2)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2 / 3)
    # Raw RoPE parameter dicts (rope_type, rope_theta, factor ...) where the family keeps them elsewhere than
    # the shared reading looks (ModelConfig._read_rope): the global layers' and the sliding layers' own (Gemma 3's
    # local base). None: the shared reading, and the sliding layers share the global rotary.
    rope: Raw | None = None
    sliding_rope: Raw | None = None
    moe: MoEOptions | None = None  # routed experts (Mixtral, Qwen3-MoE); None: every layer's MLP is dense


@dataclass(frozen=True)
class MoEOptions:
    """A mixture of experts: which layers route each token to ``experts_per_token`` of ``num_experts`` SwiGLU
    experts of width ``intermediate_size``, and how the router's probabilities become the experts' weights."""

    num_experts: int
    experts_per_token: int
    intermediate_size: int
    # softmax over all experts, top-k, then (True) the k weights renormalised to sum to 1 (Mixtral always;
    # Qwen3-MoE when norm_topk_prob)
    norm_topk_prob: bool
    layers: tuple[bool, ...]  # per layer: routed experts (True) or the dense MLP of the config's intermediate_size
    # gpt-oss's variant: top-k of the router's logits first, then a softmax over those k; a bias on the router
    # and on every expert's projections; its clamped SwiGLU: gate * sigmoid(alpha * gate) * (up + 1), the gate
    # clamped above at ``swiglu_limit``, up to +-``swiglu_limit`` (None: silu(gate) * up)
    topk_before_softmax: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], got "
                             f"{self.experts_per_token}")
        if self.intermediate_size < 1:
            raise ValueError(f"the experts' intermediate size must be >= 1, got {self.intermediate_size}")


# Where a MoE checkpoint keeps its experts, as transformers saves them in the hub's layout: per layer,
# ``model.layers.L.<prefix>.gate.weight`` (the router, [num_experts, hidden]) and, per expert E,
# ``model.layers.L.<prefix>.experts.E.<name>.weight``; ``names`` maps each expert projection to the model's
# stacked tensor and its row block: w13 [num_experts, 2 * intermediate, hidden] (gate rows, then up rows),
# w2 [num_experts, hidden, intermediate].
@dataclass(frozen=True)
class ExpertLayout:
    prefix: str
    names: Mapping[str, tuple[str, int]]
    # gpt-oss keeps each layer's experts already stacked, x @ W style: ``experts.gate_up_proj`` [E, hidden,
    # 2 * inter] with gate and up columns interleaved (gate even, up odd), ``experts.down_proj`` [E, inter,
    # hidden], their biases, and the router as ``router``: the loader transposes and de-interleaves them.
    stacked: bool = False
    router: str = "gate"


GPT_OSS_EXPERTS = ExpertLayout("mlp", {}, stacked=True, router="router")
MIXTRAL_EXPERTS = ExpertLayout("block_sparse_moe", {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", 0)})
QWEN_EXPERTS = ExpertLayout("mlp", {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)})


Windows = tuple[int | None, ...]


def _no_window(raw: Raw) -> Windows:
    return ()


def _as_is(raw: Raw) -> Raw:
    return raw


def _silu_only(raw: Raw, model_type: str) -> Activation:
    act = raw.get("hidden_act", "silu")
    if act not in SILU:
        raise ValueError(f"hidden_act {act!r} is not supported ({model_type}): Tandem's MLP implements silu only")
    return Activation.SILU


@dataclass(frozen=True)
class Family:
    """What one Hugging Face ``model_type`` is to Tandem (see the module docstring)."""

    model_type: str
    architecture: str  # transformers' class, as config.json's ``architectures`` names it
    options: Callable[[Raw], ArchOptions]
    rms_norm_eps: float = 1e-6  # where config.json leaves it out (transformers' default for every family here)
    head_dim: int | None = None  # where config.json leaves it out (None: hidden_size / num_attention_heads)
    # Where config.json has no rope_theta (nor rope_parameters' own) / neither rope_parameters nor rope_scaling: the
    # family config's default_theta and default rotary (gpt-oss: its YaRN).
    rope_theta: float = 10000.0
    rope_scaling: Raw | None = None
    # Each layer's attention window, as transformers' modeling code of this family sets it (() : none has one).
    layer_windows: Callable[[Raw], Windows] = _no_window
    fused_weights: Mapping[str, tuple[str, int]] = field(default_factory=lambda: SPLIT_PROJECTIONS)
    experts: ExpertLayout | None = None  # a mixture of experts' checkpoint names (None: no experts)
    # The MLP's activation as this family's modeling code reads it (Gemma: hidden_activation, not hidden_act).
    activation: Callable[[Raw, str], Activation] = _silu_only
    tie_word_embeddings: bool = False  # where config.json leaves it out (transformers' default for the family)
    # The config.json fields the model reads (every one above, and ModelConfig.from_dict's): the file itself, or
    # an image-and-text checkpoint's text_config (Gemma 3's); its model_type stays the file's.
    text_view: Callable[[Raw], Raw] = _as_is
    # Checkpoint name prefix -> the model's (``language_model.model.`` -> ``model.``), or None: a tensor of another
    # part of the checkpoint (a vision tower), not read. Applied before every other mapping; {}: names as they are.
    weight_prefixes: Mapping[str, str | None] = field(default_factory=dict)

    def weight_name(self, name: str) -> str | None:
        """A checkpoint tensor's name as the text model's (None: not part of it, skipped)."""
        for prefix, ours in self.weight_prefixes.items():
            if name.startswith(prefix):
                return None if ours is None else ours + name.removeprefix(prefix)
        return name

    def read(self, raw: Raw) -> ArchOptions:
        """The options of this config, refusing (``ValueError`` naming the field) what Tandem cannot honour."""
        activation = self.activation(raw, self.model_type)
        windows = self.layer_windows(raw)
        for window in windows:
            if window is not None and window < 1:
                raise ValueError(f"sliding_window must be >= 1 where a layer uses it, got {window}")
        return replace(self.options(raw), layer_windows=windows, activation=activation)


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
    """Phi-3 has no biases; its rotary may cover only part of each head (Phi-3.5 / Phi-4-mini), which Tandem's rotary
    does not implement. Phi3Config takes default or longrope RoPE (the old names su and yarn both meaning longrope),
    the top-level original_max_position_embeddings winning over the rope dict's."""
    params: Raw = raw.get("rope_parameters") or {}
    factor = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if factor != 1.0:
        raise ValueError(f"partial_rotary_factor {factor} is not supported (phi3): Tandem's rotary embeds the "
                         f"whole head_dim")
    scaling: Raw = raw.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return ArchOptions()
    if rope_type not in ("longrope", "su", "yarn"):
        raise ValueError(f"rope_scaling.rope_type {rope_type!r} is not supported (phi3): Phi3Config takes default or "
                         f"longrope")
    rope = {**scaling, "rope_type": "longrope", "rope_theta": params.get("rope_theta", raw.get("rope_theta", 10000.0))}
    if raw.get("original_max_position_embeddings"):
        rope["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
    return ArchOptions(rope=rope)


def _mixtral_options(raw: Raw) -> ArchOptions:
    # MixtralSparseMoeBlock: every layer routed, the top-k weights always renormalised; no biases.
    layers = int(raw["num_hidden_layers"])
    return ArchOptions(moe=MoEOptions(
        num_experts=int(raw.get("num_local_experts", 8)), experts_per_token=int(raw.get("num_experts_per_tok", 2)),
        intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=True, layers=(True,) * layers))


def _qwen3_moe_options(raw: Raw) -> ArchOptions:
    """Qwen3MoeDecoderLayer: routed experts where ``layer_idx not in mlp_only_layers`` and
    ``(layer_idx + 1) % decoder_sparse_step == 0`` (and num_experts > 0), else the dense MLP."""
    options = _qwen3_options(raw)
    layers = int(raw["num_hidden_layers"])
    # The hub's files say num_experts; transformers 5 saves it as num_local_experts (its attribute_map).
    num_experts = int(raw.get("num_experts", raw.get("num_local_experts", 128)))
    step = int(raw.get("decoder_sparse_step", 1))
    if step < 1:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
    dense = {int(i) for i in raw.get("mlp_only_layers") or ()}
    routed = tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(layers))
    if not any(routed):
        return options  # every layer dense: a Qwen3 model in MoE's clothes
    return replace(options, moe=MoEOptions(
        num_experts=num_experts, experts_per_token=int(raw.get("num_experts_per_tok", 8)),
        intermediate_size=int(raw.get("moe_intermediate_size", 768)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)), layers=routed))


def _gpt_oss_options(raw: Raw) -> ArchOptions:
    """GptOssForCausalLM: q/k/v/o biases (``attention_bias``), attention sinks, routed experts in every layer
    (top-k of the logits, softmax over them, biases everywhere, the clamped SwiGLU)."""
    quant = raw.get("quantization_config") or {}
    if quant.get("quant_method"):
        raise ValueError(f"quantization_config.quant_method {quant['quant_method']!r} is not supported (gpt_oss's "
                         f"published MXFP4 experts): load a dequantized checkpoint (bf16 weights)")
    bias = bool(raw.get("attention_bias", True))
    layers = int(raw["num_hidden_layers"])
    return ArchOptions(qkv_bias=bias, o_bias=bias, attention_sinks=True, moe=MoEOptions(
        num_experts=int(raw.get("num_local_experts", 128)), experts_per_token=int(raw.get("num_experts_per_tok", 4)),
        intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=False, layers=(True,) * layers,
        topk_before_softmax=True, router_bias=True, expert_bias=True,
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)), swiglu_alpha=float(raw.get("swiglu_alpha", 1.702))))


def _layer_type_windows(raw: Raw) -> Windows:
    """gpt-oss: ``layer_types`` (default: sliding on even layers, full on odd) with ``sliding_window``."""
    num_layers = int(raw["num_hidden_layers"])
    layer_types = raw.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                             for i in range(num_layers)]
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported: Tandem runs full_attention and "
                         f"sliding_attention layers")
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} num_hidden_layers")
    window = raw.get("sliding_window")
    if window is None:
        return ()
    return tuple(int(window) if kind == "sliding_attention" else None for kind in layer_types)


def _mistral_windows(raw: Raw) -> Windows:
    # MistralModel builds a sliding-window mask for every layer whenever sliding_window is set (layer_types,
    # which transformers only warns about here, is ignored).
    window = raw.get("sliding_window")
    return () if window is None else (int(window),) * int(raw["num_hidden_layers"])


def _qwen3_moe_windows(raw: Raw) -> Windows:
    """Qwen3-MoE: with ``use_sliding_window``, ``sliding_window`` on every layer. Qwen3MoeConfig has neither
    ``max_window_layers`` nor ``layer_types`` (the hub's files carry the former; transformers never reads it here):
    Qwen3MoeAttention takes the config's window in every layer and the model builds one sliding mask for all."""
    window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
    return () if window is None else (int(window),) * int(raw["num_hidden_layers"])


def _layer_types(raw: Raw, num_layers: int) -> list[str] | None:
    """``layer_types`` as given (None when absent), refused naming the field unless every entry is full or sliding
    attention, one per layer."""
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"layer_types {unknown} are not supported: Tandem runs full_attention and "
                             f"sliding_attention layers")
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} num_hidden_layers")
    return None if layer_types is None else list(layer_types)


def _qwen_windows(raw: Raw) -> Windows:
    """Qwen2 / Qwen3: the window counts only with ``use_sliding_window``, and only for the layers ``layer_types``
    marks ``sliding_attention`` (when absent: those from ``max_window_layers`` on, transformers' default 28)."""
    num_layers = int(raw["num_hidden_layers"])
    window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
    layer_types = _layer_types(raw, num_layers)
    if window is None:
        return ()
    if layer_types is None:  # Qwen2Config's default: sliding from max_window_layers on
        first = int(raw.get("max_window_layers", 28))
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    windows = tuple(int(window) if kind == "sliding_attention" else None for kind in layer_types)
    return windows if any(w is not None for w in windows) else ()


# --- Gemma 2 and Gemma 3 (text), as transformers' modeling_gemma2.py / modeling_gemma3.py read their configs ---

def _gemma_activation(raw: Raw, model_type: str) -> Activation:
    # Gemma's MLP reads hidden_activation (default gelu_pytorch_tanh); the hidden_act old hub configs also carry
    # is never read by transformers' Gemma 2 / 3, nor here.
    act = raw.get("hidden_activation", Activation.GELU_TANH.value)
    if act != Activation.GELU_TANH.value:
        raise ValueError(f"hidden_activation {act!r} is not supported ({model_type}): Tandem's Gemma MLP implements "
                         f"gelu_pytorch_tanh only")
    return Activation.GELU_TANH


def _softcap(raw: Raw, name: str, default: float | None) -> float | None:
    cap = raw.get(name, default)
    if cap is not None and float(cap) <= 0:
        raise ValueError(f"{name} must be > 0 (or null), got {cap}")
    return None if cap is None else float(cap)


def _gemma_layer(raw: Raw, model_type: str) -> ArchOptions:
    """What Gemma 2 and Gemma 3 share: (1 + w) RMSNorms around both halves of the layer, embeddings times
    sqrt(hidden_size), attention scaled by query_pre_attn_scalar ** -0.5, attention_bias on q, k, v and o."""
    if raw.get("use_bidirectional_attention"):
        raise ValueError(f"use_bidirectional_attention is not supported ({model_type}): Tandem's attention is causal")
    bias = bool(raw.get("attention_bias", False))
    return ArchOptions(qkv_bias=bias, o_bias=bias, unit_offset_norms=True, sandwich_norms=True,
                       embed_scale=float(raw["hidden_size"]) ** 0.5,
                       query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)))


def _gemma2_options(raw: Raw) -> ArchOptions:
    # Gemma2Config's defaults: both soft-caps on (attention 50, logits 30) where the file leaves them out.
    return replace(_gemma_layer(raw, "gemma2"),
                   attn_logit_softcapping=_softcap(raw, "attn_logit_softcapping", 50.0),
                   final_logit_softcapping=_softcap(raw, "final_logit_softcapping", 30.0))


def _gemma3_rope(raw: Raw) -> tuple[Raw, Raw]:
    """(global, local) RoPE parameters as Gemma3TextConfig.convert_rope_params_to_dict builds them: transformers 5's
    ``rope_parameters`` keyed by layer type, or the hub's ``rope_theta`` and ``rope_scaling`` (global layers) and
    ``rope_local_base_freq`` (sliding layers); bases 1e6 and 1e4 where absent."""
    params: Raw = raw.get("rope_parameters") or {}
    other = sorted(set(params) - {"full_attention", "sliding_attention"})
    if other:
        raise ValueError(f"rope_parameters keys {other} are not supported (gemma3_text): Gemma 3 keys them by layer "
                         f"type (full_attention, sliding_attention)")
    full = dict(params.get("full_attention") or {"rope_type": "default"})
    local = dict(params.get("sliding_attention") or {"rope_type": "default"})
    scaling = raw.get("rope_scaling")
    if scaling:
        full.update(scaling)
    full.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", raw.get("rope_local_base_freq", 10_000.0))
    return full, local


def _gemma3_options(raw: Raw) -> ArchOptions:
    # Gemma 3 adds q/k norms ((1 + w) like every Gemma norm), a rotary of its own for the sliding layers, and
    # keeps only the final soft-cap (default off). Its attention never passes attn_logit_softcapping on
    # (Gemma3Attention calls the attention function without softcap), so neither does Tandem.
    global_rope, local_rope = _gemma3_rope(raw)
    return replace(_gemma_layer(raw, "gemma3_text"), qk_norm=True,
                   final_logit_softcapping=_softcap(raw, "final_logit_softcapping", None),
                   rope=global_rope, sliding_rope=local_rope)


def _gemma3_text_config(raw: Raw) -> Raw:
    """Gemma 3's image-and-text checkpoints (4B, 12B, 27B; ``Gemma3ForConditionalGeneration``): the language model's
    config is ``text_config``. Tying is the top level's ``tie_word_embeddings`` (default true), as
    Gemma3ForConditionalGeneration ties its head (text_config's own is not read); token ids at the top level win."""
    text = raw.get("text_config")
    if not isinstance(text, Mapping):
        raise ValueError("text_config is missing (gemma3): the image-and-text config keeps its language model there")
    top = {k: raw[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in raw}
    return {**text, **top, "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True))}


def _gemma_windows(pattern_field: str | None) -> Callable[[Raw], Windows]:
    """Gemma's interleaved local and global layers: ``layer_types`` when given, else every ``pattern``-th layer
    global, the others sliding (Gemma 2: every 2nd; Gemma 3: ``sliding_window_pattern``, default 6); the window
    ``sliding_window`` (default 4096) on the sliding ones."""
    def windows(raw: Raw) -> Windows:
        num_layers = int(raw["num_hidden_layers"])
        layer_types = _layer_types(raw, num_layers)
        if layer_types is None:
            pattern = 2 if pattern_field is None else int(raw.get(pattern_field, raw.get(f"_{pattern_field}", 6)))
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        window = raw.get("sliding_window", 4096)
        if window is None and "sliding_attention" in layer_types:
            raise ValueError("sliding_window is null but layer_types has sliding_attention layers")
        out = tuple(None if kind == "full_attention" else int(window) for kind in layer_types)
        return out if any(w is not None for w in out) else ()
    return windows


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
    # Mixtral: Mistral's attention (a window on every layer when set) with routed experts in every layer.
    Family("mixtral", "MixtralForCausalLM", _mixtral_options, rms_norm_eps=1e-5, layer_windows=_mistral_windows,
           experts=MIXTRAL_EXPERTS, rope_theta=1e6),
    # Qwen3-MoE: Qwen3's attention (q/k norms; a window on every layer with use_sliding_window), routed experts
    # except in mlp_only_layers. Qwen3MoeConfig has no head_dim of its own (Qwen3Config's is 128): where the file
    # has none, hidden / heads.
    Family("qwen3_moe", "Qwen3MoeForCausalLM", _qwen3_moe_options, layer_windows=_qwen3_moe_windows,
           experts=QWEN_EXPERTS),
    # gpt-oss: attention sinks, alternating sliding (128) and full layers, YaRN rope, biased routed experts with
    # a clamped SwiGLU (why gpt-oss rather than DeepSeek-V3: docs/models.md).
    Family("gpt_oss", "GptOssForCausalLM", _gpt_oss_options, rms_norm_eps=1e-5, head_dim=64,
           layer_windows=_layer_type_windows, experts=GPT_OSS_EXPERTS, rope_theta=150000.0,
           rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096}),
    # Gemma 2 / Gemma 3 text: the Llama checkpoint layout plus the sandwich norms (and Gemma 3's q/k norms) under
    # the model's own names; tied heads and head_dim 256 by default.
    Family("gemma2", "Gemma2ForCausalLM", _gemma2_options, head_dim=256, layer_windows=_gemma_windows(None),
           activation=_gemma_activation, tie_word_embeddings=True),
    Family("gemma3_text", "Gemma3ForCausalLM", _gemma3_options, head_dim=256,
           layer_windows=_gemma_windows("sliding_window_pattern"), activation=_gemma_activation,
           tie_word_embeddings=True),
    # Gemma 3's image-and-text checkpoints served as text: the language model read from text_config and from the
    # checkpoint's language_model.* tensors (the layout transformers saves and the hub has), the vision tower and
    # the projector left unread. Prompts are text: no image is ever embedded.
    Family("gemma3", "Gemma3ForConditionalGeneration", _gemma3_options, head_dim=256,
           layer_windows=_gemma_windows("sliding_window_pattern"), activation=_gemma_activation,
           tie_word_embeddings=True, text_view=_gemma3_text_config,
           weight_prefixes={"language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
                            "vision_tower.": None, "multi_modal_projector.": None}),
)}

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def family(model_type: str) -> Family:
    """The family of ``model_type``, or a ``ValueError`` naming the field and the supported ones."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}") from None

"""Model architecture read from a Hugging Face ``config.json``, as frozen dataclasses.

The families and what each turns on live in one registry (common/model/families.py): Llama (1/2/3, including
Llama-3 rope scaling), Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norms), Phi-3, Mixtral, Qwen3-MoE (routed
experts), Gemma 2 and Gemma 3 text. This module reads the fields they share. Both transformers layouts of RoPE
settings are read: the old top-level ``rope_theta`` / ``rope_scaling`` and transformers 5's ``rope_parameters``.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.model.families import SUPPORTED_MODEL_TYPES, Activation, MoEOptions, family

log = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``default`` leaves frequencies alone."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    # llama3, yarn and longrope; dynamic: the config's max_position_embeddings
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0  # yarn: the correction range's bounds, in rotations
    beta_slow: float = 1.0
    truncate: bool = True  # yarn: round the correction range to whole dimensions
    # yarn and longrope: the factor cos and sin are multiplied by (None: yarn's 0.1 ln(factor) + 1, transformers'
    # default; longrope's is always set when read, _scaling)
    attention_factor: float | None = None
    # longrope (Phi-3's 128k checkpoints): each frequency divided by its short factor, one per pair of head dims.
    # transformers switches every position to long_factor once a forward's sequence passes
    # original_max_position_embeddings; Tandem implements the short factors only and serves such a model up to
    # that length (ModelConfig.from_dict caps max_position_embeddings there; RotaryEmbedding refuses beyond it).
    short_factor: tuple[float, ...] = ()
    # dynamic (NTK): transformers' rotary is the unscaled one up to max_position_embeddings and only past it raises
    # the base for every position (a sequence-length-dependent rotary no KV cache can follow); Tandem serves such a
    # model up to max_position_embeddings, where it is the default rotary, and RotaryEmbedding refuses beyond.

    @property
    def served_positions(self) -> int | None:
        """The positions this rotary holds as transformers computes it (None: every one)."""
        return self.original_max_position_embeddings if self.rope_type in ("longrope", "dynamic") else None

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling.rope_type {self.rope_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.rope_type == "longrope" and not self.short_factor:
            raise ValueError("rope_scaling.rope_type 'longrope' needs rope_scaling.short_factor (a list of numbers)")

    @property
    def cos_sin_factor(self) -> float:
        """What cos and sin are multiplied by (yarn's attention factor; 1 otherwise)."""
        if self.rope_type not in ("yarn", "longrope"):
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0

    def scale_inv_freq(self, inv_freq: list[float], theta: float = 10000.0) -> list[float]:
        """Apply the scaling to RoPE inverse frequencies (one per pair of head dims; ``theta``: their base)."""
        if self.rope_type in ("default", "dynamic"):  # dynamic: unscaled within served_positions
            return inv_freq
        if self.rope_type == "linear":
            return [f / self.factor for f in inv_freq]
        if self.rope_type == "yarn":
            return self._yarn(inv_freq, theta)
        if self.rope_type == "longrope":
            if len(self.short_factor) != len(inv_freq):
                raise ValueError(f"rope_scaling.short_factor has {len(self.short_factor)} entries; longrope needs one "
                                 f"per pair of head dims ({len(inv_freq)})")
            return [f / s for f, s in zip(inv_freq, self.short_factor, strict=True)]
        # llama3: long wavelengths are divided by `factor`, short ones kept, a smooth ramp between.
        low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
        high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
        out: list[float] = []
        for f in inv_freq:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / self.factor)
            else:
                smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
                    self.high_freq_factor - self.low_freq_factor
                )
                out.append((1 - smooth) * f / self.factor + smooth * f)
        return out

    def _yarn(self, inv_freq: list[float], theta: float) -> list[float]:
        """transformers' ``_compute_yarn_parameters``: interpolated (f / factor) below the correction range's
        low dimension, extrapolated (f) above its high one, a linear ramp between."""
        dim = 2 * len(inv_freq)
        original = self.original_max_position_embeddings

        def correction_dim(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        out: list[float] = []
        for i, f in enumerate(inv_freq):
            ramp = min(max((i - low) / (high - low), 0.0), 1.0)
            extrapolation = 1 - ramp
            out.append(f / self.factor * (1 - extrapolation) + f * extrapolation)
        return out


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a decoder-only model of one of the families (common/model/families.py)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    # the longest sequence served: config.json's (longrope: at most its original_max_position_embeddings)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over head_dim of each q and k head, before rotary (Qwen3)
    attention_sinks: bool = False  # a learned logit per query head in every softmax's denominator (gpt-oss)
    # Per layer, its sliding attention window (None: the whole sequence); () when no layer has one. A token at
    # position p attends to positions p - window + 1 .. p (transformers' mask), on every attention backend.
    layer_windows: tuple[int | None, ...] = ()
    moe: MoEOptions | None = None  # routed experts and the layers that have them (None: every MLP dense)
    activation: Activation = Activation.SILU  # the gated MLP's: SiLU, or GELU-tanh (Gemma)
    # Gemma 2 / 3 (common/model/families.py's ArchOptions says what each does): (1 + weight) RMSNorms in fp32,
    # sandwich norms, scaled embeddings, query_pre_attn_scalar, attention and final logit soft-caps.
    unit_offset_norms: bool = False
    sandwich_norms: bool = False
    embed_scale: float | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # The sliding layers' own rotary (Gemma 3's local base); None: they share rope_theta / rope_scaling.
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: RopeScaling = RopeScaling()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                      "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be > 0, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        for scaling in (self.rope_scaling, self.sliding_rope_scaling):
            if scaling.rope_type == "longrope" and len(scaling.short_factor) != self.head_dim // 2:
                raise ValueError(f"rope_scaling.short_factor has {len(scaling.short_factor)} entries; longrope needs "
                                 f"head_dim / 2 = {self.head_dim // 2}")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers")
        if self.moe is not None and len(self.moe.layers) != self.num_layers:
            raise ValueError(f"the MoE layer pattern has {len(self.moe.layers)} entries for {self.num_layers} layers")
        if any(w is not None and w < 1 for w in self.layer_windows):
            raise ValueError(f"sliding_window must be >= 1, got {self.layer_windows}")
        for field in ("embed_scale", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, field)
            if value is not None and value <= 0:
                raise ValueError(f"{field} must be > 0, got {value}")

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx``'s MLP is routed experts (else the dense MLP of ``intermediate_size``)."""
        return self.moe is not None and self.moe.layers[layer_idx]

    def layer_window(self, layer_idx: int) -> int | None:
        """The sliding attention window of layer ``layer_idx`` (None: it attends to the whole sequence)."""
        return self.layer_windows[layer_idx] if self.layer_windows else None

    def layer_rope(self, layer_idx: int) -> tuple[float, RopeScaling]:
        """(theta, scaling) of layer ``layer_idx``'s rotary: a sliding layer's own where the family has one."""
        if self.sliding_rope_theta is not None and self.layer_window(layer_idx) is not None:
            return self.sliding_rope_theta, self.sliding_rope_scaling
        return self.rope_theta, self.rope_scaling

    @property
    def attention_scale(self) -> float:
        """Softmax scale of the attention scores: query_pre_attn_scalar ** -0.5 (Gemma), else head_dim ** -0.5."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @staticmethod
    def from_dict(raw: dict[str, Any], name: str = "") -> ModelConfig:
        """The fields every family shares, read here; the family's options and refusals (common/model/families.py)."""
        model_type = raw.get("model_type", "")
        fam = family(model_type)
        raw = dict(fam.text_view(raw))  # the language model's fields (Gemma 3's text_config), model_type kept above
        options = fam.read(raw)
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        rope_theta, rope_scaling = (_read_rope(raw, fam.rope_theta, fam.rope_scaling) if options.rope is None
                                    else _rope_of(options.rope, raw))
        sliding_rope = None if options.sliding_rope is None else _rope_of(options.sliding_rope, raw)
        # longrope: served up to its pretraining length, where transformers' short factors hold (RopeScaling)
        config_positions = int(raw.get("max_position_embeddings", 2048))
        scalings = (rope_scaling,) if sliding_rope is None else (rope_scaling, sliding_rope[1])
        max_positions = min([config_positions, *(s.served_positions for s in scalings if s.served_positions)])
        if max_positions < config_positions:
            log.warning("%s: longrope is served up to original_max_position_embeddings = %d positions, not the "
                        "config's max_position_embeddings %s (past it transformers switches to the long factors, "
                        "which Tandem does not implement)", name or model_type, max_positions,
                        raw.get("max_position_embeddings"))
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return ModelConfig(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            # a null head_dim is hidden / heads wherever transformers runs it; absent, the family's default
            head_dim=int(raw.get("head_dim") or ("head_dim" not in raw and fam.head_dim) or hidden // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", fam.rms_norm_eps)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", fam.tie_word_embeddings)),
            qkv_bias=options.qkv_bias,
            o_bias=options.o_bias,
            mlp_bias=options.mlp_bias,
            qk_norm=options.qk_norm,
            attention_sinks=options.attention_sinks,
            layer_windows=options.layer_windows,
            moe=options.moe,
            activation=options.activation,
            unit_offset_norms=options.unit_offset_norms,
            sandwich_norms=options.sandwich_norms,
            embed_scale=options.embed_scale,
            query_pre_attn_scalar=options.query_pre_attn_scalar,
            attn_logit_softcapping=options.attn_logit_softcapping,
            final_logit_softcapping=options.final_logit_softcapping,
            sliding_rope_theta=None if sliding_rope is None else sliding_rope[0],
            sliding_rope_scaling=RopeScaling() if sliding_rope is None else sliding_rope[1],
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )

    @staticmethod
    def from_pretrained(model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model directory {model_dir} has no config.json")
        return ModelConfig.from_dict(json.loads(path.read_text()), name=Path(model_dir).name)


def _read_rope(raw: dict[str, Any], default_theta: float, default_scaling: Mapping[str, Any] | None,
               ) -> tuple[float, RopeScaling]:
    """RoPE theta and scaling from either transformers layout; the family's defaults where the file has none."""
    params = raw.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", default_theta)))
    return theta, _scaling(raw.get("rope_scaling") or params or default_scaling or {}, raw)


def _rope_of(params: Mapping[str, Any], raw: Mapping[str, Any]) -> tuple[float, RopeScaling]:
    """RoPE theta and scaling of one parameter dict a family picked (rope_type, rope_theta, factor ...)."""
    return float(params["rope_theta"]), _scaling(params, raw)


def _scaling(scaling_raw: Mapping[str, Any], raw: Mapping[str, Any]) -> RopeScaling:
    """One RoPE parameter dict as transformers' standardize_rope_params and ROPE_INIT_FUNCTIONS read it; ``raw``: the
    config (its max_position_embeddings is the pretraining length where the dict has none)."""
    rope_type = scaling_raw.get("rope_type", scaling_raw.get("type", "default")) if scaling_raw else "default"
    if rope_type == "default":
        return RopeScaling()
    max_positions = int(raw.get("max_position_embeddings", 2048))
    original = int(scaling_raw.get("original_max_position_embeddings") or max_positions)
    if rope_type == "longrope":
        return _longrope(scaling_raw, max_positions, original)
    if rope_type == "dynamic":
        return RopeScaling(rope_type="dynamic", factor=float(scaling_raw.get("factor", 1.0)),
                           original_max_position_embeddings=max_positions)
    if rope_type == "yarn":
        for name in ("mscale", "mscale_all_dim"):  # DeepSeek's variant of the attention factor
            if scaling_raw.get(name) and scaling_raw.get("attention_factor") is None:
                raise ValueError(f"rope_scaling.{name} is not supported (yarn's attention factor from mscale)")
        if scaling_raw.get("factor") is None:
            raise ValueError("rope_scaling.factor is required for yarn")
    attention_factor = scaling_raw.get("attention_factor")
    return RopeScaling(
        rope_type=rope_type,
        factor=float(scaling_raw.get("factor", 1.0)),
        low_freq_factor=float(scaling_raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling_raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        beta_fast=float(scaling_raw.get("beta_fast") or 32.0),
        beta_slow=float(scaling_raw.get("beta_slow") or 1.0),
        truncate=bool(scaling_raw.get("truncate", True)),
        attention_factor=None if attention_factor is None else float(attention_factor),
    )


def _longrope(scaling_raw: Mapping[str, Any], max_positions: int, original: int) -> RopeScaling:
    """transformers' ``_compute_longrope_parameters`` below original_max_position_embeddings: the short factors, and
    cos / sin times attention_factor (default sqrt(1 + ln(factor) / ln(original)), factor defaulting to
    max_position_embeddings / original)."""
    short = scaling_raw.get("short_factor")
    if not isinstance(short, list | tuple) or not short:
        raise ValueError("rope_scaling.rope_type 'longrope' needs rope_scaling.short_factor (a list of numbers)")
    factor = float(scaling_raw.get("factor") or max_positions / original)
    attention_factor = scaling_raw.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(rope_type="longrope", factor=factor, original_max_position_embeddings=original,
                       attention_factor=float(attention_factor), short_factor=tuple(float(f) for f in short))

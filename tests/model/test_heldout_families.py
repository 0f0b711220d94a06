"""Held-out configs of every family (issue 36's acceptance check, done here first): shapes and options the
family tests do not use, greedy fp32 tokens from Tandem equal to transformers' (offline ``LLM`` for all, twice,
the second time through the prefix cache; ``tandem generate`` for a subset; mixtures of experts through the served
system and the ``tandem up`` command), and what Tandem cannot honour refused at load naming the field.

The sweep: MQA (one KV head) and GQA 3:1 / 4:1 / 6:1, ``head_dim`` decoupled from hidden / heads (or absent: the
family's default), tied and untied heads, odd layer counts, windows shorter than the prompts, the RoPE scalings the
families' real checkpoints use (Llama 3's ``llama3``, ``linear``, ``dynamic``, Qwen's ``yarn``, Phi-3's
``longrope``, Gemma 3's ``linear`` on the global layers with its local base, gpt-oss's YaRN), Qwen3-MoE with dense
layers from ``mlp_only_layers`` and ``decoder_sparse_step`` together, top-1 / 2 / 3 / 4 routing, ``norm_topk_prob``
both ways. Some configs are rewritten into the hub's older layout (top-level ``rope_theta`` / ``rope_scaling``,
no ``layer_types``, Gemma 3's ``rope_local_base_freq`` and ``sliding_window_pattern``, no RoPE fields at all), which
transformers and Tandem must both read the same way; the rotary tables are compared with transformers' where the
greedy tokens at these lengths would not see a frequency wrong.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest
import torch

from tests.model.test_families import _hf, _with_tokenizer, generate_cli

if TYPE_CHECKING:
    from common.model.llama import LlamaDecoderLayer

TOKENS = 10
# every window below is shorter than the longer prompts; the longest spans two full KV blocks (16 tokens), which the
# second round reads from the prefix cache; prompt + TOKENS stay within the 64 positions longrope / dynamic serve here
PROMPT_LENGTHS = (5, 14, 37)

_MQA = {"num_attention_heads": 4, "num_key_value_heads": 1}
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}

# name -> (model_type, overrides of tests/conftest.py's tiny config: hidden 64, 2 layers, vocab 128)
HELDOUT: dict[str, tuple[str, dict[str, Any]]] = {
    # --- Llama ---
    "llama-mqa-tied-llama3-rope": ("llama", {
        **_MQA, "hidden_size": 48, "head_dim": 20, "num_hidden_layers": 3, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    "llama-gqa3-biases-linear-rope": ("llama", {
        "num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 48, "head_dim": 16, "num_hidden_layers": 1,
        "attention_bias": True, "mlp_bias": True,
        "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0}}),
    "llama-gqa4-large-eps-untied": ("llama", {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
                                              "num_hidden_layers": 3, "rms_norm_eps": 0.5}),
    "llama-yarn-betas-attention-factor": ("llama", {
        "num_hidden_layers": 1, "head_dim": 24, "max_position_embeddings": 512,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 20000.0, "factor": 8.0, "beta_fast": 16.0,
                            "beta_slow": 2.0, "attention_factor": 1.2, "truncate": False,
                            "original_max_position_embeddings": 64}}),
    # dynamic NTK: the default rotary within max_position_embeddings (64 here, past the longest sequence below)
    "llama-dynamic-ntk-gqa2": ("llama", {"num_hidden_layers": 3, "max_position_embeddings": 64, "rope_parameters": {
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}}),
    # --- Mistral ---
    "mistral-mqa-window3-5layers-tied": ("mistral", {**_MQA, "head_dim": 24, "num_hidden_layers": 5,
                                                     "sliding_window": 3, "tie_word_embeddings": True}),
    "mistral-gqa4-no-window-theta1e6": ("mistral", {
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8, "sliding_window": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    # --- Qwen2 (q/k/v biases always) ---
    "qwen2-mqa-window4-from-layer2-of-5": ("qwen2", {**_MQA, "num_hidden_layers": 5, "use_sliding_window": True,
                                                     "sliding_window": 4, "max_window_layers": 2,
                                                     "tie_word_embeddings": True}),
    "qwen2-gqa3-yarn-layer-types": ("qwen2", {
        "num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 48, "num_hidden_layers": 3,
        "use_sliding_window": True, "sliding_window": 5,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": _YARN}),
    "qwen2-decoupled-head-dim-untied": ("qwen2", {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12,
                                                  "num_hidden_layers": 3}),
    # --- Qwen3 (q/k norms, decoupled head_dim) ---
    "qwen3-mqa-yarn-3layers": ("qwen3", {**_MQA, "hidden_size": 40, "head_dim": 12, "num_hidden_layers": 3,
                                         "rope_parameters": {**_YARN, "factor": 2.0, "rope_theta": 1e6}}),
    "qwen3-gqa6-window3-max-window-layers": ("qwen3", {
        "num_attention_heads": 6, "num_key_value_heads": 1, "head_dim": 8, "num_hidden_layers": 3,
        "use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1, "tie_word_embeddings": True}),
    # --- Qwen3-MoE ---
    "qwen3moe-dense-0-3-step2-top1-normed": ("qwen3_moe", {
        **_MQA, "head_dim": 12, "num_hidden_layers": 6, "num_experts": 5, "num_experts_per_tok": 1,
        "moe_intermediate_size": 24, "intermediate_size": 40, "mlp_only_layers": [0, 3], "decoder_sparse_step": 2,
        "norm_topk_prob": True}),
    "qwen3moe-top2-unnormed-tied-step3": ("qwen3_moe", {
        "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 8, "num_hidden_layers": 4,
        "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 20, "intermediate_size": 36,
        "decoder_sparse_step": 3, "norm_topk_prob": False, "tie_word_embeddings": True}),
    "qwen3moe-top2-normed-window": ("qwen3_moe", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 3,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "norm_topk_prob": True,
        "use_sliding_window": True, "sliding_window": 4}),
    "qwen3moe-no-head-dim-top2": ("qwen3_moe", {"num_attention_heads": 8, "num_key_value_heads": 2, "num_experts": 3,
                                                "num_experts_per_tok": 2, "moe_intermediate_size": 20}),
    "qwen3moe-top4-of-4-unnormed": ("qwen3_moe", {**_MQA, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 4,
                                                   "moe_intermediate_size": 12, "norm_topk_prob": False}),
    # --- Mixtral ---
    "mixtral-top1-of-5-mqa-window4": ("mixtral", {**_MQA, "head_dim": 20, "num_hidden_layers": 3,
                                                  "num_local_experts": 5, "num_experts_per_tok": 1,
                                                  "intermediate_size": 24, "sliding_window": 4}),
    "mixtral-top2-of-3-tied-theta1e6": ("mixtral", {
        "num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 48, "num_local_experts": 3,
        "num_experts_per_tok": 2, "intermediate_size": 40, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    # --- Phi-3 (fused qkv / gate_up in the checkpoint) ---
    "phi3-mqa-window3-5layers": ("phi3", {**_MQA, "hidden_size": 48, "num_hidden_layers": 5, "sliding_window": 3}),
    "phi3-gqa3-tied-theta": ("phi3", {"num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 48,
                                      "num_hidden_layers": 3, "tie_word_embeddings": True,
                                      "rope_parameters": {"rope_type": "default", "rope_theta": 250000.0}}),
    "phi3-longrope-mqa": ("phi3", {
        **_MQA, "hidden_size": 48, "num_hidden_layers": 3, "max_position_embeddings": 256,
        "original_max_position_embeddings": 64,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                            "short_factor": [1.0, 1.3, 2.0, 3.5, 6.0, 11.0],
                            "long_factor": [1.5, 3.0, 7.0, 15.0, 30.0, 60.0]}}),
    "phi3-longrope-gqa3-attention-factor": ("phi3", {
        "sliding_window": 6,
        "num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 48, "max_position_embeddings": 512,
        "original_max_position_embeddings": 128,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 50000.0, "attention_factor": 1.4,
                            "short_factor": [1.1, 1.7, 2.9, 5.0], "long_factor": [4.0, 8.0, 16.0, 32.0]}}),
    # --- Gemma 2 ---
    "gemma2-mqa-5layers-window3-tied": ("gemma2", {
        **_MQA, "head_dim": 24, "num_hidden_layers": 5, "sliding_window": 3, "query_pre_attn_scalar": 32,
        "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}),
    "gemma2-layer-types-untied": ("gemma2", {
        "num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 48, "head_dim": 12, "num_hidden_layers": 4,
        "sliding_window": 4, "tie_word_embeddings": False,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]}),
    # --- Gemma 3 text ---
    "gemma3-pattern3-5layers-mqa": ("gemma3_text", {
        **_MQA, "head_dim": 20, "num_hidden_layers": 5, "sliding_window": 3, "sliding_window_pattern": 3,
        "query_pre_attn_scalar": 40, "final_logit_softcapping": 4.0,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}}),
    "gemma3-irregular-layer-types-untied": ("gemma3_text", {
        "num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 48, "head_dim": 12, "num_hidden_layers": 5,
        "sliding_window": 4, "tie_word_embeddings": False, "attn_logit_softcapping": 0.5,  # Gemma 3 never applies it
        "layer_types": ["sliding_attention", "full_attention", "full_attention", "sliding_attention",
                        "sliding_attention"]}),
    "gemma3-multimodal-pattern4": ("gemma3", {**_MQA, "head_dim": 16, "num_hidden_layers": 5, "sliding_window": 4,
                                              "sliding_window_pattern": 4}),
    # --- gpt-oss ---
    "gptoss-top1-mqa-window3": ("gpt_oss", {**_MQA, "head_dim": 12, "num_hidden_layers": 3, "sliding_window": 3,
                                            "num_local_experts": 5, "num_experts_per_tok": 1,
                                            "intermediate_size": 24, "max_position_embeddings": 256}),
    "gptoss-top3-layer-types-swiglu3": ("gpt_oss", {
        "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 3,
        "num_local_experts": 4, "num_experts_per_tok": 3, "intermediate_size": 16, "swiglu_limit": 3.0,
        "attention_bias": False, "swiglu_alpha": 1.2,
        "sliding_window": 4, "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
        "max_position_embeddings": 256}),
}

# Token ids inside the tiny vocabulary where the family's config defaults to its real one (Phi-3: 32000).
_TOKEN_IDS: dict[str, dict[str, Any]] = {"phi3": {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}}


def heldout_model(factory: Callable[..., Path], name: str) -> Path:
    model_type, overrides = HELDOUT[name]
    return _with_tokenizer(factory(model_type, seed=29, **_TOKEN_IDS.get(model_type, {}), **overrides))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def hf_greedy(model_dir: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt: the whole sequence through its forward at each step."""
    hf, out = _hf(model_dir), []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(n):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(prompt):])
    return out


def tandem_greedy(model_dir: Path, prompts: list[list[int]], n: int, rounds: int = 1) -> list[list[int]]:
    """The offline ``LLM``'s greedy tokens (paged KV cache, prefill then decode steps); with ``rounds`` > 1 the same
    prompts again, their full blocks from the prefix cache, asserted equal to the first round."""
    from common.engine.llm import LLM
    from common.sampling.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    with LLM(model_dir, dtype="float32", device="cpu") as llm:
        first = [c.token_ids for c in llm.generate(prompts, params)]
        for _ in range(rounds - 1):
            assert [c.token_ids for c in llm.generate(prompts, params)] == first, "prefix-cached round"
    return first


@pytest.mark.parametrize("name", sorted(HELDOUT))
def test_heldout_offline_greedy_identical_to_transformers(tiny_model_factory: Callable[..., Path], name: str) -> None:
    model_dir = heldout_model(tiny_model_factory, name)
    prompts = _prompts()
    assert tandem_greedy(model_dir, prompts, TOKENS, rounds=2) == hf_greedy(model_dir, prompts, TOKENS), name


# --- the hub's older config layout: top-level rope_theta / rope_scaling ("type", not "rope_type"), Gemma 3's
# rope_local_base_freq and sliding_window_pattern, Phi-3's "su", no layer_types (Qwen2's max_window_layers, Gemma's
# and gpt-oss's default patterns decide), Qwen3-MoE's num_experts; transformers reads these files itself, as a
# checkpoint from the hub ---

@dataclass(frozen=True)
class Hub:
    source: str  # the held-out config rewritten
    drop_rope: tuple[str, ...] = ()  # keys left out of rope_scaling
    type_key: str = "type"  # Gemma 3's files say rope_type (its config reads a "type" as the default rotary, as Tandem)
    type_name: str | None = None  # the rope type's old name
    drop: tuple[str, ...] = ("layer_types",)  # top-level keys left out
    rename: tuple[tuple[str, str], ...] = ()


def _hub_layout(config: dict[str, Any], hub: Hub) -> dict[str, Any]:
    for key in hub.drop:
        config.pop(key, None)
    for old, new in hub.rename:
        config[new] = config.pop(old)
    params = config.pop("rope_parameters", None)
    if params is None:  # dropped: the family's default rotary
        return config
    if "full_attention" in params:  # Gemma 3: keyed by layer type
        full, local = dict(params["full_attention"]), dict(params["sliding_attention"])
        config["rope_theta"], config["rope_local_base_freq"] = full.pop("rope_theta"), local["rope_theta"]
        params = full
    else:
        params = dict(params)
        config["rope_theta"] = params.pop("rope_theta")
    params.pop("partial_rotary_factor", None)
    rope_type = params.pop("rope_type")
    if rope_type != "default":
        params[hub.type_key] = hub.type_name or rope_type
        config["rope_scaling"] = {k: v for k, v in params.items() if k not in hub.drop_rope}
    return config


_NO_ORIGINAL = ("original_max_position_embeddings",)
HUB: dict[str, Hub] = {
    "llama3-rope-no-original-length": Hub("llama-mqa-tied-llama3-rope", drop_rope=_NO_ORIGINAL),
    "qwen2-yarn-max-window-layers": Hub("qwen2-mqa-window4-from-layer2-of-5"),
    "qwen2-yarn": Hub("qwen2-gqa3-yarn-layer-types", drop=()),
    "qwen3-yarn-no-original-length": Hub("qwen3-mqa-yarn-3layers", drop_rope=_NO_ORIGINAL, type_key="rope_type"),
    "qwen3-max-window-layers": Hub("qwen3-gqa6-window3-max-window-layers"),
    "qwen3moe-num-experts": Hub("qwen3moe-top2-normed-window", rename=(("num_local_experts", "num_experts"),)),
    "gemma2-default-pattern": Hub("gemma2-mqa-5layers-window3-tied"),
    "gemma3-local-base-freq-linear-pattern": Hub("gemma3-pattern3-5layers-mqa", type_key="rope_type",
                                                 drop=("layer_types", "_sliding_window_pattern")),
    "phi3-su": Hub("phi3-longrope-mqa", type_name="su"),
    "mistral-theta": Hub("mistral-gqa4-no-window-theta1e6"),
    "gptoss-yarn-default-pattern": Hub("gptoss-top1-mqa-window3", type_key="rope_type"),
    # no rope fields at all: the family's default theta (Mixtral 1e6) and rotary (gpt-oss: YaRN over theta 150 000)
    "mixtral-default-theta": Hub("mixtral-top2-of-3-tied-theta1e6", drop=("rope_parameters",)),
    "gptoss-default-rope": Hub("gptoss-top3-layer-types-swiglu3", drop=("rope_parameters",)),
}


def hub_model(factory: Callable[..., Path], name: str) -> Path:
    import shutil

    hub = HUB[name]
    model_dir = heldout_model(factory, hub.source)
    hub_dir = model_dir.with_name(f"{model_dir.name}-hub-{name}")
    if not hub_dir.exists():
        shutil.copytree(model_dir, hub_dir)
        config = json.loads((hub_dir / "config.json").read_text())
        (hub_dir / "config.json").write_text(json.dumps(_hub_layout(config, hub), indent=2))
    return hub_dir


@pytest.mark.parametrize("name", sorted(HUB))
def test_hub_layout_greedy_identical_to_transformers(tiny_model_factory: Callable[..., Path], name: str) -> None:
    model_dir = hub_model(tiny_model_factory, name)
    assert "rope_parameters" not in json.loads((model_dir / "config.json").read_text())
    prompts = _prompts()[1:]
    assert tandem_greedy(model_dir, prompts, TOKENS) == hf_greedy(model_dir, prompts, TOKENS), name


def test_hub_layout_reads_the_same_rotary(tiny_model_factory: Callable[..., Path]) -> None:
    """Where the rope dict has no original_max_position_embeddings, transformers takes max_position_embeddings."""
    from common.config.model_config import ModelConfig

    for name in ("llama3-rope-no-original-length", "qwen3-yarn-no-original-length"):
        config = ModelConfig.from_pretrained(hub_model(tiny_model_factory, name))
        assert config.rope_scaling.original_max_position_embeddings == config.max_position_embeddings == 256, name
    gemma3 = ModelConfig.from_pretrained(hub_model(tiny_model_factory, "gemma3-local-base-freq-linear-pattern"))
    assert (gemma3.rope_theta, gemma3.rope_scaling.rope_type, gemma3.rope_scaling.factor) == (1e6, "linear", 8.0)
    assert gemma3.sliding_rope_theta == 100.0
    phi3 = ModelConfig.from_pretrained(hub_model(tiny_model_factory, "phi3-su"))
    assert phi3.rope_scaling.rope_type == "longrope"
    # without layer_types: Qwen2's max_window_layers, Gemma's and gpt-oss's default patterns
    windows = {"qwen2-yarn-max-window-layers": (None, None, 4, 4, 4), "qwen3-max-window-layers": (None, 3, 3),
               "gemma2-default-pattern": (3, None, 3, None, 3), "gptoss-yarn-default-pattern": (3, None, 3),
               "gemma3-local-base-freq-linear-pattern": (3, 3, None, 3, 3), "qwen3moe-num-experts": (4, 4, 4)}
    for name, expected in windows.items():
        assert ModelConfig.from_pretrained(hub_model(tiny_model_factory, name)).layer_windows == expected, name
    assert ModelConfig.from_pretrained(hub_model(tiny_model_factory, "mixtral-default-theta")).rope_theta == 1e6
    gpt_oss = ModelConfig.from_pretrained(hub_model(tiny_model_factory, "gptoss-default-rope"))
    assert (gpt_oss.rope_theta, gpt_oss.rope_scaling.rope_type) == (150000.0, "yarn")


# Configs whose rotary is scaled or defaulted: the greedy tests above barely turn their low frequencies at 30
# positions, so the cos / sin tables are compared with transformers' own over the whole length served.
SCALED_ROTARY = ("heldout:llama-mqa-tied-llama3-rope", "heldout:llama-gqa3-biases-linear-rope",
                 "heldout:llama-yarn-betas-attention-factor", "heldout:llama-dynamic-ntk-gqa2",
                 "heldout:qwen2-gqa3-yarn-layer-types", "heldout:qwen3-mqa-yarn-3layers",
                 "heldout:gemma3-pattern3-5layers-mqa", "heldout:phi3-longrope-mqa",
                 "heldout:phi3-longrope-gqa3-attention-factor", "heldout:gptoss-top1-mqa-window3",
                 "hub:llama3-rope-no-original-length", "hub:qwen2-yarn", "hub:qwen3-yarn-no-original-length",
                 "hub:gemma3-local-base-freq-linear-pattern", "hub:phi3-su", "hub:gptoss-yarn-default-pattern",
                 "hub:gptoss-default-rope", "hub:mixtral-default-theta")


@pytest.mark.parametrize("name", SCALED_ROTARY)
def test_scaled_rotary_tables_equal_transformers(tiny_model_factory: Callable[..., Path], name: str) -> None:
    from common.model.loader import load_model

    kind, _, short = name.partition(":")
    model_dir = heldout_model(tiny_model_factory, short) if kind == "heldout" else hub_model(tiny_model_factory, short)
    ours, hf = load_model(model_dir, dtype="float32"), _hf(model_dir)
    config, half = ours.config, ours.config.head_dim // 2
    n = config.max_position_embeddings  # longrope: its original length, where transformers keeps the short factors
    x = torch.zeros(1, n, config.head_dim)
    positions = torch.arange(n)[None]
    rotary_emb = hf.model.language_model.rotary_emb if hasattr(hf.model, "language_model") else hf.model.rotary_emb
    for layer in range(config.num_layers):
        rotary = cast("LlamaDecoderLayer", ours.layers[layer]).self_attn.rotary
        table = rotary.table(torch.device("cpu"), torch.float32, n)[:n]
        with torch.no_grad():
            if config.sliding_rope_theta is None:
                cos, sin = rotary_emb(x, positions)
            else:  # Gemma 3: one rotary per layer type
                kind = "full_attention" if config.layer_window(layer) is None else "sliding_attention"
                cos, sin = rotary_emb(x, positions, kind)
        torch.testing.assert_close(table[:, :half], cos[0, :, :half], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(table[:, half:], sin[0, :, :half], atol=2e-5, rtol=1e-5)


# --- `tandem generate` on a subset: the CLI's own load, engine and detokenizer ---

CLI = ("qwen3moe-dense-0-3-step2-top1-normed", "gemma3-pattern3-5layers-mqa", "phi3-longrope-mqa",
       "mistral-mqa-window3-5layers-tied", "llama-mqa-tied-llama3-rope")


@pytest.mark.parametrize("name", CLI)
def test_heldout_through_tandem_generate(tiny_model_factory: Callable[..., Path], name: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = heldout_model(tiny_model_factory, name)
    prompt = "t17 t3 t99 t42 t8 t120 t64 t5 t77 t31 t11"
    stdout, stderr, expected = generate_cli(model_dir, prompt, TOKENS, capsys)
    assert stdout == prompt + expected + "\n"
    assert f"[{TOKENS} tokens" in stderr


# --- longrope past its pretraining length, and what is refused at load naming the field ---

def test_longrope_is_served_up_to_its_original_length(tiny_model_factory: Callable[..., Path]) -> None:
    """transformers switches every position to long_factor past original_max_position_embeddings (64 here); Tandem
    implements the short factors, so it serves such a model up to 64 tokens and refuses a position beyond."""
    from common.config.model_config import ModelConfig
    from common.model.layers import RotaryEmbedding

    config = ModelConfig.from_pretrained(heldout_model(tiny_model_factory, "phi3-longrope-mqa"))
    assert config.max_position_embeddings == 64 and config.rope_scaling.short_factor[:2] == (1.0, 1.3)
    assert config.rope_scaling.cos_sin_factor == pytest.approx((1 + torch.log(torch.tensor(4.0)).item()
                                                                / torch.log(torch.tensor(64.0)).item()) ** 0.5)
    rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.max_position_embeddings, config.rope_scaling)
    q = torch.zeros(1, 1, config.head_dim)
    rotary(torch.tensor([63]), q, q)
    with pytest.raises(ValueError, match=r"position 64 is past the 64 positions Tandem serves with rope_scaling."
                                         r"rope_type 'longrope'"):
        rotary(torch.tensor([64]), q, q)
    dynamic = ModelConfig.from_pretrained(heldout_model(tiny_model_factory, "llama-dynamic-ntk-gqa2"))
    assert dynamic.rope_scaling.served_positions == dynamic.max_position_embeddings == 64


# model_type, overrides (a real checkpoint saved by transformers), what the refusal names
REFUSED: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama-proportional-rope": ("llama", {"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4,
                                                              "factor": 2.0}},
                                r"rope_scaling.rope_type 'proportional' is not supported"),
    "qwen2-gelu": ("qwen2", {"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported \(qwen2\)"),
    "mixtral-relu": ("mixtral", {"hidden_act": "relu", "num_local_experts": 3, "num_experts_per_tok": 1,
                                 "intermediate_size": 16}, r"hidden_act 'relu' is not supported \(mixtral\)"),
    "gemma3-gelu-exact": ("gemma3_text", {"hidden_activation": "gelu", "head_dim": 16},
                          r"hidden_activation 'gelu' is not supported \(gemma3_text\)"),
    "phi3-partial-rotary": ("phi3", {**_TOKEN_IDS["phi3"], "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}, r"partial_rotary_factor 0\.5"),
    "qwen3-yarn-mscale": ("qwen3", {"head_dim": 16, "rope_parameters": {
        **_YARN, "mscale": 0.7, "mscale_all_dim": 0.7}}, r"rope_scaling.mscale is not supported"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_tandem_cannot_honour_is_refused_at_load(tiny_model_factory: Callable[..., Path], name: str) -> None:
    from common.model.loader import load_model

    model_type, overrides, needle = REFUSED[name]
    with pytest.raises(ValueError, match=needle):
        load_model(tiny_model_factory(model_type, seed=29, **overrides), dtype="float32")


# --- a held-out mixture of experts served as `tandem up` serves it (its Launcher and Topology): one prefill and one
# decode node as real processes, the prompt's KV crossing from one to the other ---

@pytest.mark.e2e
@pytest.mark.parametrize("name", ["qwen3moe-dense-0-3-step2-top1-normed", "qwen3moe-top2-normed-window",
                                  "mixtral-top1-of-5-mqa-window4"])
def test_heldout_moe_through_the_served_system(tiny_model_factory: Callable[..., Path], tmp_path: Path,
                                               name: str) -> None:
    from tests.e2e.test_disaggregated import deployment, generate, request, wait_all_blocks_free

    model_dir = heldout_model(tiny_model_factory, name)
    prompts = _prompts()
    expected = hf_greedy(model_dir, prompts, TOKENS)
    with deployment(model_dir, tmp_path, prefill=1, decode=1) as launcher:
        assert [generate(launcher.gateway.target, request(p, TOKENS))[0] for p in prompts] == expected
        wait_all_blocks_free(launcher)


@pytest.mark.e2e
def test_heldout_moe_through_tandem_up(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    """The `tandem up` command itself, as a user starts it (a process; SIGTERM stops it and its services)."""
    import signal
    import subprocess
    import sys

    from common.serving.port_reservation import reserve_ports
    from tests.e2e.test_disaggregated import generate, request

    model_dir = heldout_model(tiny_model_factory, "qwen3moe-no-head-dim-top2")
    prompts = _prompts()
    expected = hf_greedy(model_dir, prompts, TOKENS)
    port = reserve_ports(1)[0]
    up = subprocess.Popen([sys.executable, "-m", "tandem_cli.cli", "up", "--model", str(model_dir), "--dtype",
                           "float32", "--port", str(port), "--http-port", "0", "--log-dir", str(tmp_path)],
                          stderr=subprocess.PIPE, text=True)
    try:
        assert up.stderr is not None
        said = [up.stderr.readline()]  # what it says up to "Tandem is up" (or its exit: an empty line)
        while said[-1] and "Tandem is up" not in said[-1]:
            said.append(up.stderr.readline())
        assert "Tandem is up" in said[-1], "".join(said)
        assert [generate(f"127.0.0.1:{port}", request(p, TOKENS))[0] for p in prompts] == expected
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)

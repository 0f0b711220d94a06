"""Gemma 2 and Gemma 3 text (issue 36) on the one forward: (1 + weight) RMSNorms in fp32, sandwich norms,
embeddings times sqrt(hidden_size), GELU-tanh, query_pre_attn_scalar, interleaved sliding and global layers
(Gemma 3's local rotary base, its rope scaling on the global layers), Gemma 3's q/k norms, Gemma 2's attention
soft-cap and the final logit soft-cap. Random-weight configs saved by transformers (tests/conftest.py): GQA 2:1,
4:1 and MHA, tied and untied heads, biases on and off, windows shorter than the prompts, soft-caps strong, default
and off. Logits and greedy fp32 tokens equal transformers' offline (eager and C++ fused ops, chunked prefill, the
prefix cache) and through ``tandem generate``, for Gemma 3's image-and-text checkpoint (served as text) too;
what Tandem cannot honour is refused naming the field."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from common.attention.metadata import AttentionMetadata
from common.config.engine_config import CacheConfig, SchedulerConfig
from common.config.model_config import ModelConfig
from common.model.loader import load_model
from tests.model.test_families import BASE, _hf, _hf_greedy, _with_tokenizer, generate_cli

TOKENS = 12
_SHAPE = {"num_attention_heads": 4, "head_dim": 16}
# name -> (model_type, overrides of the tiny config: hidden 64, vocab 128)
GEMMA: dict[str, tuple[str, dict[str, Any]]] = {
    # Gemma2Config's own pattern (sliding, full, sliding), its default caps (attention 50, logits 30), tied
    "gemma2-gqa2-window5": ("gemma2", {**_SHAPE, "num_key_value_heads": 2, "num_hidden_layers": 3,
                                       "sliding_window": 5, "query_pre_attn_scalar": 16}),
    # caps small enough to bite on these random weights; untied, 4:1, head_dim apart from hidden / heads
    "gemma2-gqa4-untied-strong-caps": ("gemma2", {"num_attention_heads": 4, "num_key_value_heads": 1,
                                                  "head_dim": 32, "tie_word_embeddings": False,
                                                  "sliding_window": 6, "attn_logit_softcapping": 0.01,
                                                  "final_logit_softcapping": 1.0}),
    # hidden 48 (embeddings times sqrt(48)) beside 4 x 16 attention, q/k/v/o biases
    "gemma2-mha-no-caps": ("gemma2", {**_SHAPE, "num_key_value_heads": 4, "sliding_window": 4, "hidden_size": 48,
                                      "attention_bias": True, "attn_logit_softcapping": None,
                                      "final_logit_softcapping": None}),
    # Gemma 3: every 2nd layer global (sliding_window_pattern), local base 1e4 vs global 1e6
    "gemma3-gqa2-pattern2": ("gemma3_text", {**_SHAPE, "num_key_value_heads": 2, "num_hidden_layers": 4,
                                             "sliding_window": 5, "sliding_window_pattern": 2,
                                             "query_pre_attn_scalar": 24}),
    # layer_types given, linear scaling on the global layers, a local base of its own, the final cap, untied,
    # q/k/v/o biases
    "gemma3-mha-untied-rope-cap": ("gemma3_text", {
        **_SHAPE, "num_key_value_heads": 4, "num_hidden_layers": 3, "sliding_window": 4,
        "tie_word_embeddings": False, "final_logit_softcapping": 0.5, "attention_bias": True,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}}),
    # Gemma 3's image-and-text model (Gemma3ForConditionalGeneration) served as text: its text_config and its
    # language_model.* tensors, the vision tower unread; linear scaling on the global layers as the 4B+ have
    "gemma3-multimodal-text": ("gemma3", {**_SHAPE, "num_key_value_heads": 2, "num_hidden_layers": 4,
                                          "sliding_window": 5, "sliding_window_pattern": 2,
                                          "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                                 "rope_theta": 1e6},
                                                              "sliding_attention": {"rope_type": "default",
                                                                                    "rope_theta": 1e4}}}),
}


def _gemma(factory: Callable[..., Path], name: str, **extra: Any) -> Path:
    model_type, overrides = GEMMA[name]
    # Gemma's token ids (pad 0, eos 1, bos 2) are inside the tiny vocabulary already.
    return _with_tokenizer(factory(model_type, seed=11, **{**overrides, **extra}))


def _ragged_logits(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(Tandem's, transformers') logits of a ragged batch of prompts longer than the windows."""
    model = load_model(model_dir, dtype="float32")
    lengths = [5, 1, 17, 23]
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in lengths]
    meta = AttentionMetadata.build(lengths, [0] * len(lengths))
    with torch.no_grad():
        logits = model.compute_logits(model(torch.tensor([t for s in seqs for t in s]),
                                            torch.cat([torch.arange(n) for n in lengths]), meta))
        expected = torch.cat([_hf(model_dir)(torch.tensor([s])).logits[0] for s in seqs])
    return logits, expected


@pytest.mark.parametrize("fused", ["on", "off"])
@pytest.mark.parametrize("name", sorted(GEMMA))
def test_gemma_ragged_batch_logits_match_transformers(tiny_model_factory: Callable[..., Path], name: str,
                                                      fused: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_FUSED_OPS", fused)
    logits, expected = _ragged_logits(_gemma(tiny_model_factory, name))
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_the_soft_caps_and_the_local_rotary_are_read(tiny_model_factory: Callable[..., Path]) -> None:
    """transformers' own logits change without them, so the identity above says Tandem applies them."""
    cases = [("gemma2-gqa4-untied-strong-caps", {"attn_logit_softcapping": None}),
             ("gemma2-gqa4-untied-strong-caps", {"final_logit_softcapping": None}),
             ("gemma3-mha-untied-rope-cap", {"final_logit_softcapping": None})]
    for name, change in cases:
        _, capped = _ragged_logits(_gemma(tiny_model_factory, name))
        _, uncapped = _ragged_logits(_gemma(tiny_model_factory, name, **change))
        assert (capped - uncapped).abs().max() > 1e-3, (name, change)
    config = ModelConfig.from_pretrained(_gemma(tiny_model_factory, "gemma3-mha-untied-rope-cap"))
    assert config.layer_rope(0) == (500.0, config.sliding_rope_scaling)
    assert config.layer_rope(1)[0] == 100000.0 and config.layer_rope(1)[1].rope_type == "linear"


def _greedy_runs(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy completions through the offline LLM, twice (the second from the prefix cache), in 4-token blocks
    and 3-token prefill chunks."""
    from common.engine.llm import LLM
    from common.sampling.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    with LLM(model_dir, dtype="float32", device="cpu", cache=CacheConfig(block_size=4, num_blocks=256),
             scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_prefill_chunk=3)) as llm:
        assert llm.model.decode_step is None  # the one-call C++ step has no Gemma layer
        first = [c.token_ids for c in llm.generate(prompts, params)]
        second = [c.token_ids for c in llm.generate(prompts, params)]
        assert llm.engine.kv.prefix_cache_hits > 0
    assert first == second
    return first


@pytest.mark.parametrize("fused", ["on", "off"])
@pytest.mark.parametrize("name", sorted(GEMMA))
def test_gemma_offline_greedy_identical_to_transformers(tiny_model_factory: Callable[..., Path], name: str,
                                                        fused: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_FUSED_OPS", fused)
    model_dir = _gemma(tiny_model_factory, name)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (4, 11, 19)]
    for prompt, completion in zip(prompts, _greedy_runs(model_dir, prompts), strict=True):
        assert completion == _hf_greedy(model_dir, prompt, TOKENS), name


@pytest.mark.parametrize("name", ["gemma2-gqa4-untied-strong-caps", "gemma3-gqa2-pattern2"])
def test_gemma_ngram_speculation_keeps_transformers_greedy(tiny_model_factory: Callable[..., Path], name: str) -> None:
    """n-gram drafts verified over the soft-capped, windowed attention (chunks read as decode rows)."""
    from common.config.engine_config import SpeculativeConfig, SpeculativeMethod
    from common.engine.llm import LLM
    from common.sampling.params import SamplingParams

    model_dir = _gemma(tiny_model_factory, name)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (9, 14)]
    prompts.append((prompts[0][:4] * 5)[:17])  # repetitive: the n-gram lookup finds drafts
    spec = SpeculativeConfig(method=SpeculativeMethod.NGRAM, num_speculative_tokens=3, max_batch_size=8)
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    with LLM(model_dir, dtype="float32", device="cpu", speculative=spec) as llm:
        got = [c.token_ids for c in llm.generate(prompts, params)]
        assert llm.engine.scheduler.num_draft_tokens > 0
    assert got == [_hf_greedy(model_dir, p, TOKENS) for p in prompts]


@pytest.mark.parametrize("name", ["gemma2-gqa2-window5", "gemma3-gqa2-pattern2", "gemma3-multimodal-text"])
def test_gemma_through_tandem_generate(tiny_model_factory: Callable[..., Path], name: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = _gemma(tiny_model_factory, name)
    prompt = "t17 t3 t99 t42 t8 t120 t64 t5 t77 t31"
    stdout, _, expected = generate_cli(model_dir, prompt, TOKENS, capsys)
    assert stdout == prompt + expected + "\n"


# --- config reads and refusals ---

def test_gemma_config_reads_as_transformers() -> None:
    g2 = ModelConfig.from_dict({**BASE, "model_type": "gemma2"})  # every Gemma field left to its default
    assert g2.tie_word_embeddings and g2.head_dim == 256 and g2.rms_norm_eps == 1e-6
    assert g2.layer_windows == (4096, None, 4096, None)  # Gemma2Config: even layers slide
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping) == (50.0, 30.0)
    assert g2.attention_scale == 256**-0.5 and g2.embed_scale == 8**0.5
    assert g2.sandwich_norms and g2.unit_offset_norms and not g2.qk_norm and g2.sliding_rope_theta is None
    # Gemma 3 as the hub's config.json has it: rope_theta / rope_scaling for the global layers,
    # rope_local_base_freq for the local ones, sliding_window_pattern 6
    raw = {**BASE, "num_hidden_layers": 7, "model_type": "gemma3_text", "rope_theta": 1e6,
           "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
           "sliding_window": 512, "sliding_window_pattern": 6, "attn_logit_softcapping": 50.0}
    g3 = ModelConfig.from_dict(raw)
    assert g3.layer_windows == (512,) * 5 + (None, 512) and g3.qk_norm
    assert g3.layer_rope(5)[0] == 1e6 and g3.layer_rope(5)[1].factor == 8.0
    assert g3.layer_rope(0)[0] == 1e4 and g3.layer_rope(0)[1].rope_type == "default"
    # transformers' Gemma3Attention never passes attn_logit_softcapping to attention: neither does Tandem
    assert g3.attn_logit_softcapping is None and g3.final_logit_softcapping is None
    # the image-and-text config: the same language model read from text_config, the top level's tying and
    # token ids winning (Gemma3ForConditionalGeneration ties by its own tie_word_embeddings)
    mm = ModelConfig.from_dict({"model_type": "gemma3", "eos_token_id": [1, 106], "tie_word_embeddings": False,
                                "text_config": {**raw, "tie_word_embeddings": True, "eos_token_id": 1}})
    assert mm.model_type == "gemma3" and mm.eos_token_ids == (1, 106) and not mm.tie_word_embeddings
    assert (mm.layer_windows, mm.layer_rope(5), mm.layer_rope(0)) == (g3.layer_windows, g3.layer_rope(5),
                                                                      g3.layer_rope(0))


@pytest.mark.parametrize(("fields", "needle"), [
    ({"model_type": "gemma2", "hidden_activation": "gelu"}, r"hidden_activation 'gelu' is not supported"),
    ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, r"use_bidirectional_attention"),
    ({"model_type": "gemma2", "sliding_window": None}, r"sliding_window is null"),
    ({"model_type": "gemma2", "attn_logit_softcapping": -1.0}, r"attn_logit_softcapping must be > 0"),
    ({"model_type": "gemma3_text", "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
     r"rope_parameters keys \['rope_theta', 'rope_type'\]"),
    ({"model_type": "gemma3_text", "rope_scaling": {"rope_type": "longrope", "factor": 4.0}},
     r"rope_scaling.rope_type 'longrope'"),
    ({"model_type": "gemma3"}, r"text_config is missing \(gemma3\)"),
])
def test_what_gemma_cannot_honour_is_refused_naming_the_field(fields: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        ModelConfig.from_dict({**BASE, **fields})


def test_a_backend_without_the_attention_soft_cap_is_refused_at_start(tiny_model_factory: Callable[..., Path]) -> None:
    """flash-attn and FlashInfer lack Gemma 2's attention soft-cap here (torch and Triton have it): the model
    refuses them at construction. They construct only on a GPU, so the refusal runs here with the torch backend
    declaring itself one of them."""
    from common.attention.flash_attn_backend import FlashAttnBackend
    from common.attention.flashinfer_backend import FlashInferBackend
    from common.attention.torch_backend import TorchAttentionBackend
    from common.attention.triton_backend import TritonAttentionBackend
    from common.model.llama import LlamaForCausalLM

    assert TorchAttentionBackend.supports_softcap and TritonAttentionBackend.supports_softcap
    assert not FlashAttnBackend.supports_softcap and not FlashInferBackend.supports_softcap

    class NoSoftcap(TorchAttentionBackend):  # the torch backend as a GPU backend declares itself
        name = "flash_attn"
        supports_softcap = False

    capped = ModelConfig.from_pretrained(_gemma(tiny_model_factory, "gemma2-gqa2-window5"))
    with pytest.raises(ValueError, match=r"attn_logit_softcapping \(50\.0\) is not supported by the 'flash_attn' "
                                         r"attention backend"):
        LlamaForCausalLM(capped, NoSoftcap())
    # without the cap (and Gemma 3, whose attention has none) the same backend is fine
    LlamaForCausalLM(ModelConfig.from_pretrained(_gemma(tiny_model_factory, "gemma2-mha-no-caps")), NoSoftcap())
    LlamaForCausalLM(ModelConfig.from_pretrained(_gemma(tiny_model_factory, "gemma3-gqa2-pattern2")), NoSoftcap())


def test_decode_step_is_not_installed_for_gemma(tiny_model_factory: Callable[..., Path]) -> None:
    """A Llama of the same shapes takes the one-call C++ step; Gemma models with no window and no attention cap
    (so only Gemma's layer could make it decline) keep the op-by-op forward with the fused ops."""
    llama = load_model(tiny_model_factory("llama", seed=7, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=16), dtype="float32")
    if llama.decode_step is None:
        pytest.skip("the one-call decode step does not build or apply on this machine")
    full = ["full_attention"] * 4
    for name, extra in (("gemma2-gqa2-window5", {"layer_types": full[:3], "attn_logit_softcapping": None}),
                        ("gemma3-gqa2-pattern2", {"layer_types": full})):
        model = load_model(_gemma(tiny_model_factory, name, **extra), dtype="float32")
        assert not model.config.layer_windows and model.config.attn_logit_softcapping is None
        assert model.decode_step is None and model.fused_ops.name == "cpp", name

"""gpt-oss (common/model/families.py): attention sinks, alternating sliding and full layers, YaRN rope, biased
routed experts with the clamped SwiGLU — on the one forward, greedy-identical to transformers.

Random-weight models saved by transformers in the hub's layout (its experts already stacked, x @ W style, gate and
up interleaved): top-k 1 and 2, GQA 2:1 and 4:1, a window shorter than the prompts, YaRN (gpt-oss's own
defaults) and plain rope; ``--quantization int8 | int4`` experts and linears. The published MXFP4 checkpoints are
refused naming the field.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from common.attention.metadata import AttentionMetadata
from common.config.model_config import ModelConfig
from common.model.fused_ops import EagerOps
from common.model.loader import load_model
from common.model.moe import route
from tests.model.test_families import GREEDY_TOKENS, _attention, _hf, _hf_greedy, _with_tokenizer, generate_cli
from tests.model.test_moe import _moe_layers, _panel_experts, _ragged_logits

GPT_OSS: dict[str, dict[str, Any]] = {
    "top2-gqa2-yarn": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                       "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 6},
    "top1-gqa4-rope": {"num_local_experts": 3, "num_experts_per_tok": 1, "intermediate_size": 48,
                       "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 5,
                       "num_hidden_layers": 3, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
}


def gpt_oss(factory: Callable[..., Path], name: str) -> Path:
    return factory("gpt_oss", seed=6, max_position_embeddings=256, **GPT_OSS[name])


@pytest.mark.parametrize("name", sorted(GPT_OSS))
def test_ragged_batch_logits_match_transformers(tiny_model_factory: Callable[..., Path], name: str) -> None:
    model_dir = gpt_oss(tiny_model_factory, name)
    model = load_model(model_dir, dtype="float32")
    config = model.config
    assert config.attention_sinks and config.moe is not None and config.moe.topk_before_softmax
    assert config.layer_windows[0] is not None and config.layer_windows[1] is None  # sliding, then full
    assert model.decode_step is None and {m.experts.name for m in _moe_layers(model)} == {"grouped"}
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, config.vocab_size, (n,), generator=gen).tolist() for n in (5, 1, 17, 40)]
    hf = _hf(model_dir)
    with torch.no_grad():
        expected = torch.cat([hf(torch.tensor([s])).logits[0] for s in seqs])
    torch.testing.assert_close(_ragged_logits(model, seqs), expected, atol=1e-4, rtol=1e-4)


def test_yarn_frequencies_and_attention_factor_match_transformers(tiny_model_factory: Callable[..., Path]) -> None:
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model_dir = gpt_oss(tiny_model_factory, "top2-gqa2-yarn")
    config = ModelConfig.from_pretrained(model_dir)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](AutoConfig.from_pretrained(model_dir), "cpu")
    ours = [config.rope_theta ** (-2 * i / config.head_dim) for i in range(config.head_dim // 2)]
    torch.testing.assert_close(torch.tensor(config.rope_scaling.scale_inv_freq(ours, config.rope_theta),
                                            dtype=torch.float64),
                               inv_freq.double(), rtol=1e-6, atol=0)
    assert config.rope_scaling.cos_sin_factor == pytest.approx(factor)


def test_offline_greedy_identical_to_transformers(tiny_model_factory: Callable[..., Path]) -> None:
    """Prefill, decode over the paged cache (the sink path reads the window of cached K/V), chunked prefill."""
    from common.config.engine_config import SchedulerConfig
    from common.engine.llm import LLM
    from common.sampling.params import SamplingParams

    for name in sorted(GPT_OSS):
        model_dir = _with_tokenizer(gpt_oss(tiny_model_factory, name))
        gen = torch.Generator().manual_seed(2)
        prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (6, 13, 21)]
        scheduler = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_prefill_chunk=8)
        with LLM(model_dir, dtype="float32", device="cpu", scheduler=scheduler) as llm:
            done = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True))
        for prompt, completion in zip(prompts, done, strict=True):
            assert completion.token_ids == _hf_greedy(model_dir, prompt, GREEDY_TOKENS), name


def test_through_tandem_generate(tiny_model_factory: Callable[..., Path], capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = _with_tokenizer(gpt_oss(tiny_model_factory, "top2-gqa2-yarn"))
    prompt = "t17 t3 t99 t42 t8 t120 t64 t5 t9"
    stdout, _, expected = generate_cli(model_dir, prompt, GREEDY_TOKENS, capsys)
    assert stdout == prompt + expected + "\n"


BASE: dict[str, Any] = {"model_type": "gpt_oss", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
                        "num_hidden_layers": 2, "num_attention_heads": 2}


@pytest.mark.parametrize(("raw", "message"), [
    ({"quantization_config": {"quant_method": "mxfp4"}},
     r"quantization_config.quant_method 'mxfp4' is not supported \(gpt_oss's published MXFP4 experts\)"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, r"layer_types \['chunked_attention'\]"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "mscale": 1.0,
                          "mscale_all_dim": 1.0}}, r"rope_scaling.mscale is not supported"),
])
def test_configs_tandem_cannot_honour_are_refused(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**BASE, **raw})


def test_sinks_refused_on_backends_without_them(tiny_model_factory: Callable[..., Path]) -> None:
    with pytest.raises(ValueError, match=r"attention sinks \(gpt_oss\) run on the torch attention backend only; "
                                         r"--attention-backend triton has no sinks"):
        load_model(gpt_oss(tiny_model_factory, "top2-gqa2-yarn"), dtype="float32", attention_backend="triton")


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_experts_close_to_their_dequantized_reference(tiny_model_factory: Callable[..., Path],
                                                                method: str) -> None:
    """``--quantization int8 | int4``: the experts packed as the other families' are, run one packed GEMM per hit
    expert with the float path's biases and clamped SwiGLU between them — layer by layer equal to the loop over
    the dequantized weights with the kernel's int8 rounding of each GEMM's input; the attention linears packed
    too, the router float; the whole model's logits close to the float model's (tests/model/test_moe.py's
    tolerances)."""
    _panel_experts()
    from common.quant.formats import quantize_blocks_int8, quantize_int4, quantize_int8

    model_dir = gpt_oss(tiny_model_factory, "top2-gqa2-yarn")
    ref = load_model(model_dir, dtype="float32")
    packed = load_model(model_dir, dtype="float32", quantization=method)
    layers = _moe_layers(packed)
    assert {m.experts.name for m in layers} == {f"{method} panels"}
    assert all(m.gate.format == "float" for m in layers)  # the router stays float
    assert _attention(packed).qkv_proj.format == method
    tokens = torch.arange(3, 40)  # the checkpoint's model: its logits close to the float model's
    meta = AttentionMetadata.build([len(tokens)], [0])
    with torch.no_grad():
        a = ref.compute_logits(ref(tokens, torch.arange(len(tokens)), meta))
        b = packed.compute_logits(packed(tokens, torch.arange(len(tokens)), meta))
    assert (a - b).abs().max() < 0.15 * a.abs().max()
    gen = torch.Generator().manual_seed(8)
    clamped = 0
    for float_moe, moe in zip(_moe_layers(ref), layers, strict=True):
        # then layer by layer: transformers saves zero biases, so the same random ones into both models, b13 wide
        # enough that the SwiGLU's clamps at +-swiglu_limit bite
        assert float_moe.b13 is not None and float_moe.b2 is not None and moe.b13 is not None and moe.b2 is not None
        float_moe.b13.copy_(5 * torch.randn(float_moe.b13.shape, generator=gen))
        float_moe.b2.copy_(torch.randn(float_moe.b2.shape, generator=gen))
        moe.b13.copy_(float_moe.b13)
        moe.b2.copy_(float_moe.b2)
        assert float_moe.swiglu_limit is not None
        clamped += int((float_moe.b13.abs() > float_moe.swiglu_limit + 1).sum())
    assert clamped > 0
    ops = EagerOps()
    x = torch.randn(37, packed.config.hidden_size, generator=gen)

    def dequantized(stacked: torch.Tensor) -> torch.Tensor:
        return torch.stack([(quantize_int4(w, 32) if method == "int4" else quantize_int8(w)).dequantize()
                            for w in stacked.detach()])

    for float_moe, moe in zip(_moe_layers(ref), layers, strict=True):
        weights, ids = route(float_moe.gate(x), float_moe.top_k, float_moe.renormalize, float_moe.topk_first)
        expected = torch.zeros_like(x)
        w13, w2 = dequantized(float_moe.w13), dequantized(float_moe.w2)
        assert float_moe.b13 is not None and float_moe.b2 is not None
        for e in torch.unique(ids).tolist():
            token, slot = torch.where(ids == e)
            h = float_moe.activate(quantize_blocks_int8(x[token]) @ w13[e].T + float_moe.b13[e], ops)
            y = (quantize_blocks_int8(h) @ w2[e].T + float_moe.b2[e]) * weights[token, slot, None]
            expected.index_add_(0, token, y)
        torch.testing.assert_close(moe.experts.apply(moe, x, ids, weights, ops), expected, atol=2e-4, rtol=1e-3)


def test_int8_through_tandem_generate(tiny_model_factory: Callable[..., Path],
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Greedy end to end with int8 experts and linears (prefill, then decode over the paged cache)."""
    _panel_experts()
    from tandem_cli.cli import main

    model_dir = _with_tokenizer(gpt_oss(tiny_model_factory, "top2-gqa2-yarn"))
    prompt = "t17 t3 t99 t42 t8 t120 t64 t5 t9"
    code = main(["generate", "--model", str(model_dir), "--dtype", "float32", "--prompt", prompt,
                 "--max-tokens", str(GREEDY_TOKENS), "--ignore-eos", "--quantization", "int8"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert out.out.startswith(prompt) and f"[{GREEDY_TOKENS} tokens" in out.err

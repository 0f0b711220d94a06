"""Mixtures of experts (common/model/moe.py): Mixtral and Qwen3-MoE on the one forward, greedy-identical to
transformers, the grouped experts equal to transformers' loop in every regime, and what is refused.

Configs are random-weight models saved by transformers in the hub's layout (tests/conftest.py: per-expert
``experts.E.w1/w2/w3`` or ``gate_proj/up_proj/down_proj``): top-k 1 and 2, GQA 2:1 and 1:1, tied and untied
heads, dense-first layers (``mlp_only_layers``), ``decoder_sparse_step``, ``norm_topk_prob`` on and off, a
Mixtral window shorter than the prompts.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import pytest
import torch

from common.attention.metadata import AttentionMetadata
from common.config.model_config import ModelConfig
from common.model.fused_ops import EagerOps
from common.model.loader import load_model
from common.model.moe import GroupedExperts, LoopExperts, SparseMoE, route
from tests.model.test_families import GREEDY_TOKENS, _hf, _hf_greedy, _with_tokenizer, generate_cli

if TYPE_CHECKING:
    from common.model.families import MoEOptions
    from common.model.llama import LlamaDecoderLayer, LlamaForCausalLM

# name -> (model_type, overrides of the tiny config: hidden 64, vocab 128)
MOE: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral-top2-gqa2": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32}),
    "mixtral-top1-mha-tied": ("mixtral", {"num_local_experts": 3, "num_experts_per_tok": 1, "intermediate_size": 48,
                                          "num_key_value_heads": 4, "tie_word_embeddings": True}),
    "mixtral-window": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                                   "sliding_window": 7}),
    "qwen3moe-dense-first": ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                           "intermediate_size": 96, "num_hidden_layers": 3, "mlp_only_layers": [0],
                                           "head_dim": 16, "norm_topk_prob": True}),
    "qwen3moe-sparse-step-top1": ("qwen3_moe", {"num_experts": 6, "num_experts_per_tok": 1,
                                                "moe_intermediate_size": 24, "num_hidden_layers": 4,
                                                "decoder_sparse_step": 2, "head_dim": 32,
                                                "tie_word_embeddings": True}),
    "qwen3moe-top4-unnormed": ("qwen3_moe", {"num_experts": 16, "num_experts_per_tok": 4,
                                             "moe_intermediate_size": 16, "head_dim": 16, "norm_topk_prob": False}),
}


def moe_model(factory: Callable[..., Path], name: str) -> Path:
    model_type, overrides = MOE[name]
    return factory(model_type, seed=6, **overrides)  # seed 6: every greedy step here wins by >= 4e-4


def _moe_layers(model: LlamaForCausalLM) -> list[SparseMoE]:
    return [m for m in (cast("LlamaDecoderLayer", layer).mlp for layer in model.layers) if isinstance(m, SparseMoE)]


def _ragged_logits(model: LlamaForCausalLM, seqs: list[list[int]]) -> torch.Tensor:
    lengths = [len(s) for s in seqs]
    meta = AttentionMetadata.build(lengths, [0] * len(lengths))
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor([t for s in seqs for t in s]),
                                          torch.cat([torch.arange(n) for n in lengths]), meta))


@pytest.mark.parametrize("experts", ["panels", "grouped", "loop"])
@pytest.mark.parametrize("name", sorted(MOE))
def test_ragged_batch_logits_match_transformers(tiny_model_factory: Callable[..., Path], name: str,
                                                experts: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if experts == "panels":
        _panel_experts()
    else:
        monkeypatch.setenv("TANDEM_CPU_MOE", "off")  # float w13 / w2 kept: grouped, or the loop set below
    model_dir = moe_model(tiny_model_factory, name)
    model = load_model(model_dir, dtype="float32")
    config = model.config
    assert config.moe is not None and model.decode_step is None  # the one-call C++ step has no experts
    layers = _moe_layers(model)
    assert len(layers) == sum(config.moe.layers) > 0
    for layer in layers:
        assert layer.experts.name == ("panels" if experts == "panels" else "grouped")
        if experts == "loop":
            layer.experts = LoopExperts()
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, config.vocab_size, (n,), generator=gen).tolist() for n in (5, 1, 17, 40)]
    hf = _hf(model_dir)
    with torch.no_grad():
        expected = torch.cat([hf(torch.tensor([s])).logits[0] for s in seqs])
    torch.testing.assert_close(_ragged_logits(model, seqs), expected, atol=1e-4, rtol=1e-4)


def test_layer_pattern_read_as_transformers_builds_it(tiny_model_factory: Callable[..., Path]) -> None:
    import transformers

    for name in ("qwen3moe-dense-first", "qwen3moe-sparse-step-top1"):
        model_dir = moe_model(tiny_model_factory, name)
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        theirs = tuple(type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers)
        config = ModelConfig.from_pretrained(model_dir)
        assert config.moe is not None and config.moe.layers == theirs, name
    mixtral = ModelConfig.from_pretrained(moe_model(tiny_model_factory, "mixtral-top2-gqa2")).moe
    assert mixtral is not None and mixtral.layers == (True, True) and mixtral.norm_topk_prob


def _random_moe(num_experts: int, top_k: int, hidden: int = 32, inter: int = 24, seed: int = 0) -> SparseMoE:
    from common.model.families import MoEOptions

    gen = torch.Generator().manual_seed(seed)
    moe = SparseMoE(hidden, MoEOptions(num_experts, top_k, inter, True, (True,)))
    with torch.no_grad():
        for p in (moe.gate.weight, moe.w13, moe.w2):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return moe


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), [
    (1, 64, 8),     # batch-1 decode: few experts hit -> one GEMM per hit expert
    (32, 64, 8),    # a decode step of 32: every expert hit, few rows each -> padded batched matmuls
    (300, 8, 2),    # prefill: many rows per expert -> padded while the waste is small
    (257, 4, 1),    # prefill, one expert each
    (0, 8, 2),      # an empty batch
])
def test_grouped_experts_equal_the_loop(num_tokens: int, num_experts: int, top_k: int) -> None:
    moe = _random_moe(num_experts, top_k)
    x = torch.randn(num_tokens, 32, generator=torch.Generator().manual_seed(1))
    ops = EagerOps()
    weights, ids = route(moe.gate(x), top_k, True)
    reference = LoopExperts().apply(moe, x, ids, weights, ops)
    torch.testing.assert_close(GroupedExperts().apply(moe, x, ids, weights, ops), reference, atol=1e-5, rtol=1e-5)


def test_grouped_experts_take_each_way() -> None:
    """The three ways of GroupedExperts (padded, per-expert slices, few experts) each equal the loop, forced by
    skewed routing: every token to the same two experts makes the padding all waste, and slices are taken."""
    moe = _random_moe(8, 2)
    x = torch.randn(200, 32, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([[0, 5]] * 150 + [[1, 2]] * 50)
    weights = torch.full((200, 2), 0.5)
    ops = EagerOps()
    torch.testing.assert_close(GroupedExperts().apply(moe, x, ids, weights, ops),
                               LoopExperts().apply(moe, x, ids, weights, ops), atol=1e-5, rtol=1e-5)


def test_expert_range_holds_a_partial_sum() -> None:
    """Expert parallelism's arithmetic: two modules holding experts [0, 4) and [4, 8) sum to the whole."""
    whole = _random_moe(8, 2)
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(4))
    ops = EagerOps()
    weights, ids = route(whole.gate(x), 2, True)
    parts = []
    for start in (0, 4):
        part = _random_moe(8, 2)
        with torch.no_grad():
            part.w13 = torch.nn.Parameter(whole.w13[start : start + 4].clone(), requires_grad=False)
            part.w2 = torch.nn.Parameter(whole.w2[start : start + 4].clone(), requires_grad=False)
        part.expert_start = start
        for experts in (GroupedExperts(), LoopExperts()):
            parts.append(experts.apply(part, x, ids, weights, ops))
    expected = LoopExperts().apply(whole, x, ids, weights, ops)
    torch.testing.assert_close(parts[0] + parts[2], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(parts[1] + parts[3], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", ["on", "off"])
def test_offline_greedy_identical_to_transformers(tiny_model_factory: Callable[..., Path], fused: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The offline ``LLM``: prompts through the paged KV cache, prefill then decode steps."""
    from common.engine.llm import LLM
    from common.sampling.params import SamplingParams

    monkeypatch.setenv("TANDEM_FUSED_OPS", fused)
    names = (("mixtral-top2-gqa2", "qwen3moe-dense-first") if fused == "on"
             else ("mixtral-window", "qwen3moe-top4-unnormed"))
    for name in names:
        model_dir = _with_tokenizer(moe_model(tiny_model_factory, name))
        gen = torch.Generator().manual_seed(2)
        prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (6, 13)]
        with LLM(model_dir, dtype="float32", device="cpu") as llm:
            done = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True))
        for prompt, completion in zip(prompts, done, strict=True):
            assert completion.token_ids == _hf_greedy(model_dir, prompt, GREEDY_TOKENS), name


def test_through_tandem_generate(tiny_model_factory: Callable[..., Path], capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = _with_tokenizer(moe_model(tiny_model_factory, "qwen3moe-sparse-step-top1"))
    prompt = "t17 t3 t99 t42 t8 t120 t64"
    stdout, stderr, expected = generate_cli(model_dir, prompt, GREEDY_TOKENS, capsys)
    assert stdout == prompt + expected + "\n"
    assert f"[{GREEDY_TOKENS} tokens" in stderr


BASE: dict[str, Any] = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
                        "num_attention_heads": 2}


def _options(raw: dict[str, Any]) -> MoEOptions | None:
    return ModelConfig.from_dict({**BASE, **raw}).moe


def test_options_read_as_transformers_reads_them() -> None:
    mixtral = _options({"model_type": "mixtral"})  # transformers' defaults: 8 experts, top 2
    assert mixtral is not None and (mixtral.num_experts, mixtral.experts_per_token, mixtral.intermediate_size) == (
        8, 2, 16)
    qwen = _options({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 6})
    assert qwen is not None and (qwen.num_experts, qwen.intermediate_size, qwen.norm_topk_prob) == (4, 6, False)
    saved = _options({"model_type": "qwen3_moe", "num_local_experts": 4, "num_experts_per_tok": 2})
    assert saved is not None and saved.num_experts == 4  # transformers 5 saves num_experts under this name
    # every layer dense: no experts at all
    assert _options({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 1,
                     "mlp_only_layers": [0, 1]}) is None


@pytest.mark.parametrize(("raw", "message"), [
    ({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 5},
     r"num_experts_per_tok must be in \[1, num_experts=4\], got 5"),
    ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 0}, r"num_experts_per_tok must be in"),
    ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 1, "decoder_sparse_step": 0},
     r"decoder_sparse_step must be >= 1"),
    ({"model_type": "mixtral", "hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported \(mixtral\)"),
])
def test_refused_naming_the_field(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**BASE, **raw})


def test_experts_quantized_only_as_int8_or_int4_on_cpu(tiny_model_factory: Callable[..., Path]) -> None:
    from common.quant.config import QuantizationError

    with pytest.raises(QuantizationError, match=r"--quantization w8a8: mixtral's routed experts are packed as int8 "
                                                r"or int4 on CPU only"):
        load_model(moe_model(tiny_model_factory, "mixtral-top2-gqa2"), dtype="float32", quantization="w8a8")


# experts quantized: shapes whose widths are multiples of 32 (the packed kernels' block)
PACKED: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64}),
    "qwen3moe": ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                               "intermediate_size": 96, "num_hidden_layers": 3, "mlp_only_layers": [0],
                               "head_dim": 16, "norm_topk_prob": True}),
}


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("name", sorted(PACKED))
def test_packed_experts_equal_their_dequantized_reference(tiny_model_factory: Callable[..., Path], name: str,
                                                          method: str) -> None:
    """The one-call packed experts against transformers' loop over the dequantized weights with the same int8
    rounding of the activations (formats.reference_a8_matmul's math), layer by layer; and the whole model stays
    close to the float one."""
    _panel_experts()
    from common.quant.formats import quantize_blocks_int8, quantize_int4, quantize_int8

    model_type, overrides = PACKED[name]
    model_dir = tiny_model_factory(model_type, seed=6, **overrides)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_CPU_MOE", "off")
        ref = load_model(model_dir, dtype="float32")  # float w13 / w2
    packed = load_model(model_dir, dtype="float32", quantization=method)
    layers = _moe_layers(packed)
    assert {m.experts.name for m in layers} == {f"{method} panels"}
    assert all(m.gate.format == "float" for m in layers)  # the router stays float
    ops = EagerOps()
    x = torch.randn(37, packed.config.hidden_size, generator=torch.Generator().manual_seed(8))
    for float_moe, moe in zip(_moe_layers(ref), layers, strict=True):
        weights, ids = route(float_moe.gate(x), float_moe.top_k, float_moe.renormalize)
        def dequantized(stacked: torch.Tensor) -> torch.Tensor:
            return torch.stack([(quantize_int4(w, 32) if method == "int4" else quantize_int8(w)).dequantize()
                                for w in stacked.detach()])

        deq = cast("SparseMoE", SimpleNamespace(w13=dequantized(float_moe.w13), w2=dequantized(float_moe.w2)))

        class A8Loop(LoopExperts):  # the loop with each GEMM's input rounded as the kernel rounds it
            def apply(self, moe: SparseMoE, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                      ops: Any) -> torch.Tensor:
                out = torch.zeros_like(x)
                for e in torch.unique(ids).tolist():
                    token, slot = torch.where(ids == e)
                    h = ops.silu_mul(quantize_blocks_int8(x[token]) @ moe.w13[e].T)
                    y = (quantize_blocks_int8(h) @ moe.w2[e].T) * weights[token, slot, None]
                    out.index_add_(0, token, y)
                return out

        expected = A8Loop().apply(deq, x, ids, weights, ops)
        got = moe.experts.apply(moe, x, ids, weights, ops)
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-3)
    ids = torch.arange(3, 40)
    meta = AttentionMetadata.build([len(ids)], [0])
    with torch.no_grad():
        a = ref.compute_logits(ref(ids, torch.arange(len(ids)), meta))
        b = packed.compute_logits(packed(ids, torch.arange(len(ids)), meta))
    assert (a - b).abs().max() < 0.15 * a.abs().max()


def test_packed_experts_refuse_widths_off_the_block(tiny_model_factory: Callable[..., Path]) -> None:
    from common.quant.config import QuantizationError

    _panel_experts()
    with pytest.raises(QuantizationError, match=r"--quantization int8: .*experts' down_proj has 16 input features"):
        load_model(moe_model(tiny_model_factory, "qwen3moe-dense-first"), dtype="float32", quantization="int8")


def test_checkpoint_with_an_expert_beyond_the_config_is_refused(tiny_model_factory: Callable[..., Path]) -> None:
    from common.model.loader import iter_weights, load_weights

    model_dir = moe_model(tiny_model_factory, "mixtral-top2-gqa2")
    model = load_model(model_dir, dtype="float32", prepare=False)
    extra = ("model.layers.0.block_sparse_moe.experts.4.w1.weight", torch.zeros(32, 64))
    with pytest.raises(ValueError, match=r"experts.4.w1.weight.*expert 4 is beyond the config's 4"):
        load_weights(model, iter([*iter_weights(model_dir), extra]))
    missing = [(n, t) for n, t in iter_weights(model_dir) if "experts.3.w2" not in n]
    with pytest.raises(ValueError, match=r"missing weights for: layers.0.mlp.w2"):
        load_weights(model, iter(missing))


def _panel_experts() -> Any:
    from common.model.gemv import gemv_kernels
    from common.model.moe import PanelExperts

    ops = gemv_kernels()
    if ops is None:
        pytest.skip("the C++ CPU kernels do not build here")
    return PanelExperts(ops)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), [
    (1, 64, 8), (32, 64, 8), (300, 8, 2), (7, 4, 1), (0, 8, 2),
])
def test_panel_experts_equal_the_loop(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype) -> None:
    """The one-call C++ experts (fp32 and bf16 panels) against transformers' loop on the same weights."""
    panels = _panel_experts()
    moe = _random_moe(num_experts, top_k, hidden=48, inter=40).to(dtype)
    x = torch.randn(num_tokens, 48, generator=torch.Generator().manual_seed(1)).to(dtype)
    ops = EagerOps()
    weights, ids = route(moe.gate(x), top_k, True)
    # the loop in fp32 over the same (bf16-rounded) weights and inputs: the kernel sums in fp32
    reference = LoopExperts().apply(copy.deepcopy(moe).float(), x.float(), ids, weights, ops)
    moe.set_experts(panels)
    assert moe.num_local_experts == num_experts and moe.get_buffer("w13_panels").dtype == dtype
    out = moe.experts.apply(moe, x, ids, weights, ops)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding
    torch.testing.assert_close(out.float(), reference.float(), atol=tol, rtol=tol)


def test_panel_experts_at_prefill_sizes_unpack_for_torch() -> None:
    """More rows per expert than the panel kernel takes: each expert's panels unpacked for torch's GEMM."""
    panels = _panel_experts()
    panels.max_rows = 8
    moe = _random_moe(4, 2, hidden=32, inter=24)
    x = torch.randn(100, 32, generator=torch.Generator().manual_seed(3))
    ops = EagerOps()
    weights, ids = route(moe.gate(x), 2, True)
    reference = LoopExperts().apply(moe, x, ids, weights, ops)
    moe.set_experts(panels)
    torch.testing.assert_close(moe.experts.apply(moe, x, ids, weights, ops), reference, atol=1e-5, rtol=1e-5)


def test_loaded_models_take_panels_on_cpu(tiny_model_factory: Callable[..., Path],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    _panel_experts()
    model_dir = moe_model(tiny_model_factory, "mixtral-top2-gqa2")
    assert {m.experts.name for m in _moe_layers(load_model(model_dir, dtype="float32"))} == {"panels"}
    monkeypatch.setenv("TANDEM_CPU_MOE", "off")
    assert {m.experts.name for m in _moe_layers(load_model(model_dir, dtype="float32"))} == {"grouped"}


@pytest.mark.parametrize("expert_parallel", [True, False], ids=["ep2", "tp2"])
def test_two_ranks_greedy_identical_to_transformers(tiny_model_factory: Callable[..., Path],
                                                    expert_parallel: bool) -> None:
    """A node of two rank processes (common/parallel/): whole experts per rank, or each expert's columns split."""
    from common.engine.llm import LLM
    from common.sampling.params import SamplingParams

    model_dir = _with_tokenizer(moe_model(tiny_model_factory, "qwen3moe-dense-first"))
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (6, 13)]
    with LLM(model_dir, dtype="float32", device="cpu", tensor_parallel_size=2,
             expert_parallel=expert_parallel) as llm:
        done = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True))
    for prompt, completion in zip(prompts, done, strict=True):
        assert completion.token_ids == _hf_greedy(model_dir, prompt, GREEDY_TOKENS)


def test_expert_parallel_flag_through_tandem_generate(tiny_model_factory: Callable[..., Path],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = _with_tokenizer(moe_model(tiny_model_factory, "mixtral-top2-gqa2"))
    prompt = "t17 t3 t99 t42 t8"
    stdout, _, expected = generate_cli(model_dir, prompt, 8, capsys, "--tensor-parallel-size", "2",
                                       "--expert-parallel")
    assert stdout == prompt + expected + "\n"


def test_expert_parallel_without_ranks_refused_at_start(tiny_model_factory: Callable[..., Path],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from tandem_cli.cli import main

    model_dir = _with_tokenizer(moe_model(tiny_model_factory, "mixtral-top2-gqa2"))
    code = main(["generate", "--model", str(model_dir), "--prompt", "t5", "--max-tokens", "1", "--expert-parallel"])
    err = capsys.readouterr().err
    assert code == 2 and "--expert-parallel splits the experts over the --tensor-parallel-size ranks" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("method", ["ngram", "draft_model", "draft_layers"])
def test_speculative_decoding_keeps_greedy_output(tiny_model_factory: Callable[..., Path], method: str) -> None:
    """Speculation on a mixture of experts verifies drafts through the routed layers: n-gram lookup, another family
    member with the same tokenizer as the draft model (a dense Qwen3 for a Qwen3-MoE target), the target's own
    first layers. Greedy tokens stay transformers'."""
    from common.config.engine_config import SpeculativeConfig, SpeculativeMethod
    from common.engine.llm import LLM
    from common.sampling.params import SamplingParams

    model_dir = _with_tokenizer(moe_model(tiny_model_factory, "qwen3moe-dense-first"))
    draft = _with_tokenizer(tiny_model_factory("qwen3", seed=3, head_dim=16, num_hidden_layers=1))
    spec = SpeculativeConfig(method=SpeculativeMethod(method), num_speculative_tokens=3,
                             draft_model=str(draft) if method == "draft_model" else "", draft_layers=2)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (6, 13)]
    prompts.append([5, 6, 7, 8, 5, 6, 7, 8, 5, 6])  # repeats: the n-gram lookup finds drafts
    with LLM(model_dir, dtype="float32", device="cpu", speculative=spec) as llm:
        done = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True))
        drafted = llm.engine.scheduler.num_draft_tokens
    assert drafted > 0
    for prompt, completion in zip(prompts, done, strict=True):
        assert completion.token_ids == _hf_greedy(model_dir, prompt, GREEDY_TOKENS)

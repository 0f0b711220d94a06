"""Packed methods for a model's linear layers: each mode, the GGUF path, the tied lookup, and the start-up
errors that name the flag."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from common.attention.metadata import AttentionMetadata
from common.config.model_config import ModelConfig
from common.config.settings import ModelSettings, load_settings
from common.model.gguf_convert import convert_gguf_to_hf
from common.model.linear import Linear, TiedEmbedding
from common.model.llama import LlamaForCausalLM
from common.model.loader import load_model
from common.model.prepare import prepare_model
from common.quant.config import QuantConfig, QuantizationError, QuantMethod
from common.quant.gguf_blocks import GGUFBlocks
from common.quant.quantizer import check_quantization

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 64, 96, 4, 2, 64


def _logits(model: LlamaForCausalLM, n: int = 12) -> torch.Tensor:
    ids = torch.arange(3, 3 + n) % model.config.vocab_size
    meta = AttentionMetadata.build([n], [0])
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(n), meta))


def _linears(model: LlamaForCausalLM) -> dict[str, Linear]:
    """The model's packed layers, by name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear) and m.format != "float"}


def _prepared(model_dir: Path, mode: str, blocks: GGUFBlocks | None, kernel: str = "auto") -> LlamaForCausalLM:
    """The after-load pass with a GGUF file's blocks given directly (the loader finds them from the directory)."""
    model = load_model(model_dir, dtype="float32", prepare=False)
    prepare_model(model, "cpu", QuantConfig.parse(mode), blocks, kernel)
    return model


@pytest.mark.parametrize(("mode", "formats"), [
    ("int8", {"int8"}), ("int4", {"int4", "int8"}), ("w8a8", {"int8"}),
])
def test_every_linear_is_packed_and_logits_stay_close(tiny_model_dir: Path, mode: str, formats: set[str]) -> None:
    reference = load_model(tiny_model_dir, dtype="float32")
    model = load_model(tiny_model_dir, dtype="float32", quantization=mode)
    linears = _linears(model)
    assert len(linears) == 4 * model.config.num_layers + 1  # qkv, o, gate_up, down; the LM head
    assert {m.format for m in linears.values()} == formats
    if mode == "int4":
        assert linears["lm_head"].format == "int8"  # the head keeps 8 bits
    assert model.dtype == torch.float32 and next(model.parameters()).dtype == torch.float32
    assert model.weight_bytes < reference.weight_bytes
    ref, out = _logits(reference), _logits(model)
    assert (out - ref).abs().max() < 0.1 * ref.abs().max()


def test_none_and_auto_without_gguf_keep_float_weights(tiny_model_dir: Path) -> None:
    for mode in ("none", "auto"):
        model = load_model(tiny_model_dir, dtype="float32", quantization=mode)
        assert not _linears(model)


def test_fp8_on_cpu_fails_at_start_up_naming_the_flag(tiny_model_dir: Path) -> None:
    with pytest.raises(QuantizationError, match=r"--quantization fp8 needs a CUDA GPU .* the device is cpu"):
        load_model(tiny_model_dir, dtype="float32", quantization="fp8")


def test_a_group_size_that_does_not_divide_a_layer_fails_naming_the_flag(tiny_model_dir: Path) -> None:
    # the tiny model's down_proj has 96 input features: 64 does not divide them, 32 does
    with pytest.raises(QuantizationError, match=r"--quantization-group-size 64 does not divide mlp.down_proj's "
                                                r"96 input features; group sizes that fit this model: 32"):
        load_model(tiny_model_dir, dtype="float32", quantization="int4", quantization_group_size=64)


def test_layers_not_a_multiple_of_32_are_refused(tiny_model_factory: Callable[..., Path]) -> None:
    config = ModelConfig.from_pretrained(tiny_model_factory(intermediate_size=80))
    with pytest.raises(QuantizationError, match=r"--quantization int8: mlp.down_proj has 80 input features"):
        check_quantization(QuantConfig(QuantMethod.INT8), config, "cpu")


def test_settings_name_the_flag_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"--quantization \(TANDEM_QUANTIZATION\) must be one of none, auto, int8"):
        load_settings(ModelSettings, environ={"TANDEM_QUANTIZATION": "int3"})
    with pytest.raises(ValueError, match=r"--quantization-group-size \(TANDEM_QUANTIZATION_GROUP_SIZE\)"):
        load_settings(ModelSettings, {"quantization_group_size": 48})
    settings = load_settings(ModelSettings, environ={"TANDEM_QUANTIZATION": "int4",
                                                     "TANDEM_QUANTIZATION_GROUP_SIZE": "64"})
    assert (settings.quantization, settings.quantization_group_size) == ("int4", 64)
    with pytest.raises(QuantizationError, match=r"--quantization 'int3': choose one of none, auto, int8, int4"):
        QuantConfig.parse("int3")


# -- a GGUF source: its Q4_1 / Q8_0 blocks are loaded as published ---------------------------------------

def _permute(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's q/k row order
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A one-layer llama GGUF with Q4_1 projections and a Q8_0 tied embedding, and its HF conversion."""
    rng = np.random.default_rng(0)
    kv = KV_HEADS * HIDDEN // HEADS
    tensors = {
        "token_embd.weight": ((VOCAB, HIDDEN), GGMLQuantizationType.Q8_0),
        "output_norm.weight": ((HIDDEN,), None),
        "blk.0.attn_q.weight": ((HIDDEN, HIDDEN), GGMLQuantizationType.Q4_1),
        "blk.0.attn_k.weight": ((kv, HIDDEN), GGMLQuantizationType.Q4_1),
        "blk.0.attn_v.weight": ((kv, HIDDEN), GGMLQuantizationType.Q4_1),
        "blk.0.attn_output.weight": ((HIDDEN, HIDDEN), GGMLQuantizationType.Q4_1),
        "blk.0.ffn_gate.weight": ((INTER, HIDDEN), GGMLQuantizationType.Q4_1),
        "blk.0.ffn_up.weight": ((INTER, HIDDEN), GGMLQuantizationType.Q4_1),
        "blk.0.ffn_down.weight": ((HIDDEN, INTER), GGMLQuantizationType.Q4_1),
        "blk.0.attn_norm.weight": ((HIDDEN,), None),
        "blk.0.ffn_norm.weight": ((HIDDEN,), None),
    }
    root = tmp_path_factory.mktemp("q4gguf")
    writer = GGUFWriter(root / "tiny.gguf", "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    tokens = ["<s>", "a", "b", "ab"] + [f"t{i}" for i in range(VOCAB - 4)]
    writer.add_token_list(tokens)
    writer.add_token_types([3] + [1] * (VOCAB - 1))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    for name, (shape, qtype) in tensors.items():
        w = rng.standard_normal(shape).astype(np.float32) * (1.0 if qtype is None else 0.2)
        if qtype is None:
            writer.add_tensor(name, w)
            continue
        heads = {"blk.0.attn_q.weight": HEADS, "blk.0.attn_k.weight": KV_HEADS}.get(name)
        if heads is not None:
            w = _permute(w, heads)
        writer.add_tensor(name, quantize(w, qtype), raw_shape=quantize(w, qtype).shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    convert_gguf_to_hf(root / "tiny.gguf", root / "hf", progress=False)
    return root / "tiny.gguf", root / "hf"


@pytest.mark.parametrize("mode", ["int4", "auto"])
def test_gguf_q4_1_blocks_run_as_published(q4_gguf: tuple[Path, Path], mode: str) -> None:
    gguf_path, hf_dir = q4_gguf
    reference = load_model(hf_dir, dtype="float32")  # the converter's exact dequantization
    blocks = GGUFBlocks(gguf_path, 1, HEADS, KV_HEADS)
    # float-activation kernels: the default tandem_a8 also rounds x to int8 blocks (tested in test_linear)
    model = _prepared(hf_dir, mode, blocks, kernel="tandem_cpu")
    linears = _linears(model)
    assert linears["layers.0.mlp.down_proj"].format == "int4"
    assert linears["lm_head"].format == "int8" and linears["lm_head"].group_size == 32  # Q8_0 as published
    published = blocks.packed("model.layers.0.mlp.down_proj.weight")
    assert published is not None and torch.equal(linears["layers.0.mlp.down_proj"].get_buffer("q"), published.q)
    # same weights, only the summation order differs
    torch.testing.assert_close(_logits(model), _logits(reference), rtol=1e-4, atol=1e-4)


def test_gguf_int8_requantizes_4_bit_layers_and_keeps_q8_0(q4_gguf: tuple[Path, Path]) -> None:
    gguf_path, hf_dir = q4_gguf
    model = _prepared(hf_dir, "int8", GGUFBlocks(gguf_path, 1, HEADS, KV_HEADS))
    linears = _linears(model)
    assert linears["layers.0.self_attn.qkv_proj"].format == "int8"
    assert linears["layers.0.self_attn.qkv_proj"].group_size == HIDDEN  # per channel
    assert linears["lm_head"].group_size == 32  # Q8_0 blocks kept


def test_a_tied_head_quantized_at_load_keeps_the_float_table(tiny_model_factory: Callable[..., Path]) -> None:
    model_dir = tiny_model_factory(tie_word_embeddings=True)
    reference = load_model(model_dir, dtype="float32", prepare=False)  # the float table as loaded
    model = load_model(model_dir, dtype="float32", quantization="int8")
    assert type(model.embed_tokens) is torch.nn.Embedding  # the lookup does not inherit the rounding
    assert torch.equal(model.embed_tokens.weight, reference.embed_tokens.weight)
    assert model.lm_head.format == "int8"
    assert next(model.parameters()).dtype == model.dtype == torch.float32  # what the engine sizes KV from


def test_gguf_q8_0_embedding_rows_are_the_published_values(q4_gguf: tuple[Path, Path]) -> None:
    gguf_path, hf_dir = q4_gguf
    reference = load_model(hf_dir, dtype="float32")
    model = _prepared(hf_dir, "int4", GGUFBlocks(gguf_path, 1, HEADS, KV_HEADS))
    assert isinstance(model.embed_tokens, TiedEmbedding)  # one packed copy serves both ends
    ids = torch.arange(VOCAB)
    assert torch.equal(model.embed_tokens(ids), reference.embed_tokens(ids))
    assert model.weight_bytes < reference.weight_bytes - VOCAB * HIDDEN * 3


@pytest.mark.parametrize("kernel", ["tandem_cpu", "torch", "int_mm", "reference"])
def test_shared_lookup_reads_rows_whatever_the_head_kernel(kernel: str) -> None:
    from common.quant.formats import quantize_int8
    from common.quant.registry import packed_method

    weight = quantize_int8(torch.randn(40, HIDDEN))
    head = Linear(HIDDEN, 40, bias=False)
    head.set_method(packed_method(weight, torch.device("cpu"), torch.float32, kernel), weight)
    ids = torch.tensor([0, 7, 7, 39])
    torch.testing.assert_close(TiedEmbedding(head, torch.float32)(ids), weight.dequantize()[ids],
                               rtol=1e-3 if kernel == "torch" else 0, atol=1e-3 if kernel == "torch" else 0)

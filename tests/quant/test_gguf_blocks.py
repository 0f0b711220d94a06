"""GGUF Q4_0 / Q4_1 / Q8_0 blocks load into the packed formats exactly as ``gguf.quants.dequantize`` reads them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from common.quant.formats import Int4Weight, Int8Weight
from common.quant.gguf_blocks import GGUFBlocks, int4_from_blocks, int8_from_blocks


def _blocks(qtype: GGMLQuantizationType, rows: int = 6, cols: int = 128) -> tuple[np.ndarray, np.ndarray]:
    w = np.random.default_rng(int(qtype)).standard_normal((rows, cols)).astype(np.float32)
    raw = quantize(w, qtype)
    return raw, np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(rows, cols)


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1])
def test_4bit_blocks_are_int4_with_group_32(qtype: GGMLQuantizationType) -> None:
    raw, expected = _blocks(qtype)
    weight = int4_from_blocks(raw, qtype)
    assert isinstance(weight, Int4Weight) and weight.group_size == 32 and weight.shape == expected.shape
    assert weight.q.dtype == torch.uint8 and weight.scales.dtype == torch.float16
    # Q4_1: w = d q + m exactly; Q4_0: d (q - 8) = d q + (-8 d), exact in fp32 too
    np.testing.assert_array_equal(weight.dequantize().numpy(), expected)


def test_q4_1_bytes_are_used_as_they_are() -> None:
    raw, _ = _blocks(GGMLQuantizationType.Q4_1)
    weight = int4_from_blocks(raw, GGMLQuantizationType.Q4_1)
    blocks = raw.reshape(6, -1, 20)
    np.testing.assert_array_equal(weight.q.numpy().reshape(6, -1, 16), blocks[..., 4:])
    np.testing.assert_array_equal(weight.scales.numpy(), blocks[..., 0:2].copy().view(np.float16)[..., 0])


def test_q8_0_blocks_are_int8_with_group_32() -> None:
    raw, expected = _blocks(GGMLQuantizationType.Q8_0)
    weight = int8_from_blocks(raw, GGMLQuantizationType.Q8_0)
    assert isinstance(weight, Int8Weight) and weight.group_size == 32 and weight.q.dtype == torch.int8
    np.testing.assert_array_equal(weight.dequantize().numpy(), expected)


def test_wrong_block_types_are_refused() -> None:
    raw, _ = _blocks(GGMLQuantizationType.Q8_0)
    with pytest.raises(ValueError, match="not a 4-bit"):
        int4_from_blocks(raw, GGMLQuantizationType.Q8_0)
    with pytest.raises(ValueError, match="not an 8-bit"):
        int8_from_blocks(raw, GGMLQuantizationType.Q4_1)


@pytest.mark.real_model
def test_bundled_gguf_blocks_equal_the_converted_weights(smollm2_dir: Path) -> None:
    """q/k rows come back in Hugging Face order; every value equals the converter's dequantized float."""
    from safetensors import safe_open

    from common.config.model_config import ModelConfig
    from common.model.model_store import gguf_source

    source = gguf_source(smollm2_dir)
    assert source is not None and source.name.endswith(".Q4_1.gguf")
    c = ModelConfig.from_pretrained(smollm2_dir)
    blocks = GGUFBlocks(source, c.num_layers, c.num_heads, c.num_kv_heads)
    names = ["model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
             "model.layers.3.mlp.down_proj.weight", "model.embed_tokens.weight"]
    with safe_open(str(smollm2_dir / "model.safetensors"), framework="pt") as f:
        for name in names:
            packed = blocks.packed(name)
            assert packed is not None, name
            assert isinstance(packed, Int8Weight if "embed" in name else Int4Weight), name
            assert torch.equal(packed.dequantize(), f.get_tensor(name)), name
    assert blocks.packed("model.layers.0.input_layernorm.weight") is None  # F32: nothing to pack

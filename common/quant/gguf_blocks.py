"""GGUF quantized blocks -> Tandem's packed weights, bytes copied, nothing dequantized.

llama.cpp's blocks (``ggml-common.h``), 32 weights each, fp16 scalars first:

- Q4_0: ``d``, 16 bytes of nibbles; ``w = d * (q - 8)``      -> int4, scale ``d``, zero ``-8 d``
- Q4_1: ``d``, ``m``, 16 bytes of nibbles; ``w = d * q + m`` -> int4, scale ``d``, zero ``m``
- Q8_0: ``d``, 32 int8; ``w = d * q``                       -> int8, group 32, scale ``d``

A block's 16 nibble bytes hold weight ``j`` low and ``j + 16`` high: exactly ``Int4Weight``'s layout, so
the bytes are used as they are. The tests check every mapping against ``gguf.quants.dequantize``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor

from common.model.gguf_layout import hf_tensor_name, rotary_row_order
from common.quant.formats import SUB_BLOCK, Int4Weight, Int8Weight

INT4_TYPES = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1})
INT8_TYPES = frozenset({GGMLQuantizationType.Q8_0})
_BLOCK_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20, GGMLQuantizationType.Q8_0: 34}


def _blocks(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    # raw: uint8 [rows, bytes per row] -> [rows, blocks per row, bytes per block]
    rows = raw.shape[0]
    return np.ascontiguousarray(raw).reshape(rows, -1, _BLOCK_BYTES[qtype])


def _half(blocks: np.ndarray, offset: int) -> np.ndarray:
    # the fp16 scalar at `offset` of every block: [rows, blocks]
    return np.ascontiguousarray(blocks[..., offset : offset + 2]).view(np.float16)[..., 0]


def int4_from_blocks(raw: np.ndarray, qtype: GGMLQuantizationType) -> Int4Weight:
    """Q4_0 / Q4_1 rows (uint8 ``[rows, bytes]``) as an ``Int4Weight`` with group size 32."""
    blocks = _blocks(raw, qtype)
    rows = blocks.shape[0]
    scales = _half(blocks, 0)
    if qtype is GGMLQuantizationType.Q4_1:
        zeros, nibbles = _half(blocks, 2), blocks[..., 4:]
    elif qtype is GGMLQuantizationType.Q4_0:
        zeros, nibbles = (scales * np.float16(-8)).astype(np.float16), blocks[..., 2:]  # x8: exact in fp16
    else:
        raise ValueError(f"{qtype.name} is not a 4-bit GGUF block type")
    q = torch.from_numpy(np.ascontiguousarray(nibbles).reshape(rows, -1))
    return Int4Weight(q, torch.from_numpy(scales.copy()), torch.from_numpy(zeros.copy()), SUB_BLOCK)


def int8_from_blocks(raw: np.ndarray, qtype: GGMLQuantizationType) -> Int8Weight:
    """Q8_0 rows (uint8 ``[rows, bytes]``) as an ``Int8Weight`` with group size 32."""
    if qtype is not GGMLQuantizationType.Q8_0:
        raise ValueError(f"{qtype.name} is not an 8-bit GGUF block type")
    blocks = _blocks(raw, qtype)
    rows = blocks.shape[0]
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, -1)
    return Int8Weight(torch.from_numpy(q), torch.from_numpy(_half(blocks, 0).astype(np.float32)), SUB_BLOCK)


class GGUFBlocks:
    """The quantized tensors of a GGUF file, by Hugging Face name, in Hugging Face row order."""

    def __init__(self, path: Path, num_layers: int, num_heads: int, num_kv_heads: int) -> None:
        self.path = Path(path)
        self._reader = GGUFReader(self.path)
        self._num_heads = {"q_proj": num_heads, "k_proj": num_kv_heads}
        self._tensors: dict[str, ReaderTensor] = {
            hf_tensor_name(t.name, num_layers): t for t in self._reader.tensors
        }

    def tensor_type(self, hf_name: str) -> GGMLQuantizationType | None:
        tensor = self._tensors.get(hf_name)
        return None if tensor is None else tensor.tensor_type

    def packed(self, hf_name: str) -> Int4Weight | Int8Weight | None:
        """The tensor as packed int4/int8, or None when its GGUF type has no packed form here."""
        tensor = self._tensors.get(hf_name)
        if tensor is None:
            return None
        qtype = tensor.tensor_type
        raw = np.asarray(tensor.data)
        weight: Int4Weight | Int8Weight
        if qtype in INT4_TYPES:
            weight = int4_from_blocks(raw, qtype)
        elif qtype in INT8_TYPES:
            weight = int8_from_blocks(raw, qtype)
        else:
            return None
        module = hf_name.rsplit(".", 2)[-2]
        if module in self._num_heads:  # llama.cpp stores q/k rows in its interleaved RoPE order
            weight = weight.rows(torch.from_numpy(rotary_row_order(weight.shape[0], self._num_heads[module])))
        return weight

"""What a llama.cpp GGUF file means: typed metadata access, tensor names, and the q/k row order.

Shared by the converter (``gguf_convert``, ``gguf_tokenizer``: GGUF -> Hugging Face directory) and by the
quantized loader (``common.quant.gguf_blocks``: GGUF blocks -> packed weights), so llama.cpp's
conventions are undone in exactly one place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader

# llama.cpp per-layer tensor suffix -> Hugging Face Llama module path inside `model.layers.{i}`.
LAYER_TENSOR_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFMetadata:
    """Typed access to a GGUF file's key/value metadata, with errors that name the missing key."""

    def __init__(self, reader: GGUFReader, path: Path) -> None:
        self._reader = reader
        self._path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self._reader.get_field(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        field = self._reader.get_field(key)
        if field is None:
            raise ValueError(f"{self._path}: GGUF metadata key {key!r} is missing")
        return field.contents()


def hf_tensor_name(name: str, num_layers: int) -> str:
    """The Hugging Face name of a GGUF tensor (``blk.3.attn_q.weight`` -> ``model.layers.3....``)."""
    if name in GLOBAL_TENSOR_NAMES:
        return GLOBAL_TENSOR_NAMES[name]
    prefix, _, rest = name.partition(".")
    layer, _, suffix = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and int(layer) < num_layers and suffix in LAYER_TENSOR_NAMES:
        return f"model.layers.{layer}.{LAYER_TENSOR_NAMES[suffix]}"
    raise ValueError(f"unsupported GGUF tensor {name!r} for a Llama model")


def rotary_row_order(rows: int, num_heads: int) -> np.ndarray:
    """Row index that undoes llama.cpp's q/k permutation: ``hf_rows = gguf_rows[order]``.

    llama.cpp's converter reorders each head's q/k rows from Hugging Face's "rotate half" layout
    (x0..x_{d/2-1}, y0..y_{d/2-1}) to interleaved pairs (x0, y0, x1, y1, ...) for its RoPE kernel. Rows
    are whole output channels, so the same index reorders float and packed (quantized) rows alike. numpy,
    not torch: the gateway converts the bundled model for its tokenizer and imports no torch.
    """
    half = rows // num_heads // 2
    return np.arange(rows).reshape(num_heads, half, 2).swapaxes(1, 2).reshape(rows)

"""``QuantizedEmbedding``: the token lookup of a tied model reading the LM head's packed int8 rows.

A tied model's embedding and LM head are one matrix. When the head runs GGUF's Q8_0 ``token_embd`` as
published, a float copy for the lookup would hold the largest matrix twice, and hold nothing the packed
rows do not: this module reads the rows it needs from the head's own buffers and dequantizes them, exactly
the converter's floats, and the float table is freed (113 MB of the bundled model's 211 in fp32).
"""

from __future__ import annotations

import torch
from torch import nn

from common.quant.linear import QuantizedLinear


class QuantizedEmbedding(nn.Module):
    """``forward(ids [n]) -> [n, hidden]`` in ``dtype`` from an int8 ``QuantizedLinear``'s ``q`` and ``scales``."""

    def __init__(self, head: QuantizedLinear, dtype: torch.dtype) -> None:
        super().__init__()
        if head.format != "int8":
            raise ValueError(f"a shared embedding needs int8 LM head rows, not {head.format}")
        # Shared, not copied, and not a submodule (the head is the model's ``lm_head``; registering it twice
        # would rename it in named_modules): a plain tuple, read at each call, so a move of the head's
        # buffers (``model.to``) is seen here too.
        self._head = (head,)
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._head[0].int8_rows(ids).to(self.dtype)  # [n, hidden]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows of the int8 LM head"

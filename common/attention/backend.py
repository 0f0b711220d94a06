"""The attention backend interface and its registry.

Every backend computes the same thing for a ragged batch (see ``AttentionMetadata``): write the new
tokens' K/V into the paged cache (when there is one), then attend each query token causally over its
sequence's context plus the new tokens (within the layer's sliding window, when it has one). Backends
differ only in how. Hardware-specific modules are
imported lazily, so ``import common`` works without CUDA, Triton, flash-attn or FlashInfer.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from common.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """One way to compute attention. Stateless apart from what ``__init__`` picks."""

    name: str = ""
    # Whether ``forward`` honours ``softcap`` (Gemma 2's attn_logit_softcapping: torch and triton); a model that
    # needs it refuses a backend without it at start (common/model/llama.py), naming the field and the backend.
    supports_softcap: bool = False
    # Whether a pure-decode ``forward`` can be captured in a CUDA graph (common/engine/cuda_graphs.py): it reads
    # lengths only from the metadata's tensors (host-side lengths at most bound a launch's size) and syncs nothing.
    capturable: bool = False

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention for one layer.

        query: [num_tokens, num_heads, head_dim]; key, value: [num_tokens, num_kv_heads, head_dim]
        kv_cache: (key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_dim], or
        None for a cache-less forward (then every sequence must have context_len 0).
        window: the layer's sliding window (None: the whole sequence); the token at position p attends to
        positions p - window + 1 .. p, as transformers' sliding-window mask.
        softcap: scaled scores become ``softcap * tanh(scores / softcap)`` before the mask (Gemma 2); only where
        ``supports_softcap``.
        Returns [num_tokens, num_heads, head_dim].
        """


# name -> "module:Class"; modules are imported only when their backend is chosen.
_REGISTRY: dict[str, str] = {
    "torch": "common.attention.torch_backend:TorchAttentionBackend",
    "triton": "common.attention.triton_backend:TritonAttentionBackend",
    "flash_attn": "common.attention.flash_attn_backend:FlashAttnBackend",
    "flashinfer": "common.attention.flashinfer_backend:FlashInferBackend",
}


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def get_backend(name: str, **kwargs: object) -> AttentionBackend:
    """Instantiate the backend called ``name``; a wrong name lists the choices."""
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"attention backend {name!r} is unknown; choose one of {', '.join(available_backends())}"
        ) from None
    module_name, class_name = target.split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    backend: AttentionBackend = cls(**kwargs)
    return backend

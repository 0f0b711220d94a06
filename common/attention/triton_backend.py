"""Triton attention: split-K paged decode and paged extend, for GPUs.

Dispatch: a decode-only batch goes to ``paged_decode``; anything else with a cache (prefill over a
cached prefix, chunked prefill, speculative verification, plain prefill into the cache) goes to
``paged_extend``, which reads the new tokens' K/V back from the cache they were just written to.
A cache-less prefill (no paged cache at all) has nothing to page through and uses PyTorch SDPA. Every path
takes the layer's window and Gemma 2's attention soft-cap.

On CPU the kernels run only under ``TRITON_INTERPRET=1``: correct, far too slow to serve. The
registry imports this module lazily, so ``import common.attention`` never imports Triton.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from common.attention.backend import AttentionBackend
from common.attention.torch_backend import prefill_attention
from common.kv.kv_cache import write_kv

if TYPE_CHECKING:
    from common.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with Triton kernels (CUDA, or the Triton interpreter in tests)."""

    name = "triton"
    supports_softcap = True  # Gemma 2's score cap in both kernels (HAS_SOFTCAP) and the cache-less SDPA path
    # paged_decode masks by the seq_lens tensor; max_seq_len only sizes its split-K grid (the capacity, captured)
    capturable = True

    def __init__(self) -> None:
        try:
            from common.kernels.triton import attention as triton_kernels
        except ImportError as exc:  # triton missing or broken
            raise RuntimeError(
                f"attention backend 'triton' needs the triton package ({exc}); use 'torch' instead"
            ) from exc
        if not torch.cuda.is_available() and not triton_kernels.INTERPRETED:
            raise RuntimeError(
                "attention backend 'triton' needs a CUDA GPU (or TRITON_INTERPRET=1 set before "
                "import, for tests only); use 'torch' on CPU"
            )
        if triton_kernels.INTERPRETED:
            logger.warning("Triton runs in interpreter mode: correct but very slow, not for serving")
        self._kernels = triton_kernels

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
        if kv_cache is None:
            if not meta.is_prefill_only:
                raise ValueError("sequences with cached context need a kv_cache")
            return prefill_attention(query, key, value, meta.query_lens_cpu, scale, window, softcap)
        key_cache, value_cache = kv_cache
        if meta.block_tables is None:
            raise ValueError("a paged kv_cache needs meta.block_tables")
        if meta.slot_mapping is not None:
            write_kv(key_cache, value_cache, key, value, meta.slot_mapping)
        if meta.is_decode_only and meta.num_tokens == meta.num_seqs:
            return self._kernels.paged_decode(
                query, key_cache, value_cache, meta.block_tables, meta.seq_lens, scale,
                max_seq_len=meta.max_seq_len, window=window, softcap=softcap,
            )
        return self._kernels.paged_extend(
            query, key_cache, value_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
            scale, max_query_len=meta.max_query_len, window=window, softcap=softcap,
        )

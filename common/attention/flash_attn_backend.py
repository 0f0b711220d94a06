"""flash-attn (FA2) attention on CUDA: the optional ``flash-attn`` extra (package ``flash_attn``).

- prefill-only batch: ``flash_attn_varlen_func`` on the fresh K/V, ``cu_seqlens = query_start_loc``.
- decode-only batch: ``flash_attn_with_kvcache`` reading the paged cache through the block tables.
- extend / chunked prefill over a cached prefix: ``flash_attn_varlen_func`` with ``block_table``.

FA2 reads a paged cache only when the page (block) size is a multiple of 256. Tandem's default
block size is 16, so for smaller blocks the paged parts go to Triton's ``paged_decode`` /
``paged_extend`` and flash-attn serves only fresh-KV prefill; the backend logs that once. Both
libraries read the cache through its strides (``KVCache.layer`` views are never copied); FA2
needs fp16/bf16 and causal masks aligned to the bottom right, which is Tandem's convention. A layer's
sliding window w is FA2's ``window_size=(w - 1, 0)``: each query sees itself and the w - 1 keys before it.
"""

from __future__ import annotations

import inspect
import logging
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from common.attention.backend import AttentionBackend
from common.kv.kv_cache import write_kv

if TYPE_CHECKING:
    from common.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

FA2_PAGE_MULTIPLE = 256  # flash-attn 2 paged KV: page_block_size % 256 == 0


class FlashAttnBackend(AttentionBackend):
    """flash-attn 2 kernels; Triton covers paged KV whose block size FA2 cannot page through."""

    name = "flash_attn"

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "attention backend 'flash_attn' needs a CUDA GPU; choose 'torch' (CPU) or 'triton' (GPU)"
            )
        try:
            import flash_attn
        except ImportError as exc:
            raise RuntimeError(
                "attention backend 'flash_attn' needs the flash-attn package (install the 'flash-attn' extra: "
                f"pip install 'tandem-serve[flash-attn]'): {exc}; or choose 'flashinfer', 'triton' or 'torch'"
            ) from exc
        self._varlen: Any = flash_attn.flash_attn_varlen_func
        self._with_kvcache: Any = flash_attn.flash_attn_with_kvcache
        # flash-attn >= 2.6 pages through block tables in the varlen kernel too (extend batches).
        self._varlen_pages = "block_table" in inspect.signature(self._varlen).parameters
        self._triton: ModuleType | None = None
        self._told_fallback = False

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
        assert softcap is None, "no attention soft-cap here: the model refuses it at start (supports_softcap)"
        if query.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"flash_attn computes in fp16/bf16, got {query.dtype}; use 'triton' or 'torch'")
        if kv_cache is not None and meta.slot_mapping is not None:
            write_kv(kv_cache[0], kv_cache[1], key, value, meta.slot_mapping)
        # (left, right) keys around each query's position; (-1, -1): unbounded.
        window_size = (-1, -1) if window is None else (window - 1, 0)
        if meta.is_prefill_only:
            # Fresh K/V: q, k, v: [num_tokens, heads, head_dim], the same cu_seqlens for both sides.
            cu_seqlens = meta.query_start_loc
            return self._varlen(
                query, key.to(query.dtype), value.to(query.dtype), cu_seqlens, cu_seqlens,
                meta.max_query_len, meta.max_query_len, softmax_scale=scale, causal=True, window_size=window_size,
            )
        if kv_cache is None or meta.block_tables is None:
            raise ValueError("sequences with cached context need kv_cache and meta.block_tables")
        key_cache, value_cache = kv_cache
        decode_only = meta.is_decode_only and meta.num_tokens == meta.num_seqs
        if key_cache.shape[1] % FA2_PAGE_MULTIPLE != 0 or not (decode_only or self._varlen_pages):
            return self._triton_paged(query, key_cache, value_cache, meta, scale, decode_only, window)
        if decode_only:
            # q: [num_seqs, 1, heads, head_dim]; cache_seqlens counts the token just written, and the
            # bottom-right causal mask lets the single query see all of them.
            out = self._with_kvcache(
                query.unsqueeze(1), key_cache, value_cache, cache_seqlens=meta.seq_lens,
                block_table=meta.block_tables, softmax_scale=scale, causal=True, window_size=window_size,
            )
            return out.squeeze(1)
        # cu_seqlens_k: [num_seqs + 1] int32, cumulative K/V lengths (context + new tokens).
        cu_seqlens_k = torch.zeros(meta.num_seqs + 1, dtype=torch.int32, device=query.device)
        torch.cumsum(meta.seq_lens, dim=0, out=cu_seqlens_k[1:])
        return self._varlen(
            query, key_cache, value_cache, meta.query_start_loc, cu_seqlens_k,
            meta.max_query_len, meta.max_seq_len, softmax_scale=scale, causal=True,
            block_table=meta.block_tables, window_size=window_size,
        )

    def _triton_paged(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        decode_only: bool,
        window: int | None,
    ) -> torch.Tensor:
        """Paged attention through Triton when FA2 cannot page through this cache."""
        assert meta.block_tables is not None
        if self._triton is None:
            from common.kernels.triton import attention as triton_kernels

            self._triton = triton_kernels
        if not self._told_fallback:
            self._told_fallback = True
            logger.info(
                "flash_attn pages KV only in blocks that are multiples of %d (this cache: %d, "
                "varlen paging: %s); paged attention runs on Triton, fresh-KV prefill on flash-attn",
                FA2_PAGE_MULTIPLE, key_cache.shape[1], self._varlen_pages,
            )
        if decode_only:
            out: torch.Tensor = self._triton.paged_decode(
                query, key_cache, value_cache, meta.block_tables, meta.seq_lens, scale,
                max_seq_len=meta.max_seq_len, window=window,
            )
            return out
        out = self._triton.paged_extend(
            query, key_cache, value_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
            scale, max_query_len=meta.max_query_len, window=window,
        )
        return out

"""FlashInfer attention on CUDA: paged decode / extend / prefill at any block size (the ``gpu`` extra,
package ``flashinfer-python``, installed from wheels; SGLang's default kernels).

- decode-only batch: ``BatchDecodeWithPagedKVCacheWrapper`` over the paged cache;
- extend / chunked prefill over a cached prefix (and plain prefill into the cache): the prefill wrapper
  over the paged cache, ``causal=True`` (FlashInfer aligns the mask bottom-right, Tandem's convention);
- cache-less prefill: the ragged prefill wrapper on the fresh K/V.

Unlike flash-attn 2 (pages only in multiples of 256 tokens), FlashInfer pages at Tandem's block size
(16 by default). It reads the cache as (key_cache, value_cache) in NHD layout
``[num_blocks, block_size, num_kv_heads, head_dim]`` through the ``KVCache.layer`` strided views (the page
stride spans all layers; nothing is copied). The block tables become FlashInfer's CSR page lists once per
forward (all layers of one window share one plan: a wrapper per kind and window, so a model mixing full and
sliding layers plans each once). A layer's sliding window w is FlashInfer's ``window_left=w - 1`` (each
query sees itself and the w - 1 keys before it; -1: unbounded). The Triton kernels are its reference in
tests/kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from common.attention.backend import AttentionBackend
from common.kv.kv_cache import write_kv

if TYPE_CHECKING:
    from common.attention.metadata import AttentionMetadata

WORKSPACE_BYTES = 256 * 2**20  # FlashInfer's scratch for split-K and plan metadata


class FlashInferBackend(AttentionBackend):
    """FlashInfer's batch paged kernels; one plan per forward, reused by every layer."""

    name = "flashinfer"

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            # ValueError: a caller mistake the CLI reports without a traceback (exit 2).
            raise ValueError(
                "--attention-backend flashinfer (TANDEM_ATTENTION_BACKEND) needs a CUDA GPU: FlashInfer has "
                "no CPU kernels; on CPU use --attention-backend torch"
            )
        try:
            import flashinfer
        except ImportError as exc:
            raise ValueError(
                "--attention-backend flashinfer needs the flashinfer-python package (install the 'gpu' extra: "
                f"pip install 'tandem-serve[gpu]'): {exc}; or choose triton or torch"
            ) from exc
        self._flashinfer: Any = flashinfer
        self._workspace: torch.Tensor | None = None
        # (kind, window) -> wrapper, and the metadata it is planned for (held, so an id is never reused)
        self._wrappers: dict[tuple[str, int | None], Any] = {}
        self._planned: dict[tuple[str, int | None], AttentionMetadata] = {}

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
            raise ValueError(f"flashinfer computes in fp16/bf16, got {query.dtype}; use 'triton' or 'torch'")
        if kv_cache is None:
            if not meta.is_prefill_only:
                raise ValueError("sequences with cached context need a kv_cache")
            wrapper = self._plan(meta, "ragged", query, key, None, scale, window)
            out: torch.Tensor = wrapper.run(query, key.to(query.dtype), value.to(query.dtype))
            return out
        key_cache, value_cache = kv_cache
        if meta.block_tables is None:
            raise ValueError("a paged kv_cache needs meta.block_tables")
        if meta.slot_mapping is not None:
            write_kv(key_cache, value_cache, key, value, meta.slot_mapping)
        decode_only = meta.is_decode_only and meta.num_tokens == meta.num_seqs
        wrapper = self._plan(meta, "decode" if decode_only else "paged", query, key_cache, key_cache, scale, window)
        out = wrapper.run(query, (key_cache, value_cache))
        return out

    # ------------------------------------------------------------------ planning

    def _wrapper(self, kind: str, window: int | None, device: torch.device) -> Any:
        if (kind, window) not in self._wrappers:
            if self._workspace is None:
                self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            fi = self._flashinfer
            cls = {"decode": fi.BatchDecodeWithPagedKVCacheWrapper, "paged": fi.BatchPrefillWithPagedKVCacheWrapper,
                   "ragged": fi.BatchPrefillWithRaggedKVCacheWrapper}[kind]
            self._wrappers[kind, window] = cls(self._workspace, "NHD")
        return self._wrappers[kind, window]

    def _plan(self, meta: AttentionMetadata, kind: str, query: torch.Tensor, key: torch.Tensor,
              key_cache: torch.Tensor | None, scale: float, window: int | None) -> Any:
        """The wrapper for ``kind`` and ``window``, planned for ``meta`` (once per forward: every layer shares the
        metadata)."""
        wrapper = self._wrapper(kind, window, query.device)
        if self._planned.get((kind, window)) is meta:
            return wrapper
        window_left = -1 if window is None else window - 1
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads = key.shape[-2]
        if kind == "ragged":
            wrapper.plan(meta.query_start_loc, meta.query_start_loc, num_heads, num_kv_heads, head_dim,
                         causal=True, sm_scale=scale, q_data_type=query.dtype, window_left=window_left)
        else:
            assert key_cache is not None and meta.block_tables is not None
            indptr, indices, last_page_len = paged_kv_pages(meta.block_tables, meta.seq_lens, key_cache.shape[1])
            common = {"sm_scale": scale, "q_data_type": query.dtype, "kv_data_type": key_cache.dtype,
                      "window_left": window_left}
            if kind == "decode":
                wrapper.plan(indptr, indices, last_page_len, num_heads, num_kv_heads, head_dim, key_cache.shape[1],
                             **common)
            else:
                wrapper.plan(meta.query_start_loc, indptr, indices, last_page_len, num_heads, num_kv_heads,
                             head_dim, key_cache.shape[1], causal=True, **common)
        self._planned[kind, window] = meta
        return wrapper


def paged_kv_pages(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tandem's block tables as FlashInfer's CSR page lists (all int32, on the tables' device).

    block_tables: [num_seqs, max_blocks] int32 (rows padded past each sequence's blocks); seq_lens: [num_seqs].
    Returns indptr [num_seqs + 1], indices [sum of blocks used], last_page_len [num_seqs] (1..block_size).
    """
    seq_lens = seq_lens.to(torch.int32)
    num_pages = (seq_lens + block_size - 1) // block_size
    used = torch.arange(block_tables.shape[1], device=block_tables.device)[None, :] < num_pages[:, None]
    indices = block_tables[used].to(torch.int32)  # row-major: sequence by sequence, in block order
    indptr = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=block_tables.device)
    torch.cumsum(num_pages, dim=0, out=indptr[1:])
    last_page_len = (seq_lens - (num_pages - 1) * block_size).to(torch.int32)
    return indptr, indices, last_page_len

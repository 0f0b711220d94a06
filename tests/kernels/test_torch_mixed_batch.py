"""The torch backend's mixed steps: one-token rows go through the decode path, chunks through extend."""

from __future__ import annotations

import torch

from common.attention.metadata import AttentionMetadata
from common.attention.torch_backend import TorchAttentionBackend, reference_paged_attention
from common.kv.kv_cache import KVCache, KVCacheSpec


def test_mixed_decode_and_extend_rows_match_the_reference() -> None:
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, bs = 6, 2, 16, 4
    cache = KVCache(KVCacheSpec(1, kv_heads, dim, bs, "float32"), num_blocks=64)
    cache.data.copy_(torch.randn(cache.data.shape, generator=g))
    query_lens = [1, 5, 1, 1, 3, 1]
    context_lens = [9, 0, 14, 3, 6, 0]
    perm = torch.randperm(64, generator=g).tolist()  # shuffled, non-contiguous tables
    tables, used = [], 0
    for q, c in zip(query_lens, context_lens, strict=True):
        n = -(-(q + c) // bs)
        tables.append(perm[used : used + n])
        used += n
    meta = AttentionMetadata.build(query_lens, context_lens, tables, bs)
    n = sum(query_lens)
    q = torch.randn(n, heads, dim, generator=g)
    k = torch.randn(n, kv_heads, dim, generator=g)
    v = torch.randn(n, kv_heads, dim, generator=g)
    out = TorchAttentionBackend().forward(q, k, v, cache.layer(0), meta, dim**-0.5)
    expected = reference_paged_attention(q, *cache.layer(0), meta, dim**-0.5)
    torch.testing.assert_close(out, expected.to(out.dtype), atol=1e-5, rtol=1e-5)

"""The torch backend's mixed steps: one-token rows and short chunks go through the decode path, long chunks through
extend."""

from __future__ import annotations

import torch

from common.attention.metadata import AttentionMetadata
from common.attention.torch_backend import EXTEND_AS_DECODE_ROWS, TorchAttentionBackend, reference_paged_attention
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


def _cache_and_tables(query_lens: list[int], context_lens: list[int], bs: int = 4, seed: int = 1
                      ) -> tuple[KVCache, list[list[int]], torch.Generator]:
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(KVCacheSpec(1, 2, 16, bs, "float32"), num_blocks=128)
    cache.data.copy_(torch.randn(cache.data.shape, generator=g))
    perm = torch.randperm(128, generator=g).tolist()
    tables, used = [], 0
    for q, c in zip(query_lens, context_lens, strict=True):
        n = -(-(q + c) // bs)
        tables.append(perm[used : used + n])
        used += n
    return cache, tables, g


def test_a_long_chunk_beside_short_ones_takes_the_extend_path_and_matches() -> None:
    query_lens = [EXTEND_AS_DECODE_ROWS + 7, 4, 1]
    context_lens = [5, 11, 20]
    cache, tables, g = _cache_and_tables(query_lens, context_lens)
    meta = AttentionMetadata.build(query_lens, context_lens, tables, 4)
    n = sum(query_lens)
    q, k, v = (torch.randn(n, h, 16, generator=g) for h in (6, 2, 2))
    out = TorchAttentionBackend().forward(q, k, v, cache.layer(0), meta, 0.25)
    expected = reference_paged_attention(q, *cache.layer(0), meta, 0.25)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_verification_rows_equal_plain_decode_rows() -> None:
    # A 5-token chunk over a cached prefix (speculative verification) gives, row for row, the bits plain
    # decoding gives for the same token at the same position.
    cache, tables, g = _cache_and_tables([5], [13])
    q, k, v = (torch.randn(5, h, 16, generator=g) for h in (6, 2, 2))
    backend = TorchAttentionBackend()
    together = backend.forward(q, k, v, cache.layer(0), AttentionMetadata.build([5], [13], tables, 4), 0.25)
    for j in range(5):
        meta = AttentionMetadata.build([1], [13 + j], tables, 4)
        alone = backend.forward(q[j : j + 1], k[j : j + 1], v[j : j + 1], cache.layer(0), meta, 0.25)
        assert torch.equal(alone[0], together[j])


def test_a_whole_prompt_beside_chunks_over_a_prefix_is_causal_and_matches() -> None:
    # A prompt with no cached context in a step with others' context takes the extend path, unmasked causal SDPA
    # (seq_len == q_len); with a window narrower than the prompt, the window's mask.
    query_lens = [EXTEND_AS_DECODE_ROWS + 9, EXTEND_AS_DECODE_ROWS + 3, 1]
    context_lens = [0, 10, 17]
    cache, tables, g = _cache_and_tables(query_lens, context_lens, seed=3)
    meta = AttentionMetadata.build(query_lens, context_lens, tables, 4)
    n = sum(query_lens)
    q, k, v = (torch.randn(n, h, 16, generator=g) for h in (6, 2, 2))
    backend = TorchAttentionBackend()
    out = backend.forward(q, k, v, cache.layer(0), meta, 0.25)
    torch.testing.assert_close(out, reference_paged_attention(q, *cache.layer(0), meta, 0.25), atol=1e-5, rtol=1e-5)
    for window in (8, query_lens[0]):
        out = backend.forward(q, k, v, cache.layer(0), meta, 0.25, window=window)
        expected = reference_paged_attention(q, *cache.layer(0), meta, 0.25, window=window)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)

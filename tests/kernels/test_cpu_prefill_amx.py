"""The AMX prefill / extend attention kernel (common/kernels/cpu/cpu_prefill_attn.cpp) against the float64 oracle,
and the torch backend's use of it for bf16 steps. Skipped where the CPU, the OS or the build has no AMX."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
import torch

from common.attention.metadata import AttentionMetadata
from common.attention.torch_backend import TorchAttentionBackend, paged_extend_attention, reference_paged_attention
from common.kernels.cpu import paged_decode_kernel
from common.kv.kv_cache import KVCache, KVCacheSpec

_module: ModuleType | None = paged_decode_kernel()
pytestmark = pytest.mark.skipif(_module is None or not _module.prefill_amx_ready(),
                                reason="no AMX here (or the compiled attention module does not build)")
kernel: Any = _module
NO_SKIP = torch.empty(0, dtype=torch.uint8)


def _batch(query_lens: list[int], context_lens: list[int], heads: int, kv_heads: int, dim: int, bs: int = 16,
           seed: int = 0) -> tuple[KVCache, AttentionMetadata, torch.Tensor, torch.Generator]:
    g = torch.Generator().manual_seed(seed)
    blocks = sum(-(-(q + c) // bs) for q, c in zip(query_lens, context_lens, strict=True)) + 3
    cache = KVCache(KVCacheSpec(2, kv_heads, dim, bs, "bfloat16"), num_blocks=blocks)
    cache.data.copy_(torch.randn(cache.data.shape, generator=g))
    perm = torch.randperm(blocks, generator=g).tolist()  # shuffled, non-contiguous tables
    tables, used = [], 0
    for q, c in zip(query_lens, context_lens, strict=True):
        n = -(-(q + c) // bs)
        tables.append(perm[used : used + n])
        used += n
    meta = AttentionMetadata.build(query_lens, context_lens, tables, bs)
    query = torch.randn(sum(query_lens), heads, dim, generator=g).bfloat16()
    return cache, meta, query, g


def _oracle(query: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float,
            window: int | None = None) -> torch.Tensor:
    k, v = cache.layer(1)
    return reference_paged_attention(query.double(), k.double(), v.double(), meta, scale, window).float()


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 128), (8, 1, 32), (16, 2, 256)])
@pytest.mark.parametrize(("query_lens", "context_lens"), [
    ([384], [0]),  # a whole prompt
    ([5, 17, 40, 1], [0, 30, 100, 7]),  # chunks over cached prefixes, lengths off the 16-row blocks
    ([600], [100]),  # more keys than one 512-key softmax chunk: the online rescale between chunks
])
def test_kernel_matches_the_oracle(heads: int, kv_heads: int, dim: int, query_lens: list[int],
                                   context_lens: list[int]) -> None:
    cache, meta, query, _ = _batch(query_lens, context_lens, heads, kv_heads, dim)
    scale = dim**-0.5
    got = kernel.paged_prefill(query, *cache.layer(1), meta.block_tables, meta.query_start_loc, meta.seq_lens,
                               NO_SKIP, scale, 0)
    want = _oracle(query, cache, meta, scale)
    # bf16 probabilities and output: within what PyTorch's own bf16 attention makes of the same inputs
    torch_bf16 = paged_extend_attention(query, *cache.layer(1), meta, scale).float()
    err, torch_err = (got.float() - want).abs().max().item(), (torch_bf16 - want).abs().max().item()
    assert err <= max(2 * torch_err, 1e-2), (err, torch_err)


def test_sliding_window_never_reads_freed_blocks() -> None:
    # Blocks wholly before every row's window are freed early (their table entries point at block 0, whose
    # bytes are another sequence's or garbage): here they hold NaN, which must not reach any output.
    query_lens, context_lens, window, bs = [40, 3], [200, 0], 50, 16
    cache, meta, query, _ = _batch(query_lens, context_lens, 6, 2, 64, bs=bs, seed=3)
    k, v = cache.layer(1)
    assert meta.block_tables is not None
    tables = meta.block_tables.clone()
    first_needed = (context_lens[0] - window + 1) // bs  # the block holding the first row's window start
    for b in tables[0, :first_needed].tolist():
        k[b] = float("nan")
        v[b] = float("nan")
    scale = 0.125
    got = kernel.paged_prefill(query, k, v, tables, meta.query_start_loc, meta.seq_lens, NO_SKIP, scale, window)
    assert not got.isnan().any()
    want = reference_paged_attention(query.double(), torch.nan_to_num(k.double()), torch.nan_to_num(v.double()),
                                     meta, scale, window).float()
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_skipped_sequences_are_left_to_the_caller() -> None:
    cache, meta, query, _ = _batch([20, 1, 33], [5, 40, 0], 9, 3, 64)
    skip = torch.tensor([0, 1, 0], dtype=torch.uint8)
    got = kernel.paged_prefill(query, *cache.layer(1), meta.block_tables, meta.query_start_loc, meta.seq_lens,
                               skip, 0.125, 0)
    full = kernel.paged_prefill(query, *cache.layer(1), meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                NO_SKIP, 0.125, 0)
    rows = torch.cat([torch.arange(0, 20), torch.arange(21, 54)])
    assert torch.equal(got[rows], full[rows])  # the others' rows do not depend on the skipped sequence


def test_bad_shapes_are_refused_with_the_field_named() -> None:
    cache, meta, query, _ = _batch([8], [0], 2, 1, 48)  # head_dim 48: not a multiple of 32
    with pytest.raises(RuntimeError, match="head_dim a multiple of 32"):
        kernel.paged_prefill(query, *cache.layer(1), meta.block_tables, meta.query_start_loc, meta.seq_lens,
                             NO_SKIP, 0.125, 0)
    cache, meta, query, _ = _batch([8], [0], 2, 1, 64)
    with pytest.raises(RuntimeError, match="query_start_loc and seq_lens"):
        kernel.paged_prefill(query, *cache.layer(1), meta.block_tables, meta.query_start_loc.long(),
                             meta.seq_lens, NO_SKIP, 0.125, 0)


def test_the_backend_runs_bf16_prefill_and_extend_steps_through_the_kernel() -> None:
    # A step of a whole prompt, a chunk over a prefix and decode rows, on a strided view of a qkv output (as
    # the layer passes it): the backend's bf16 result is the kernel's for the long rows and the decode
    # kernel's for the one-token rows; fp32 and softcapped calls keep PyTorch's path.
    heads, kv_heads, dim = 9, 3, 64
    query_lens, context_lens = [70, 1, 45, 1], [0, 30, 60, 12]
    cache, meta, _, g = _batch(query_lens, context_lens, heads, kv_heads, dim, seed=5)
    n = sum(query_lens)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=g).bfloat16()
    q = qkv[:, : heads * dim].view(n, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(n, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(n, kv_heads, dim)
    backend = TorchAttentionBackend()
    out = backend.forward(q, k, v, cache.layer(1), meta, 0.125)  # writes k, v into the cache first
    assert meta.block_tables is not None
    long_rows = torch.cat([torch.arange(0, 70), torch.arange(71, 116)])
    direct = kernel.paged_prefill(q, *cache.layer(1), meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                  torch.tensor([0, 1, 0, 1], dtype=torch.uint8), 0.125, 0)
    assert torch.equal(out[long_rows], direct[long_rows])
    want = _oracle(q, cache, meta, 0.125)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    prefill_meta = AttentionMetadata.build([70], [0], [meta.block_tables[0].tolist()], 16)
    whole = backend.forward(q[:70], k[:70], v[:70], cache.layer(1), prefill_meta.kv_written, 0.125)
    assert torch.equal(whole, direct[:70])  # prefill-only steps read the cache through the kernel too
    f32 = TorchAttentionBackend()._prefill_kernel(q.float(), cache.layer(1), meta, None)
    capped = TorchAttentionBackend()._prefill_kernel(q, cache.layer(1), meta, 30.0)
    assert f32 is None and capped is None

"""Sliding-window attention (Mistral, Qwen2/Qwen3's sliding layers) on every attention path against a dense
float64 oracle: the token at position p attends to positions p - window + 1 .. p (transformers' mask). The
flash-attn and FlashInfer cases run on a GPU only (the ``gpu`` marker: the GPU lease's test step).

The batches are test_attention_backends's (ragged, shuffled tables, NaN everywhere no sequence owns), with
windows shorter than some sequences and longer than others, block-aligned and not.
"""

from __future__ import annotations

import pytest
import torch

from common.attention.backend import get_backend
from common.attention.torch_backend import TorchAttentionBackend, reference_paged_attention
from common.kernels.cpu import paged_decode_kernel
from common.kernels.triton import attention as triton_kernels
from common.kv.kv_cache import write_kv
from tests.kernels.test_attention_backends import (
    BATCHES,
    TOLERANCE,
    TRITON_DEVICE,
    PagedBatch,
    assert_close,
    cpu_meta,
    dense_expected,
    make_batch,
    needs_triton,
    requires_cuda,
)

WINDOWS = [1, 5, 16, 33]


def check_window(backend_out: torch.Tensor, batch: PagedBatch, scale: float, window: int, dtype: torch.dtype) -> None:
    assert_close(backend_out, dense_expected(batch, scale, window), dtype)
    key_cache, value_cache = batch.kv_cache
    reference = reference_paged_attention(batch.query.cpu(), key_cache.cpu(), value_cache.cpu(),
                                          cpu_meta(batch.meta), scale, window)
    assert_close(backend_out, reference, dtype)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("kind", sorted(BATCHES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("compiled", [True, False], ids=["kernel", "torch"])
def test_torch_backend_window(window: int, kind: str, dtype: torch.dtype, compiled: bool) -> None:
    batch = make_batch(*BATCHES[kind], gqa=3, block_size=16, dtype=dtype)
    scale = batch.query.shape[-1] ** -0.5
    out = TorchAttentionBackend(compiled_decode=compiled).forward(batch.query, batch.key, batch.value,
                                                                 batch.kv_cache, batch.meta, scale, window)
    check_window(out, batch, scale, window, dtype)


@pytest.mark.parametrize("chunk_bytes", [1, 40_000])
def test_torch_decode_chunks_window(chunk_bytes: int) -> None:
    batch = make_batch(*BATCHES["decode"], gqa=4, block_size=16)
    out = TorchAttentionBackend(decode_chunk_bytes=chunk_bytes, compiled_decode=False).forward(
        batch.query, batch.key, batch.value, batch.kv_cache, batch.meta, 0.2, 7)
    check_window(out, batch, 0.2, 7, torch.float32)


@pytest.mark.parametrize("window", [1, 7, 16, 50])
@pytest.mark.parametrize("block_size", [4, 16])
def test_long_extend_chunk_window(window: int, block_size: int) -> None:
    """Chunks longer than EXTEND_AS_DECODE_ROWS over a cached prefix: the masked-SDPA path, which gathers only
    the blocks from the one holding its first row's window start (beside a short chunk: decode rows)."""
    batch = make_batch([40, 3, 35], [21, 30, 0], gqa=4, block_size=block_size)
    out = TorchAttentionBackend().forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.meta, 0.2,
                                          window)
    check_window(out, batch, 0.2, window, torch.float32)


@pytest.mark.parametrize("window", [1, 6, 100])
@pytest.mark.parametrize("gqa", [1, 3, 4])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("head_dim", [32, 64, 48])  # 32/64: the SIMD path (AVX2 and AVX-512); 48: the generic loop
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_decode_kernel_window(dtype: torch.dtype, head_dim: int, block_size: int, gqa: int,
                                       window: int) -> None:
    kernel = paged_decode_kernel()
    if kernel is None:
        pytest.skip("the compiled CPU kernel does not build here")
    batch = make_batch(*BATCHES["decode"], gqa=gqa, head_dim=head_dim, block_size=block_size, dtype=dtype)
    key_cache, value_cache = batch.kv_cache
    assert batch.meta.slot_mapping is not None
    write_kv(key_cache, value_cache, batch.key, batch.value, batch.meta.slot_mapping)
    scale = head_dim**-0.5
    out = kernel.paged_decode(batch.query.contiguous(), key_cache, value_cache, batch.meta.block_tables,
                              batch.meta.seq_lens, scale, window)
    want = reference_paged_attention(batch.query, key_cache, value_cache, batch.meta, scale, window)
    torch.testing.assert_close(out.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_decode_window_covering_the_sequence_is_bit_identical(dtype: torch.dtype) -> None:
    """window 0 (none) and a window at least every seq_len read the same positions: the same bits."""
    kernel = paged_decode_kernel()
    if kernel is None:
        pytest.skip("the compiled CPU kernel does not build here")
    batch = make_batch(*BATCHES["decode"], gqa=3, head_dim=64, block_size=16, dtype=dtype)
    key_cache, value_cache = batch.kv_cache
    assert batch.meta.slot_mapping is not None
    write_kv(key_cache, value_cache, batch.key, batch.value, batch.meta.slot_mapping)
    args = (batch.query.contiguous(), key_cache, value_cache, batch.meta.block_tables, batch.meta.seq_lens, 0.125)
    assert torch.equal(kernel.paged_decode(*args, 0), kernel.paged_decode(*args, batch.meta.max_seq_len))


@needs_triton
@pytest.mark.parametrize("window", [1, 5, 40])
@pytest.mark.parametrize(("num_splits", "tile"), [(1, 16), (3, 16), (None, 64)])
def test_triton_paged_decode_window(window: int, num_splits: int | None, tile: int) -> None:
    batch = make_batch(*BATCHES["decode"], gqa=3, block_size=16, head_dim=16, device=TRITON_DEVICE)
    assert batch.meta.slot_mapping is not None and batch.meta.block_tables is not None
    write_kv(*batch.kv_cache, batch.key, batch.value, batch.meta.slot_mapping)
    out = triton_kernels.paged_decode(batch.query, *batch.kv_cache, batch.meta.block_tables, batch.meta.seq_lens,
                                      0.25, num_splits, tile_size=tile, window=window)
    assert_close(out, dense_expected(batch, 0.25, window), torch.float32)


@needs_triton
@pytest.mark.parametrize("window", [1, 5, 40])
@pytest.mark.parametrize("tile", [16, 32])
def test_triton_paged_extend_window(window: int, tile: int) -> None:
    batch = make_batch(*BATCHES["extend"], gqa=4, block_size=16, head_dim=16, device=TRITON_DEVICE)
    meta = batch.meta
    assert meta.slot_mapping is not None and meta.block_tables is not None
    write_kv(*batch.kv_cache, batch.key, batch.value, meta.slot_mapping)
    out = triton_kernels.paged_extend(batch.query, *batch.kv_cache, meta.block_tables, meta.query_start_loc,
                                      meta.seq_lens, 0.25, max_query_len=meta.max_query_len, tile_size=tile,
                                      window=window)
    assert_close(out, dense_expected(batch, 0.25, window), torch.float32)


@needs_triton
@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_triton_backend_window(kind: str) -> None:
    batch = make_batch(*BATCHES[kind], gqa=3, block_size=16, head_dim=16, device=TRITON_DEVICE)
    out = get_backend("triton").forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.meta, 0.25, 6)
    check_window(out, batch, 0.25, 6, torch.float32)


@pytest.mark.parametrize("name", ["torch", pytest.param("triton", marks=needs_triton)])
def test_cacheless_prefill_window(name: str) -> None:
    batch = make_batch(*BATCHES["prefill"], gqa=3)
    out = get_backend(name).forward(batch.query, batch.key, batch.value, None, batch.meta, 0.25, 4)
    assert_close(out, dense_expected(batch, 0.25, 4), torch.float32)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("window", [1, 6, 40])
@pytest.mark.parametrize("kind", sorted(BATCHES))
@pytest.mark.parametrize(("name", "block_size"), [("flashinfer", 16), ("flash_attn", 16), ("flash_attn", 256)])
def test_gpu_backends_window(name: str, block_size: int, kind: str, window: int) -> None:
    """FlashInfer's window_left and flash-attn's window_size (block 256: FA2 pages; 16: Triton's paged kernels)."""
    pytest.importorskip("flashinfer" if name == "flashinfer" else "flash_attn")
    batch = make_batch(*BATCHES[kind], gqa=3, block_size=block_size, dtype=torch.bfloat16, head_dim=64,
                       device="cuda")
    scale = 0.125
    out = get_backend(name).forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.meta, scale, window)
    check_window(out, batch, scale, window, torch.bfloat16)

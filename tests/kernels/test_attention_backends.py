"""Every attention backend against a dense causal oracle and ``reference_paged_attention``.

Batches are ragged, block tables shuffled, contexts not multiples of the block size, and every byte
of the cache that no sequence owns (the other layer, slots past seq_len, the blocks that unused
table entries point at) is NaN: a kernel that reads one unmasked value fails loudly. Triton runs in
its CPU interpreter here (see conftest.py), so its shapes stay small.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.attention.backend import AttentionBackend, get_backend
from common.attention.metadata import AttentionMetadata
from common.attention.torch_backend import TorchAttentionBackend, reference_paged_attention
from common.kernels.cpu import paged_decode_kernel
from common.kernels.triton import attention as triton_kernels
from common.kv.kv_cache import KVCache, KVCacheSpec, write_kv

REPO_ROOT = Path(__file__).resolve().parents[2]
HAS_CUDA = torch.cuda.is_available()
TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"
needs_triton = pytest.mark.skipif(
    not HAS_CUDA and not triton_kernels.INTERPRETED,
    reason="no GPU, and Triton was imported before TRITON_INTERPRET=1 was set",
)
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # atol == rtol
# (query_lens, context_lens): ragged, contexts off block boundaries, one fresh and one decode
# sequence inside the extend batch.
BATCHES = {
    "prefill": ([7, 1, 23, 16], [0, 0, 0, 0]),
    "decode": ([1, 1, 1, 1, 1], [37, 5, 70, 16, 0]),
    "extend": ([3, 1, 20, 7], [29, 50, 13, 0]),
}
HEADS = {1: (4, 4), 3: (6, 2), 4: (8, 2)}  # GQA ratio -> (num_heads, num_kv_heads)


@dataclass
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim], the new tokens only
    value: torch.Tensor
    cache: KVCache  # context K/V already written to layer 1; everything else NaN
    meta: AttentionMetadata
    dense_keys: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim]: context + new
    dense_values: list[torch.Tensor]

    @property
    def kv_cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        # Layer 1 of 2: the views' block stride spans both layers, as in serving.
        return self.cache.layer(1)


def make_batch(
    query_lens: list[int],
    context_lens: list[int],
    gqa: int,
    *,
    head_dim: int = 32,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
) -> PagedBatch:
    num_heads, num_kv_heads = HEADS[gqa]
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 3
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    owned, spare = ids[: sum(needed)], ids[sum(needed) :]
    width = max(needed) + 1
    tables, at = [], 0
    for n in needed:
        # Unused entries point at never-written NaN blocks, never at a block someone owns.
        tables.append(owned[at : at + n] + [spare[j % len(spare)] for j in range(width - n)])
        at += n
    spec = KVCacheSpec(2, num_kv_heads, head_dim, block_size, str(dtype).removeprefix("torch."))
    cache = KVCache(spec, num_blocks, device)
    cache.data.fill_(float("nan"))
    meta = AttentionMetadata.build(query_lens, context_lens, tables, block_size, device)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    dense_keys = [randn(s, num_kv_heads, head_dim) for s in seq_lens]
    dense_values = [randn(s, num_kv_heads, head_dim) for s in seq_lens]
    for table, ctx, k, v in zip(tables, context_lens, dense_keys, dense_values, strict=True):
        positions = range(ctx)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in positions],
                             dtype=torch.int64)
        write_kv(*cache.layer(1), k[:ctx], v[:ctx], slots.to(device))
    key = torch.cat([k[c:] for k, c in zip(dense_keys, context_lens, strict=True)])
    value = torch.cat([v[c:] for v, c in zip(dense_values, context_lens, strict=True)])
    query = randn(sum(query_lens), num_heads, head_dim)
    return PagedBatch(query, key, value, cache, meta, dense_keys, dense_values)


def dense_causal_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """float64 attention of the last q_len positions of one sequence over all of it.

    query: [q_len, num_heads, D]; keys, values: [seq_len, num_kv_heads, D]; query row i sits at
    position seq_len - q_len + i and sees keys 0..that position (``window``: only the last ``window`` of them,
    position - window + 1 .. position). ``softcap``: scores -> softcap * tanh(scores / softcap) (Gemma 2).
    """
    q_len, seq_len = query.shape[0], keys.shape[0]
    group = query.shape[1] // keys.shape[1]
    k = keys.double().cpu().repeat_interleave(group, dim=1)
    v = values.double().cpu().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double().cpu(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    position = torch.arange(q_len)[:, None] + seq_len - q_len
    cols = torch.arange(seq_len)[None, :]
    hidden = cols > position if window is None else (cols > position) | (cols <= position - window)
    scores.masked_fill_(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def dense_expected(batch: PagedBatch, scale: float, window: int | None = None,
                   softcap: float | None = None) -> torch.Tensor:
    outs, start = [], 0
    for i, q_len in enumerate(batch.meta.query_lens_cpu):
        q = batch.query[start : start + q_len]
        outs.append(dense_causal_attention(q, batch.dense_keys[i], batch.dense_values[i], scale, window, softcap))
        start += q_len
    return torch.cat(outs)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not actual.isnan().any(), "NaN in the output: a masked (garbage) slot was read"
    # On GPUs 16-bit kernels also round P to 16 bits before P.V (the interpreter computes in fp32).
    tol = TOLERANCE[dtype] * (2.5 if actual.is_cuda and dtype != torch.float32 else 1.0)
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), atol=tol, rtol=tol)


def check_backend(backend: AttentionBackend, batch: PagedBatch, dtype: torch.dtype) -> None:
    """Forward writes the new K/V, then must match both the dense oracle and the paged reference."""
    scale = batch.query.shape[-1] ** -0.5
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.meta, scale)
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    assert_close(out, dense_expected(batch, scale), dtype)
    key_cache, value_cache = batch.kv_cache
    reference = reference_paged_attention(batch.query.cpu(), key_cache.cpu(), value_cache.cpu(),
                                          cpu_meta(batch.meta), scale)
    assert_close(out, reference, dtype)


def cpu_meta(meta: AttentionMetadata) -> AttentionMetadata:
    assert meta.block_tables is not None
    return AttentionMetadata(meta.query_start_loc.cpu(), meta.seq_lens.cpu(), meta.context_lens.cpu(),
                             meta.block_tables.cpu(), None, meta.query_lens_cpu, meta.seq_lens_cpu)


# --- the oracle itself ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_reference_matches_dense(kind: str) -> None:
    batch = make_batch(*BATCHES[kind], gqa=3, block_size=16)
    assert batch.meta.slot_mapping is not None
    write_kv(*batch.kv_cache, batch.key, batch.value, batch.meta.slot_mapping)
    scale = 0.2
    out = reference_paged_attention(batch.query, *batch.kv_cache, batch.meta, scale)
    assert_close(out, dense_expected(batch, scale), torch.float32)


# --- torch ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(BATCHES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gqa", sorted(HEADS))
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("compiled", [True, False], ids=["kernel", "torch"])
def test_torch_backend(kind: str, dtype: torch.dtype, gqa: int, block_size: int, compiled: bool) -> None:
    """Decode steps go through the compiled CPU kernel (cpu_decode.cpp) or the pure-PyTorch path."""
    batch = make_batch(*BATCHES[kind], gqa=gqa, block_size=block_size, dtype=dtype)
    check_backend(TorchAttentionBackend(compiled_decode=compiled), batch, dtype)


# A chunk longer than EXTEND_AS_DECODE_ROWS: the masked extend path, not decode rows.
SOFTCAP_BATCHES = {**BATCHES, "long-extend": ([40, 3, 1], [10, 21, 6])}


@pytest.mark.parametrize("kind", sorted(SOFTCAP_BATCHES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("compiled", [True, False], ids=["kernel", "torch"])
def test_torch_backend_attention_softcap(kind: str, dtype: torch.dtype, window: int | None, compiled: bool) -> None:
    """Gemma 2's attention soft-cap on every path of the torch backend (prefill, decode rows, the masked extend;
    with the compiled decode kernel available or not: a soft-capped decode takes the PyTorch path)."""
    batch = make_batch(*SOFTCAP_BATCHES[kind], gqa=3, block_size=16, dtype=dtype)
    check_softcap(TorchAttentionBackend(compiled_decode=compiled), batch, dtype, window)


def check_softcap(backend: AttentionBackend, batch: PagedBatch, dtype: torch.dtype, window: int | None) -> None:
    """The backend's soft-capped attention against the dense oracle and the paged reference; a cap of 0.5 on
    scores of about N(0, 1) changes the output."""
    assert backend.supports_softcap
    scale, softcap = batch.query.shape[-1] ** -0.5, 0.5
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.meta, scale, window, softcap)
    assert_close(out, dense_expected(batch, scale, window, softcap), dtype)
    key_cache, value_cache = batch.kv_cache
    reference = reference_paged_attention(batch.query.cpu(), key_cache.cpu(), value_cache.cpu(),
                                          cpu_meta(batch.meta), scale, window, softcap)
    assert_close(out, reference, dtype)
    uncapped = dense_expected(batch, scale, window)
    assert (out.double().cpu() - uncapped).abs().max() > 0.05


@pytest.mark.skipif(shutil.which("c++") is None or shutil.which("ninja") is None, reason="no C++ compiler or ninja")
def test_compiled_decode_kernel_builds_here() -> None:
    """Where a compiler exists the kernel must build, or the 'kernel' tests above silently test the torch path."""
    assert paged_decode_kernel() is not None


# Sequences over several of the kernel's 32-token chunks and its 64-token prefetch reach, each followed by a
# shorter one (the prefetch of the next sequence's first rows as a sweep ends), and one token alone.
LONG_DECODE = ([1, 1, 1, 1, 1], [130, 2, 99, 63, 0])


@pytest.mark.parametrize("kind", ["decode", "long-decode"])
@pytest.mark.parametrize("gqa", [1, 3, 4])  # query heads per KV head: 1-4 share a sweep over V (2 at 128)
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("head_dim", [32, 64, 128])  # 64 and 128: the AVX-512 register-blocked path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_decode_kernel_against_reference(dtype: torch.dtype, head_dim: int, block_size: int,
                                                  gqa: int, kind: str) -> None:
    kernel = paged_decode_kernel()
    if kernel is None:
        pytest.skip("the compiled CPU kernel does not build here")
    shape = BATCHES["decode"] if kind == "decode" else LONG_DECODE
    batch = make_batch(*shape, gqa=gqa, head_dim=head_dim, block_size=block_size, dtype=dtype)
    key_cache, value_cache = batch.kv_cache
    write_kv(key_cache, value_cache, batch.key, batch.value, batch.meta.slot_mapping)
    want = reference_paged_attention(batch.query, key_cache, value_cache, batch.meta, batch.query.shape[-1] ** -0.5)
    # paged_decode_widened: bf16 K rows widened to fp32 even where the CPU has AVX512-BF16 (paged_decode's
    # scores there are vdpbf16ps sums of bf16 pairs): both paths on this machine
    for decode in (kernel.paged_decode, kernel.paged_decode_widened):
        for lens in (batch.meta.seq_lens.long(), batch.meta.seq_lens.int()):  # the metadata's int32 as it is
            out = decode(batch.query.contiguous(), key_cache, value_cache, batch.meta.block_tables,
                         lens, batch.query.shape[-1] ** -0.5, 0)
            torch.testing.assert_close(out.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_the_avx2_build_of_the_decode_kernel_on_an_avx512_machine() -> None:
    # The kernel module is built for the widest ISA this CPU runs; the AVX2 build's SIMD path (other
    # vector width, other reductions) is checked in a process that forces it, as AVX2 machines run it.
    from common.kernels.isa import runnable_isas

    if "avx2" not in runnable_isas() or runnable_isas()[0] == "avx2":
        pytest.skip("this machine runs the AVX2 build in the test above already, or cannot run it")
    script = (
        "import torch, sys; sys.path.insert(0, 'tests/kernels'); sys.path.insert(0, '.');"
        "from test_attention_backends import BATCHES, LONG_DECODE, make_batch, TOLERANCE;"
        "from common.kernels.cpu import paged_decode_kernel;"
        "from common.attention.torch_backend import reference_paged_attention;"
        "from common.kv.kv_cache import write_kv;"
        "k = paged_decode_kernel(); assert k is not None and 'avx2' in k.__name__, k\n"
        "for dtype in (torch.float32, torch.bfloat16):\n"
        "  for head_dim in (32, 64, 128):\n"
        "   for shape in (BATCHES['decode'], LONG_DECODE):\n"
        "    b = make_batch(*shape, gqa=3, head_dim=head_dim, block_size=5, dtype=dtype)\n"
        "    kc, vc = b.kv_cache; write_kv(kc, vc, b.key, b.value, b.meta.slot_mapping)\n"
        "    sc = head_dim ** -0.5\n"
        "    out = k.paged_decode(b.query.contiguous(), kc, vc, b.meta.block_tables, b.meta.seq_lens, sc, 0)\n"
        "    want = reference_paged_attention(b.query, kc, vc, b.meta, sc)\n"
        "    torch.testing.assert_close(out.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])\n"
        "print('ok')"
    )
    env = {**os.environ, "TANDEM_CPU_ISA": "avx2"}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_write_kv_equals_the_torch_scatter(dtype: torch.dtype) -> None:
    kernel = paged_decode_kernel()
    if kernel is None:
        pytest.skip("the compiled CPU kernel does not build here")
    cache = KVCache(KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=8, block_size=4, dtype_name=str(dtype)[6:]), 6)
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, 4 * 8 + 2 * 3 * 8, generator=gen).to(dtype)  # k and v as strided views of a projection
    key = qkv[:, 32:56].view(5, 3, 8)
    value = qkv[:, 56:].view(5, 3, 8)
    slots = torch.tensor([0, 5, 6, 23, 13])
    want = cache.data.clone()
    write_kv(want[:, 1, 0], want[:, 1, 1], key, value, slots)
    kernel.write_kv(*cache.layer(1), key, value, slots)
    assert torch.equal(cache.data, want)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel.write_kv(*cache.layer(1), key[:1], value[:1], torch.tensor([24]))


def test_compiled_decode_kernel_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")
    assert paged_decode_kernel() is None


def test_torch_backend_fp16_decode_takes_the_torch_path() -> None:
    """The kernel serves fp32 and bf16; fp16 on CPU still decodes correctly (through PyTorch)."""
    batch = make_batch(*BATCHES["decode"], gqa=3, block_size=16, dtype=torch.float16)
    check_backend(TorchAttentionBackend(), batch, torch.float16)


@pytest.mark.parametrize("chunk_bytes", [1, 40_000])
def test_torch_decode_chunks(chunk_bytes: int) -> None:
    """One sequence per chunk, and chunks of a few padded sequences, give the same answer."""
    batch = make_batch(*BATCHES["decode"], gqa=4, block_size=16)
    check_backend(TorchAttentionBackend(decode_chunk_bytes=chunk_bytes, compiled_decode=False), batch, torch.float32)


@pytest.mark.parametrize("name", ["torch", pytest.param("triton", marks=needs_triton)])
def test_cacheless_prefill(name: str) -> None:
    batch = make_batch(*BATCHES["prefill"], gqa=3)
    out = get_backend(name).forward(batch.query, batch.key, batch.value, None, batch.meta, 0.25)
    assert_close(out, dense_expected(batch, 0.25), torch.float32)


# --- triton kernels (interpreter on CPU) --------------------------------------------------------

DECODE_CASES = [
    # gqa, block_size, dtype, num_splits, head_dim, tile_size
    (1, 16, torch.float32, 1, 32, 64),
    (3, 16, torch.float32, 3, 32, 64),
    (4, 32, torch.float32, 2, 16, 16),  # tile smaller than a block
    (3, 32, torch.float16, 3, 32, 32),
    (4, 16, torch.float16, None, 24, 64),  # heuristic splits, head_dim padded 24 -> 32
    (3, 16, torch.bfloat16, 2, 32, 64),
]


@needs_triton
@pytest.mark.parametrize(("gqa", "block_size", "dtype", "num_splits", "head_dim", "tile"), DECODE_CASES)
def test_triton_paged_decode(
    gqa: int, block_size: int, dtype: torch.dtype, num_splits: int | None, head_dim: int, tile: int
) -> None:
    batch = make_batch(*BATCHES["decode"], gqa=gqa, block_size=block_size, dtype=dtype,
                       head_dim=head_dim, device=TRITON_DEVICE)
    assert batch.meta.slot_mapping is not None and batch.meta.block_tables is not None
    write_kv(*batch.kv_cache, batch.key, batch.value, batch.meta.slot_mapping)
    scale = head_dim**-0.5
    out = triton_kernels.paged_decode(batch.query, *batch.kv_cache, batch.meta.block_tables,
                                      batch.meta.seq_lens, scale, num_splits, tile_size=tile)
    assert_close(out, dense_expected(batch, scale), dtype)


EXTEND_CASES = [
    # gqa, block_size, dtype, head_dim, tile_size, pass max_query_len
    (1, 16, torch.float32, 32, 32, True),
    (3, 32, torch.float32, 16, 16, True),
    (4, 16, torch.float16, 32, 64, False),  # grid sized from num_tokens
    (3, 32, torch.float16, 24, 32, True),
    (4, 32, torch.bfloat16, 32, 32, True),
]


@needs_triton
@pytest.mark.parametrize(("gqa", "block_size", "dtype", "head_dim", "tile", "hint"), EXTEND_CASES)
def test_triton_paged_extend(
    gqa: int, block_size: int, dtype: torch.dtype, head_dim: int, tile: int, hint: bool
) -> None:
    batch = make_batch(*BATCHES["extend"], gqa=gqa, block_size=block_size, dtype=dtype,
                       head_dim=head_dim, device=TRITON_DEVICE)
    meta = batch.meta
    assert meta.slot_mapping is not None and meta.block_tables is not None
    write_kv(*batch.kv_cache, batch.key, batch.value, meta.slot_mapping)
    scale = head_dim**-0.5
    out = triton_kernels.paged_extend(
        batch.query, *batch.kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale,
        max_query_len=meta.max_query_len if hint else None, tile_size=tile,
    )
    assert_close(out, dense_expected(batch, scale), dtype)


@needs_triton
@pytest.mark.parametrize("kind", sorted(BATCHES))
@pytest.mark.parametrize(("gqa", "block_size", "dtype"), [(3, 16, torch.float32), (4, 32, torch.float16)])
def test_triton_backend(kind: str, gqa: int, block_size: int, dtype: torch.dtype) -> None:
    batch = make_batch(*BATCHES[kind], gqa=gqa, block_size=block_size, dtype=dtype, device=TRITON_DEVICE)
    check_backend(get_backend("triton"), batch, dtype)


@needs_triton
@pytest.mark.parametrize("kind", sorted(SOFTCAP_BATCHES))
@pytest.mark.parametrize("window", [None, 5])
def test_triton_backend_attention_softcap(kind: str, window: int | None) -> None:
    """Gemma 2's soft-cap in the Triton decode and extend kernels (HAS_SOFTCAP), with and without a window."""
    batch = make_batch(*SOFTCAP_BATCHES[kind], gqa=3, block_size=16, device=TRITON_DEVICE)
    check_softcap(get_backend("triton"), batch, torch.float32, window)


def test_num_splits_heuristic() -> None:
    # A batch that already fills the GPU is not split; one long sequence is, within bounds.
    assert triton_kernels.choose_num_splits(256, 8, 4096, 64, num_sms=132) == 1
    one_long = triton_kernels.choose_num_splits(1, 8, 32768, 64, num_sms=132)
    assert 1 < one_long <= triton_kernels.MAX_SPLITS and one_long & (one_long - 1) == 0
    assert triton_kernels.choose_num_splits(4, 8, 1024, 64, num_sms=132) == 8  # 16 tiles // 2
    assert triton_kernels.choose_num_splits(1, 8, 100, 64, num_sms=132) == 1  # two tiles: no split


# Random ragged batches: q_len 1..20 on top of 0..60 cached tokens, any GQA ratio and block size.
ragged_batches = st.lists(st.tuples(st.integers(1, 20), st.integers(0, 60)), min_size=1, max_size=4)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seqs=ragged_batches, gqa=st.sampled_from(sorted(HEADS)), block_size=st.sampled_from([8, 16, 32]))
def test_torch_backend_random_batches(seqs: list[tuple[int, int]], gqa: int, block_size: int) -> None:
    batch = make_batch([q for q, _ in seqs], [c for _, c in seqs], gqa=gqa, block_size=block_size)
    check_backend(TorchAttentionBackend(), batch, torch.float32)


@needs_triton
@settings(max_examples=15, deadline=None, derandomize=True)
@given(seqs=ragged_batches, gqa=st.sampled_from(sorted(HEADS)), block_size=st.sampled_from([8, 16, 32]))
def test_triton_backend_random_batches(seqs: list[tuple[int, int]], gqa: int, block_size: int) -> None:
    batch = make_batch([q for q, _ in seqs], [c for _, c in seqs], gqa=gqa, block_size=block_size,
                       head_dim=16, device=TRITON_DEVICE)
    check_backend(get_backend("triton"), batch, torch.float32)


# --- the semantic contract: write through slot_mapping, attend, equals dense attention -----------


@pytest.mark.parametrize("name", ["torch", pytest.param("triton", marks=needs_triton)])
def test_chunked_prefill_then_decode_equals_dense(name: str) -> None:
    """Prompts prefilled in two chunks, then three decode steps, through forward() alone.

    Every step writes its tokens via slot_mapping and attends over the cache; together the outputs
    must equal one dense causal attention over each full sequence.
    """
    device = TRITON_DEVICE if name == "triton" else "cpu"
    backend = get_backend(name)
    prompt_lens, first_chunk, decode_steps = [23, 9, 40], [13, 9, 16], 3
    total = [p + decode_steps for p in prompt_lens]
    block_size, (num_heads, num_kv_heads), head_dim, scale = 16, HEADS[3], 32, 0.3
    gen = torch.Generator().manual_seed(1)
    q_all = [torch.randn(n, num_heads, head_dim, generator=gen) for n in total]
    k_all = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in total]
    v_all = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in total]
    cache = KVCache(KVCacheSpec(2, num_kv_heads, head_dim, block_size, "float32"), 16, device)
    cache.data.fill_(float("nan"))
    tables = [[9, 2, 14], [5, 0, 11], [7, 3, 12, 1]]  # out of order, one spare entry each
    outs: list[list[torch.Tensor]] = [[] for _ in total]
    done = [0, 0, 0]
    steps = [first_chunk, [p - c for p, c in zip(prompt_lens, first_chunk, strict=True)]]
    steps += [[1, 1, 1]] * decode_steps
    for query_lens in steps:
        ids = [i for i, n in enumerate(query_lens) if n]  # a finished prompt sits a chunk out
        meta = AttentionMetadata.build([query_lens[i] for i in ids], [done[i] for i in ids],
                                       [tables[i] for i in ids], block_size, device)
        pick = [(i, slice(done[i], done[i] + query_lens[i])) for i in ids]
        q, k, v = (torch.cat([t[i][s] for i, s in pick]).to(device) for t in (q_all, k_all, v_all))
        out = backend.forward(q, k, v, cache.layer(1), meta, scale).cpu()
        start = 0
        for i, s in pick:
            outs[i].append(out[start : start + s.stop - s.start])
            start += s.stop - s.start
            done[i] = s.stop
    for i in range(len(total)):
        expected = dense_causal_attention(q_all[i], k_all[i], v_all[i], scale)
        assert_close(torch.cat(outs[i]), expected, torch.float32)


# --- registry and optional backends -----------------------------------------------------------


def test_unknown_backend_lists_choices() -> None:
    with pytest.raises(ValueError, match="unknown") as info:
        get_backend("xformers")
    for choice in ("torch", "triton", "flash_attn"):
        assert choice in str(info.value)


def _run_python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_importing_backends_does_not_import_triton() -> None:
    result = _run_python(
        "import sys, common.attention, common.attention.backend, common.attention.torch_backend\n"
        "assert 'triton' not in sys.modules, 'triton imported eagerly'"
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only refusal")
def test_triton_without_gpu_or_interpreter_refuses() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = _run_python(
        "from common.attention.backend import get_backend\n"
        "try:\n    get_backend('triton')\nexcept RuntimeError as e:\n    print(e)\n", env
    )
    assert result.returncode == 0, result.stderr
    assert "'torch'" in result.stdout


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only refusal")
def test_flash_attn_without_cuda_refuses() -> None:
    with pytest.raises(RuntimeError, match="CUDA") as info:
        get_backend("flash_attn")
    assert "'torch'" in str(info.value) and "'triton'" in str(info.value)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("kind", sorted(BATCHES))
@pytest.mark.parametrize("block_size", [16, 256])  # 16: paged parts on Triton; 256: FA2 pages
def test_flash_attn_backend(kind: str, block_size: int) -> None:
    pytest.importorskip("flash_attn")
    batch = make_batch(*BATCHES[kind], gqa=3, block_size=block_size, dtype=torch.bfloat16,
                       head_dim=64, device="cuda")
    check_backend(get_backend("flash_attn"), batch, torch.bfloat16)

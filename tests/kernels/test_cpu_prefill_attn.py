"""The compiled prefill / extend attention kernel (common/kernels/cpu/cpu_prefill_attn.cpp) against the float64 oracle,
and the torch backend's use of it: bf16 in AMX tiles (skipped where the CPU, the OS or the build has no AMX), bf16 in
AVX512-BF16 vectors (the path of CPUs with it and without AMX; skipped where the CPU lacks it), fp32 in FMA vectors,
and bf16 widened to fp32 vectors (the path of CPUs with neither), on this CPU's widest build and the next (AVX-512 and
AVX2 on an AVX-512 machine)."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from common.attention import torch_backend
from common.attention.metadata import AttentionMetadata
from common.attention.torch_backend import TorchAttentionBackend, paged_extend_attention, reference_paged_attention
from common.kernels.cpu import _DECODE, paged_decode_kernel
from common.kernels.isa import ISA_FLAGS, runnable_isas
from common.kv.kv_cache import KVCache, KVCacheSpec

_module: ModuleType | None = paged_decode_kernel()
AMX = _module is not None and bool(_module.prefill_amx_ready())
BF16_DOT = _module is not None and bool(_module.prefill_bf16dot_ready())
NO_SKIP = torch.empty(0, dtype=torch.uint8)
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
# (dtype, build): bf16 on the widest build where AMX runs, and in AVX512-BF16 vectors ("bf16dot") where the CPU has
# them; fp32, and bf16 widened to fp32 ("widened-ISA"), on the two widest vector builds.
_VECTOR_ISAS = [isa for isa in runnable_isas()[:2] if isa != "generic"]
KERNELS = [pytest.param(torch.bfloat16, None, marks=pytest.mark.skipif(not AMX, reason="no AMX here")),
           pytest.param(torch.bfloat16, "bf16dot", id="bfloat16-bf16dot",
                        marks=pytest.mark.skipif(not BF16_DOT, reason="no AVX512-BF16 here")),
           *(pytest.param(torch.float32, isa, id=f"float32-{isa}") for isa in _VECTOR_ISAS),
           *(pytest.param(torch.bfloat16, f"widened-{isa}", id=f"bfloat16-widened-{isa}") for isa in _VECTOR_ISAS)]


def _kernel(isa: str | None) -> Any:
    if isa == "bf16dot":
        assert _module is not None
        return SimpleNamespace(paged_prefill=_module.paged_prefill_bf16dot)
    widened = isa is not None and isa.startswith("widened-")
    if widened:
        isa = isa.removeprefix("widened-")
    module = _module if isa is None else _DECODE.get(isa, ISA_FLAGS[isa])
    if module is None:
        pytest.skip("the compiled attention module does not build here")
    return SimpleNamespace(paged_prefill=module.paged_prefill_widened) if widened else module


def _batch(query_lens: list[int], context_lens: list[int], heads: int, kv_heads: int, dim: int, bs: int = 16,
           seed: int = 0, dtype: torch.dtype = torch.bfloat16
           ) -> tuple[KVCache, AttentionMetadata, torch.Tensor, torch.Generator]:
    g = torch.Generator().manual_seed(seed)
    blocks = sum(-(-(q + c) // bs) for q, c in zip(query_lens, context_lens, strict=True)) + 3
    cache = KVCache(KVCacheSpec(2, kv_heads, dim, bs, DTYPE_NAMES[dtype]), num_blocks=blocks)
    cache.data.copy_(torch.randn(cache.data.shape, generator=g))
    perm = torch.randperm(blocks, generator=g).tolist()  # shuffled, non-contiguous tables
    tables, used = [], 0
    for q, c in zip(query_lens, context_lens, strict=True):
        n = -(-(q + c) // bs)
        tables.append(perm[used : used + n])
        used += n
    meta = AttentionMetadata.build(query_lens, context_lens, tables, bs)
    query = torch.randn(sum(query_lens), heads, dim, generator=g).to(dtype)
    return cache, meta, query, g


def _oracle(query: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float,
            window: int | None = None) -> torch.Tensor:
    k, v = cache.layer(1)
    return reference_paged_attention(query.double(), k.double(), v.double(), meta, scale, window).float()


@pytest.mark.parametrize(("dtype", "isa"), KERNELS)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 128), (8, 1, 32), (16, 2, 256)])
@pytest.mark.parametrize(("query_lens", "context_lens"), [
    ([384], [0]),  # a whole prompt
    ([5, 17, 40, 1], [0, 30, 100, 7]),  # chunks over cached prefixes, lengths off the 16-row blocks
    ([600], [100]),  # more keys than one 512-key softmax chunk: the online rescale between chunks
])
def test_kernel_matches_the_oracle(dtype: torch.dtype, isa: str | None, heads: int, kv_heads: int, dim: int,
                                   query_lens: list[int], context_lens: list[int]) -> None:
    kernel = _kernel(isa)
    cache, meta, query, _ = _batch(query_lens, context_lens, heads, kv_heads, dim, dtype=dtype)
    scale = dim**-0.5
    got = kernel.paged_prefill(query, *cache.layer(1), meta.block_tables, meta.query_start_loc, meta.seq_lens,
                               NO_SKIP, scale, 0)
    want = _oracle(query, cache, meta, scale)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        return
    # bf16 probabilities and output: within what PyTorch's own bf16 attention makes of the same inputs
    torch_bf16 = paged_extend_attention(query, *cache.layer(1), meta, scale).float()
    err, torch_err = (got.float() - want).abs().max().item(), (torch_bf16 - want).abs().max().item()
    assert err <= max(2 * torch_err, 1e-2), (err, torch_err)


@pytest.mark.parametrize(("dtype", "isa"), KERNELS)
def test_sliding_window_never_reads_freed_blocks(dtype: torch.dtype, isa: str | None) -> None:
    # Blocks wholly before every row's window are freed early (their table entries point at block 0, whose
    # bytes are another sequence's or garbage): here they hold NaN, which must not reach any output.
    query_lens, context_lens, window, bs = [40, 3], [200, 0], 50, 16
    kernel = _kernel(isa)
    cache, meta, query, _ = _batch(query_lens, context_lens, 6, 2, 64, bs=bs, seed=3, dtype=dtype)
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
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize(("dtype", "isa"), KERNELS)
def test_block_tables_may_be_a_view_of_a_wider_buffer(dtype: torch.dtype, isa: str | None) -> None:
    # An engine's persistent table buffer, sliced to this step's rows and width: rows a buffer's width apart.
    kernel = _kernel(isa)
    cache, meta, query, _ = _batch([30, 7], [20, 50], 9, 3, 64, dtype=dtype)
    assert meta.block_tables is not None
    wide = torch.full((4, meta.block_tables.shape[1] + 9), -7, dtype=torch.int32)
    wide[:2, : meta.block_tables.shape[1]] = meta.block_tables
    view = wide[:2, : meta.block_tables.shape[1]]
    args = (meta.query_start_loc, meta.seq_lens, NO_SKIP, 0.125, 0)
    assert torch.equal(kernel.paged_prefill(query, *cache.layer(1), view, *args),
                       kernel.paged_prefill(query, *cache.layer(1), meta.block_tables, *args))


@pytest.mark.parametrize(("dtype", "isa"), KERNELS)
def test_skipped_sequences_are_left_to_the_caller(dtype: torch.dtype, isa: str | None) -> None:
    kernel = _kernel(isa)
    cache, meta, query, _ = _batch([20, 1, 33], [5, 40, 0], 9, 3, 64, dtype=dtype)
    skip = torch.tensor([0, 1, 0], dtype=torch.uint8)
    got = kernel.paged_prefill(query, *cache.layer(1), meta.block_tables, meta.query_start_loc, meta.seq_lens,
                               skip, 0.125, 0)
    full = kernel.paged_prefill(query, *cache.layer(1), meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                NO_SKIP, 0.125, 0)
    rows = torch.cat([torch.arange(0, 20), torch.arange(21, 54)])
    assert torch.equal(got[rows], full[rows])  # the others' rows do not depend on the skipped sequence


@pytest.mark.parametrize(("dtype", "isa"), KERNELS)
def test_bad_shapes_are_refused_with_the_field_named(dtype: torch.dtype, isa: str | None) -> None:
    kernel = _kernel(isa)
    cache, meta, query, _ = _batch([8], [0], 2, 1, 48, dtype=dtype)  # head_dim 48: not a multiple of 32
    with pytest.raises(RuntimeError, match="head_dim a multiple of 32"):
        kernel.paged_prefill(query, *cache.layer(1), meta.block_tables, meta.query_start_loc, meta.seq_lens,
                             NO_SKIP, 0.125, 0)
    cache, meta, query, _ = _batch([8], [0], 2, 1, 64, dtype=dtype)
    with pytest.raises(RuntimeError, match="query_start_loc and seq_lens"):
        kernel.paged_prefill(query, *cache.layer(1), meta.block_tables, meta.query_start_loc.long(),
                             meta.seq_lens, NO_SKIP, 0.125, 0)
    with pytest.raises(RuntimeError, match="caches must have the query's dtype"):
        kernel.paged_prefill(query, *(c.half() for c in cache.layer(1)), meta.block_tables, meta.query_start_loc,
                             meta.seq_lens, NO_SKIP, 0.125, 0)


@pytest.mark.skipif(_module is None or AMX, reason="AMX tiles take bf16 here")
def test_without_amx_bf16_runs_in_avx512_bf16_vectors_where_the_cpu_has_them() -> None:
    assert _module is not None
    cache, meta, query, _ = _batch([70, 9], [0, 40], 9, 3, 64)
    args = (*cache.layer(1), meta.block_tables, meta.query_start_loc, meta.seq_lens, NO_SKIP, 0.125, 0)
    if not BF16_DOT:  # asked for anyway: refused, naming what is missing
        with pytest.raises(RuntimeError, match="AVX512-BF16"):
            _module.paged_prefill_bf16dot(query, *args)
        return
    chosen = _module.paged_prefill(query, *args)
    assert torch.equal(chosen, _module.paged_prefill_bf16dot(query, *args))
    assert not torch.equal(chosen, _module.paged_prefill_widened(query, *args))  # P in bf16, not fp32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_backend_runs_prefill_and_extend_steps_through_the_kernel(dtype: torch.dtype,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = _kernel(None)
    if not kernel.prefill_f32_ready() and not (dtype == torch.bfloat16 and AMX):
        pytest.skip("a build without AVX-512 / AVX2")
    # as if the fp32 vectors won their race here (bf16 in AMX tiles needs none; without AMX, widened, it does)
    monkeypatch.setattr(torch_backend, "_PREFILL_PAYS", {(9, 3, 64, dtype): True})
    # A step of a whole prompt, a chunk over a prefix and decode rows, on a strided view of a qkv output (as
    # the layer passes it): the backend's result is the kernel's for the long rows and the decode kernel's for
    # the one-token rows; softcapped calls and fp16 keep PyTorch's path.
    heads, kv_heads, dim = 9, 3, 64
    query_lens, context_lens = [70, 1, 45, 1], [0, 30, 60, 12]
    cache, meta, _, g = _batch(query_lens, context_lens, heads, kv_heads, dim, seed=5, dtype=dtype)
    n = sum(query_lens)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
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
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
    prefill_meta = AttentionMetadata.build([70], [0], [meta.block_tables[0].tolist()], 16)
    whole = backend.forward(q[:70], k[:70], v[:70], cache.layer(1), prefill_meta.kv_written, 0.125)
    assert torch.equal(whole, direct[:70])  # prefill-only steps read the cache through the kernel too
    k16, v16 = (c.half() for c in cache.layer(1))
    half = TorchAttentionBackend()._prefill_kernel(q.half(), (k16, v16), meta, None)
    capped = TorchAttentionBackend()._prefill_kernel(q, cache.layer(1), meta, 30.0)
    assert half is None and capped is None
    monkeypatch.setattr(torch_backend, "_PREFILL_PAYS", {(9, 3, 64, dtype): False})  # lost its race: SDPA serves
    lost = TorchAttentionBackend()._prefill_kernel(q, cache.layer(1), meta, None)
    assert lost is (kernel if dtype == torch.bfloat16 and AMX else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_vector_kernel_races_sdpa_once_per_head_shape(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = _kernel(None)
    if not kernel.prefill_f32_ready():
        pytest.skip("a build without AVX-512 / AVX2")
    if dtype == torch.bfloat16 and AMX:
        pytest.skip("bf16 runs AMX tiles here, without a race")
    decided: dict[tuple[int, int, int, torch.dtype], bool] = {}
    monkeypatch.setattr(torch_backend, "_PREFILL_PAYS", decided)
    cache, meta, query, _ = _batch([40], [0], 4, 2, 32, dtype=dtype)
    chosen = TorchAttentionBackend()._prefill_kernel(query, cache.layer(1), meta, None)
    key = (4, 2, 32, dtype)
    assert list(decided) == [key] and (chosen is kernel) == decided[key]
    decided[key] = not decided[key]  # decided once: the next call reads the record
    assert (TorchAttentionBackend()._prefill_kernel(query, cache.layer(1), meta, None) is kernel) == decided[key]


def test_a_lost_race_is_looked_at_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # A stand-in clock the stand-in kernels advance: the kernel takes 3 units in its first five runs (a burst
    # elsewhere), then 0.5; SDPA always 1. The first look loses, the second wins, and no third look is taken.
    import time
    from types import SimpleNamespace

    now = [0.0]
    calls = {"kernel": 0, "sdpa": 0}

    def kernel_run(*_: object) -> None:
        calls["kernel"] += 1
        now[0] += 3.0 if calls["kernel"] <= 5 else 0.5

    def sdpa_run(*_: object, **__: object) -> None:
        calls["sdpa"] += 1
        now[0] += 1.0

    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(torch_backend, "prefill_attention", sdpa_run)
    assert torch_backend.prefill_pays(SimpleNamespace(paged_prefill=kernel_run), 4, 2, 32) is True
    assert calls == {"kernel": 10, "sdpa": 10}
    # a kernel slower in every look: three looks, then SDPA
    calls.update(kernel=-100, sdpa=0)
    assert torch_backend.prefill_pays(SimpleNamespace(paged_prefill=kernel_run), 4, 2, 32) is False
    assert calls == {"kernel": -85, "sdpa": 15}

"""Paged decode attention: time per call and effective bandwidth, per backend and shape.

    python -m benchmarks.bench_attention [--quick] [--repeats N]

Decode reads every cached K/V byte once per step, so it is memory-bound: the number to watch is
effective bandwidth (KV bytes read / time) next to the machine's own copy bandwidth, measured in the
same run. Shapes are SmolLM2-135M's attention (9 query heads, 3 KV heads, head dim 64) over a
two-layer cache with block size 16 and shuffled block tables. On CPU only the torch backend is
timed (Triton runs there only under its interpreter); on CUDA, triton and flash_attn too.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Iterator

import torch

from common.attention.backend import AttentionBackend, get_backend
from common.attention.metadata import AttentionMetadata
from common.kv.kv_cache import KVCache, KVCacheSpec

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(
    fn: Callable[[], object], device: torch.device, repeats: int, budget_s: float = 3.0
) -> tuple[float, float]:
    """(median, best) seconds per call after one warm-up; fewer repeats when a call is slow."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    first = time.perf_counter() - start
    runs = max(3, min(repeats, int(budget_s / max(first, 1e-9))))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def copy_bandwidth(device: torch.device, repeats: int, nbytes: int = 256 << 20) -> float:
    """Bytes moved per second (read + write) copying a tensor far larger than any cache."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds, _ = time_call(lambda: dst.copy_(src), device, repeats)
    return 2 * nbytes / seconds


def available(device: torch.device) -> tuple[dict[str, AttentionBackend], list[str]]:
    """Backends that can be timed here, and one line per backend that cannot."""
    backends: dict[str, AttentionBackend] = {"torch": get_backend("torch")}
    notes = []
    if device.type == "cpu":
        # The torch backend's two CPU decode paths side by side: the compiled kernel and the PyTorch gather.
        from common.attention.torch_backend import TorchAttentionBackend
        from common.kernels.cpu import paged_decode_kernel

        if paged_decode_kernel() is None:
            notes.append("torch: the compiled CPU decode kernel is unavailable here (PyTorch path only)")
        backends["torch (PyTorch path)"] = TorchAttentionBackend(compiled_decode=False)
    if device.type != "cuda":
        notes.append("triton: not timed (without CUDA it runs only under TRITON_INTERPRET=1, for tests)")
        notes.append("flash_attn: not timed (needs CUDA)")
        return backends, notes
    for name in ("triton", "flash_attn"):
        try:
            backends[name] = get_backend(name)
        except RuntimeError as exc:
            notes.append(f"{name}: not timed ({exc})")
    return backends, notes


def decode_case(
    cache: KVCache, batch: int, context: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A decode step: ``batch`` sequences of ``context`` cached tokens + 1 new, shuffled blocks."""
    blocks_per_seq = -(-(context + 1) // BLOCK_SIZE)
    ids = torch.randperm(cache.num_blocks, generator=generator)[: batch * blocks_per_seq]
    tables = ids.view(batch, blocks_per_seq).tolist()
    meta = AttentionMetadata.build([1] * batch, [context] * batch, tables, BLOCK_SIZE, cache.data.device)
    # The new token's K/V counts as already written: time attention alone, not write_kv.
    meta = dataclasses.replace(meta, slot_mapping=None)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=generator).to(cache.data)
    kv = torch.zeros(batch, NUM_KV_HEADS, HEAD_DIM).to(cache.data)
    return query, kv, meta


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="batches 1/16, contexts 256/1k only")
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per shape (median)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    batches = (1, 16) if args.quick else (1, 16, 64)
    contexts = (256, 1024) if args.quick else (256, 1024, 4096)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    backends, notes = available(device)
    copy_bw = copy_bandwidth(device, args.repeats)
    print(f"# Paged decode attention — {name}, torch {torch.__version__}")
    print(f"\nMemory copy bandwidth (256 MiB, read + write): **{copy_bw / 1e9:.1f} GB/s**")
    print(f"Shape: {NUM_HEADS} heads, {NUM_KV_HEADS} KV heads, head dim {HEAD_DIM}, block size {BLOCK_SIZE}")
    for note in notes:
        print(f"- {note}")
    print("\n| backend | dtype | batch | context | median (ms) | best (ms) | KV read (MiB) | eff. BW (GB/s) "
          "| % of copy |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    max_blocks = max(batches) * -(-(max(contexts) + 1) // BLOCK_SIZE) + 1
    for dtype_name, dtype in DTYPES.items():
        for row in bench_dtype(backends, dtype, batches, contexts, max_blocks, device, args.repeats):
            backend_name, batch, context, (median, best), kv_bytes = row
            bandwidth = kv_bytes / median  # effective bandwidth from the median, the honest number
            print(f"| {backend_name} | {dtype_name} | {batch} | {context} | {median * 1e3:.3f} | {best * 1e3:.3f} | "
                  f"{kv_bytes / 2**20:.1f} | {bandwidth / 1e9:.1f} | {100 * bandwidth / copy_bw:.0f}% |", flush=True)


def bench_dtype(
    backends: dict[str, AttentionBackend],
    dtype: torch.dtype,
    batches: tuple[int, ...],
    contexts: tuple[int, ...],
    max_blocks: int,
    device: torch.device,
    repeats: int,
) -> Iterator[tuple[str, int, int, tuple[float, float], int]]:
    """(backend, batch, context, (median, best) seconds per call, KV bytes read) per shape."""
    # Two layers, so the per-layer views are strided exactly as in serving.
    spec = KVCacheSpec(2, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, str(dtype).removeprefix("torch."))
    cache = KVCache(spec, max_blocks, device)
    cache.data.uniform_(-1.0, 1.0)
    kv_cache = cache.layer(1)
    generator = torch.Generator().manual_seed(0)
    for batch in batches:
        for context in contexts:
            query, kv, meta = decode_case(cache, batch, context, generator)
            kv_bytes = batch * (context + 1) * NUM_KV_HEADS * HEAD_DIM * 2 * cache.data.element_size()
            for name, backend in backends.items():
                if name == "flash_attn" and dtype == torch.float32:
                    continue  # FA2 computes in fp16/bf16 only
                step = functools.partial(backend.forward, query, kv, kv, kv_cache, meta, HEAD_DIM**-0.5)
                yield name, batch, context, time_call(step, device, repeats), kv_bytes


if __name__ == "__main__":
    main()

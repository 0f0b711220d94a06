"""The KV offload tier: restoring a prompt's blocks from the tier against recomputing them, per block.

    python -m benchmarks.bench_offload [--model M] [--dtype D] [--tokens 512] [--threads N] [--json F]

The bundled model (or ``--model``) prefills one prompt of ``--tokens`` tokens into a pool (``recompute``: the
prefill step's time over its full blocks); its blocks are then evicted into the tier (``--kv-offload cpu`` host
memory and ``disk``: a file under the system's temporary directory) and allocated again, which restores them
(``restore``: ``KVCacheManager.allocate``'s loads, timed over the same blocks). Issue 38's goal: a restore >= 5x
faster than recomputing the same blocks (per block, CPU here). The disk tier's file is read through the page
cache: a restore right after the save reads memory, not the disk; a cold read is the disk's speed.
Also the allocation that evicts those blocks, per block: written behind (copied when freed, in the background;
the default) against copied at the eviction.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.machine import cpu_summary


def run(model_dir: Path, dtype: str, tokens: int, repeats: int) -> dict[str, Any]:
    from common.attention.metadata import AttentionMetadata
    from common.engine.model_runner import kv_cache_spec
    from common.kv.kv_cache import KVCache
    from common.kv.kv_cache_manager import KVCacheManager
    from common.kv.offload import OffloadTier
    from common.model.loader import load_model

    model = load_model(model_dir, dtype=dtype)
    block = 16
    num_blocks = tokens // block + 2
    cache = KVCache(kv_cache_spec(model, block), num_blocks)
    prompt = torch.randint(100, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
    full = tokens // block
    out: dict[str, Any] = {"tokens": tokens, "blocks": full, "dtype": str(model.dtype),
                           "threads": torch.get_num_threads(),
                           "bytes_per_block": cache.data[0].numel() * cache.data.element_size()}
    times = []
    for _ in range(repeats):
        manager = KVCacheManager(num_blocks, block)
        alloc = manager.allocate("p", prompt.tolist())
        assert alloc is not None
        meta = AttentionMetadata.build([tokens], [0], [alloc.block_ids], block)
        start = time.perf_counter()
        with torch.inference_mode():
            model(prompt, torch.arange(tokens), meta, cache)
        times.append(time.perf_counter() - start)
    out["recompute_s_per_block"] = statistics.median(times) / full
    for kind, write_behind in (("cpu", True), ("disk", True), ("cpu", False), ("disk", False)):
        restores, evictions = [], []
        with tempfile.TemporaryDirectory() as tmp:
            manager = KVCacheManager(num_blocks, block)
            tier = OffloadTier.create(kind, cache, 0.5, Path(tmp), write_behind=write_behind)
            manager.set_offload(tier)
            for r in range(repeats):
                # A new prompt each time: blocks the tier holds already are not copied again.
                ids = ((prompt - 100 + 7919 * r) % (model.config.vocab_size - 100) + 100).tolist()
                alloc = manager.allocate("p", ids)
                assert alloc is not None
                manager.commit("p", ids)
                manager.free("p")  # write-behind: the freed blocks' copies start now, in the background
                deadline = time.monotonic() + 10
                while tier.num_pending and time.monotonic() < deadline:  # as when they sat in the free queue a while
                    time.sleep(0.001)
                filler = [1000 + r * 7 + i % 5 for i in range(num_blocks * block - 1)]  # evicts every cached block
                start = time.perf_counter()
                assert manager.allocate("f", filler) is not None
                evictions.append(time.perf_counter() - start)
                manager.free("f")
                hits = manager.offload_hits
                start = time.perf_counter()
                again = manager.allocate("p2", ids)
                restores.append(time.perf_counter() - start)
                assert again is not None and manager.offload_hits - hits == (full - (tokens % block == 0)) * block
                manager.free("p2")
            tier.close()
        restored = full - (tokens % block == 0)  # at least one prompt token is always computed
        mode = "" if write_behind else "_sync"
        # The allocation that evicts the prompt's cached blocks (and a filler's), on the step's path: with
        # write-behind their copies landed before, without it each is copied there.
        out[f"evict_{kind}{mode}_s_per_block"] = statistics.median(evictions) / full
        if write_behind:
            out[f"restore_{kind}_s_per_block"] = statistics.median(restores) / restored
            out[f"restore_{kind}_speedup"] = out["recompute_s_per_block"] / out[f"restore_{kind}_s_per_block"]
    return out


def markdown(r: dict[str, Any]) -> str:
    return "\n".join([
        f"{r['tokens']}-token prompt ({r['blocks']} blocks of {r['bytes_per_block'] / 1e6:.2f} MB), {r['dtype']}, "
        f"{r['threads']} threads. CPU: {r['cpu']}.",
        "",
        "| per block | ms | vs recompute |",
        "|---|---:|---:|",
        f"| recompute (the prefill's share) | {r['recompute_s_per_block'] * 1e3:.3f} | 1.00x |",
        f"| restore from host memory (`--kv-offload cpu`) | {r['restore_cpu_s_per_block'] * 1e3:.3f} | "
        f"{r['restore_cpu_speedup']:.1f}x |",
        f"| restore from a file (`--kv-offload disk`, page cache warm) | {r['restore_disk_s_per_block'] * 1e3:.3f} | "
        f"{r['restore_disk_speedup']:.1f}x |",
        "",
        "The allocation that evicts those blocks (on the step's path), per evicted block: written behind (each "
        "block copied when freed, in the background) against copied at the eviction:",
        "",
        "| per evicted block | ms |",
        "|---|---:|",
        *(f"| {label} | {r[key] * 1e3:.4f} |" for label, key in (
            ("host memory, written behind (default)", "evict_cpu_s_per_block"),
            ("host memory, copied at eviction", "evict_cpu_sync_s_per_block"),
            ("file, written behind (default)", "evict_disk_s_per_block"),
            ("file, copied at eviction", "evict_disk_sync_s_per_block"))),
        "",
        f"Goal (issue 38): a restore >= 5x faster than recomputing: "
        f"{'met' if min(r['restore_cpu_speedup'], r['restore_disk_speedup']) >= 5 else 'not met'}.",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model directory (default: the bundled SmolLM2)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from common.config.settings import ModelSettings, load_settings
    from common.model.model_store import resolve_model

    settings = load_settings(ModelSettings, {"model": args.model})
    model_dir = resolve_model(settings.model, settings.home, progress=False)
    result = run(model_dir, args.dtype, args.tokens, args.repeats)
    result["cpu"] = cpu_summary()
    print(markdown(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

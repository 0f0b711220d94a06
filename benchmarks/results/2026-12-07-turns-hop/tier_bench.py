"""What a restore from the shared tier costs per block (SmolLM2's KV layout in bf16, the page cache warm): one node
writes 64 blocks, another finds (``holds``) and loads each of them, five times over (session 40).

    PYTHONPATH=CHECKOUT python tier_bench.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from common.kv.kv_cache import KVCache, KVCacheSpec
from common.kv.shared_tier import RESCAN_S, SharedTier

SPEC = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype_name="bfloat16")
BLOCKS = 64


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        written, restored = KVCache(SPEC, BLOCKS), KVCache(SPEC, BLOCKS)
        written.data.normal_()
        writer = SharedTier(written, Path(directory), 1.0, "model", write_behind=False)
        reader = SharedTier(restored, Path(directory), 1.0, "model", write_behind=False)
        hashes = [bytes([i]) * 16 for i in range(BLOCKS)]
        for i, h in enumerate(hashes):
            writer.save(i, h)
        time.sleep(RESCAN_S + 0.1)  # the reader lists the writer's directory again
        finds, loads = [], []
        for _ in range(5):
            for i, h in enumerate(hashes):
                t0 = time.perf_counter()
                assert reader.holds(h)
                t1 = time.perf_counter()
                reader.load(h, i)
                finds.append(t1 - t0)
                loads.append(time.perf_counter() - t1)
        assert torch.equal(restored.data, written.data)
        print(f"a block ({writer.bytes_per_block:,} bytes): found in {statistics.median(finds) * 1e6:.1f} us, "
              f"loaded in {statistics.median(loads) * 1e6:.1f} us (p50 of {len(loads)})")
        writer.close()
        reader.close()


if __name__ == "__main__":
    main()

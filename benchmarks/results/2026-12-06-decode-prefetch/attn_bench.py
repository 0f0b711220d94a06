"""Paged decode attention over a whole step's layers (session 31): B sequences of LEN tokens, SmolLM2's heads,
30 layers of one KV cache in the engine's layout, block tables shuffled (SHUF=0: in order), T threads; HOT=1 reads
layer 0 thirty times (the cache's working set fits L3); HUGE=1 asks for huge pages before the cache is written.

    taskset -c 0,1 python benchmarks/results/2026-12-06-decode-prefetch/attn_bench.py   # WT=<checkout>: another
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, os.environ.get("WT", str(Path(__file__).resolve().parents[3])))

import torch

from common.kernels.cpu import paged_decode_kernel
from common.kernels.host_malloc import huge_pages

LAYERS, BLOCK, HKV, HQ, D = 30, 16, 3, 9, 64


def main() -> None:
    torch.set_num_threads(int(os.environ.get("T", "2")))
    kernel = paged_decode_kernel()
    assert kernel is not None, "the compiled decode kernel could not be built"
    b, length = int(os.environ.get("B", "48")), int(os.environ.get("LEN", "484"))
    dtype = torch.bfloat16 if os.environ.get("DT", "bf16") == "bf16" else torch.float32
    per_seq = -(-length // BLOCK)
    num_blocks = b * per_seq + 8
    data = torch.empty(num_blocks, LAYERS, 2, BLOCK, HKV, D, dtype=dtype)
    if os.environ.get("HUGE"):
        huge_pages(data)
    data.copy_(torch.randn(data.shape))
    ids = list(range(num_blocks))
    if os.environ.get("SHUF", "1") == "1":
        random.Random(0).shuffle(ids)
    tables = torch.tensor([ids[i * per_seq:(i + 1) * per_seq] for i in range(b)], dtype=torch.int32)
    lens = torch.full((b,), length, dtype=torch.int32)
    q = torch.randn(b, HQ, D).to(dtype)
    hot = bool(os.environ.get("HOT"))
    layers = [(data[:, 0 if hot else i, 0], data[:, 0 if hot else i, 1]) for i in range(LAYERS)]

    def step() -> None:
        for kc, vc in layers:
            kernel.paged_decode(q, kc, vc, tables, lens, D**-0.5, 0)

    step()
    times = []
    for _ in range(int(os.environ.get("N", "7"))):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    times.sort()
    median = times[len(times) // 2]
    kv_bytes = b * length * LAYERS * 2 * HKV * D * data.element_size()
    print(f"B={b} LEN={length} {dtype}: median {median * 1000:.2f} ms best {times[0] * 1000:.2f} ms  "
          f"{kv_bytes / median / 1e9:.1f} GB/s (KV {kv_bytes / 1e6:.0f} MB)")


if __name__ == "__main__":
    main()

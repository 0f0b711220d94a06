"""oneDNN's prepacked bf16 GEMM over served-like row counts, with and without row buckets (session 32).

    python benchmarks/results/2026-12-06-fused-rounding/onednn_rows.py plain|bucketed

SmolLM2's four projection shapes, prepacked (``common.model.gemv.onednn_pack``), called for 60 steps whose row count
is drawn from 1,000-2,100 (a prompt plus the decoding rows, as a served prefill step's), each in a fresh process (the
primitive cache empty); prints the total milliseconds of the 60 steps, of their last 30, and the process's peak RSS.
"""

from __future__ import annotations

import functools
import random
import resource
import sys
import time

import torch

from common.model.gemv import onednn_linear, onednn_pack
from common.model.row_buckets import on_bucketed_rows

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate/up, down: [out, in]


def gemm(rows: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return onednn_linear(rows, packed)


def main(mode: str) -> None:
    torch.manual_seed(0)
    weights = [onednn_pack((0.05 * torch.randn(n, k)).to(torch.bfloat16)) for n, k in SHAPES]
    rng = random.Random(0)
    times = []
    for _ in range(60):
        m = rng.randrange(1000, 2100)
        t = time.perf_counter()
        for (_, k), w in zip(SHAPES, weights, strict=True):
            x = torch.randn(m, k).to(torch.bfloat16)
            if mode == "bucketed":
                on_bucketed_rows(functools.partial(gemm, packed=w), x)
            else:
                gemm(x, w)
        times.append(time.perf_counter() - t)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{mode}: 60 steps {1000 * sum(times):.0f} ms, last 30 {1000 * sum(times[30:]):.0f} ms, "
          f"peak RSS {rss:.0f} MB")


if __name__ == "__main__":
    main(sys.argv[1])

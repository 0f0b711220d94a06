"""Per layer of SmolLM2's four projection shapes, bf16: the panel kernel, torch's GEMM on row-major weights
(F.linear) and the tiles unpacked from the panels through torch's GEMM (gemv.tiled_matmul, what takes the rows
above the panels' limit), best of five, at several row counts (session 34).

    python tiled.py CHECKOUT THREADS
"""

import sys
import time
from collections.abc import Callable
from functools import partial

sys.path.insert(0, sys.argv[1])
import torch
import torch.nn.functional as F

from common.kernels.cpu import cpu_kernels
from common.model import gemv

torch.set_num_threads(int(sys.argv[2]))
found = cpu_kernels()
assert found is not None
ops = found
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # [N, K]


def best(fn: Callable[[], object]) -> float:
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


for rows in (64, 99, 128, 256, 512, 1024):
    total = {"panels": 0.0, "F.linear": 0.0, "tiled": 0.0}
    for n, k in SHAPES.values():
        w = torch.randn(n, k).to(torch.bfloat16)
        p = gemv.pack_panels(w)
        x = torch.randn(rows, k).to(torch.bfloat16)
        total["panels"] += best(partial(ops.dense_matmul_panel, x, p, gemv.NO_AMX, False))
        total["F.linear"] += best(partial(F.linear, x, w))
        total["tiled"] += best(partial(gemv.tiled_matmul, p, x, n, bucketed=True))
    print(rows, "rows, ms a layer:", "  ".join(f"{name} {s * 1e3:.2f}" for name, s in total.items()))

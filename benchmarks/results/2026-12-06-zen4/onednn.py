"""Per layer of SmolLM2's four projection shapes, bf16: the panel kernel (AVX512-BF16 here, no AMX), oneDNN's
GEMM on a prepacked copy and torch's F.linear on row-major weights, best of five, at prefill row counts
(session 34).

    python onednn.py CHECKOUT THREADS
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


for rows in (128, 256, 512, 1024, 2048):
    total = {"panels": 0.0, "oneDNN": 0.0, "F.linear": 0.0}
    for n, k in SHAPES.values():
        w = torch.randn(n, k).to(torch.bfloat16)
        p, packed = gemv.pack_panels(w), gemv.onednn_pack(w)
        x = torch.randn(rows, k).to(torch.bfloat16)
        gemv.onednn_linear(x, packed, None)  # oneDNN builds its kernel for this row count
        total["panels"] += best(partial(ops.dense_matmul_panel, x, p, gemv.NO_AMX, False))
        total["oneDNN"] += best(partial(gemv.onednn_linear, x, packed, None))
        total["F.linear"] += best(partial(F.linear, x, w))
    print(rows, "rows, ms a layer:", "  ".join(f"{name} {s * 1e3:.2f}" for name, s in total.items()))

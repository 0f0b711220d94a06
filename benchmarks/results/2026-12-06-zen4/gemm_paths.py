"""Per layer of SmolLM2's four projection shapes, bf16, best of five, at several row counts (session 34): the panel
kernel (AVX512-BF16 here, no AMX), torch's F.linear on row-major weights, and either the tiles unpacked from the
panels through torch's GEMM (``tiles``: gemv.tiled_matmul, bucketed rows as served, what took the rows above the
panels' limit) or oneDNN's GEMM on a prepacked copy (``onednn``).

    python gemm_paths.py CHECKOUT THREADS tiles|onednn
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
mode = sys.argv[3]
found = cpu_kernels()
assert found is not None and mode in ("tiles", "onednn")
ops = found
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # [N, K]
ROWS = (64, 99, 128, 256, 512, 1024) if mode == "tiles" else (128, 256, 512, 1024, 2048)


def best(fn: Callable[[], object]) -> float:
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


for rows in ROWS:
    total = {"panels": 0.0, "F.linear": 0.0, mode: 0.0}
    for n, k in SHAPES.values():
        w = torch.randn(n, k).to(torch.bfloat16)
        p = gemv.pack_panels(w)
        x = torch.randn(rows, k).to(torch.bfloat16)
        total["panels"] += best(partial(ops.dense_matmul_panel, x, p, gemv.NO_AMX, False))
        total["F.linear"] += best(partial(F.linear, x, w))
        if mode == "tiles":
            total[mode] += best(partial(gemv.tiled_matmul, p, x, n, bucketed=True))
        else:
            packed = gemv.onednn_pack(w)
            gemv.onednn_linear(x, packed, None)  # oneDNN builds its kernel for this row count
            total[mode] += best(partial(gemv.onednn_linear, x, packed, None))
    print(rows, "rows, ms a layer:", "  ".join(f"{name} {s * 1e3:.2f}" for name, s in total.items()))

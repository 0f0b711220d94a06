"""Per layer of SmolLM2's four projection shapes, fp32, best of five, at decode-batch and prefill row counts
(session 36, AVX2): the fp32 panel kernel, torch's F.linear (MKL) on row-major weights, oneDNN on a prepacked copy;
GFLOP/s of the best.

    PYTHONPATH=CHECKOUT python gemm_fp32.py THREADS [ROWS]
"""

import sys
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from common.kernels.cpu import cpu_kernels
from common.model import gemv

torch.set_num_threads(int(sys.argv[1]))
ROWS = [int(r) for r in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 8, 16, 32, 48, 64, 128, 256, 512, 2048]
ops = cpu_kernels()
assert ops is not None
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # [N, K]


def best(fn: Callable[[], object]) -> float:
    fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


weights = {name: torch.randn(n, k) for name, (n, k) in SHAPES.items()}
panels = {name: gemv.pack_panels(w) for name, w in weights.items()}
packed = {name: gemv.onednn_pack(w) for name, w in weights.items()} if gemv.onednn_available() else {}
for rows in ROWS:
    total = {"panels": 0.0, "F.linear": 0.0, "onednn": 0.0}
    flops = 0
    for name, (n, k) in SHAPES.items():
        x = torch.randn(rows, k)
        flops += 2 * rows * n * k
        total["panels"] += best(partial(ops.dense_matmul_panel, x, panels[name], gemv.NO_AMX, False))
        total["F.linear"] += best(partial(F.linear, x, weights[name]))
        if packed:
            total["onednn"] += best(partial(gemv.onednn_linear, x, packed[name], None))
    print(f"{rows} rows, ms a layer: " + "  ".join(f"{k} {s * 1e3:.2f} ({flops / s / 1e9:.0f} GF/s)"
                                                  for k, s in total.items() if s), flush=True)

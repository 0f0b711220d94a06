"""Per layer of SmolLM2's four projection shapes, bf16 panels (vdpbf16ps), best of seven, at decode-batch row
counts: ms a layer and GFLOP/s.   PYTHONPATH=CHECKOUT python gemm_bf16.py THREADS [ROWS]"""

import sys
import time
from functools import partial

import torch

from common.kernels.cpu import cpu_kernels
from common.model import gemv

torch.set_num_threads(int(sys.argv[1]))
ROWS = [int(r) for r in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 3, 7, 8, 11, 15, 16, 24, 31, 47, 48]
ops = cpu_kernels()
assert ops is not None
print("path:", ops.dense_panel_path())
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def best(fn) -> float:
    fn()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


panels = {name: gemv.pack_panels(torch.randn(n, k).bfloat16()) for name, (n, k) in SHAPES.items()}
for rows in ROWS:
    total, flops = 0.0, 0
    for name, (n, k) in SHAPES.items():
        x = torch.randn(rows, k).bfloat16()
        flops += 2 * rows * n * k
        total += best(partial(ops.dense_matmul_panel, x, panels[name], gemv.NO_AMX, False))
    print(f"{rows} rows: {total * 1e3:.3f} ms a layer ({flops / total / 1e9:.0f} GF/s)", flush=True)

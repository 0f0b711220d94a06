"""SmolLM2's four projections over 30 distinct layers (the weights streamed from DRAM, as a decode step reads them)
against one layer's thirty times (cache-resident), bf16 panels (``vdpbf16ps``), median of 7 after evicting L3,
best of two rounds: ms a step (session 38).

    PYTHONPATH=CHECKOUT python gemm_cold.py [ROWS]    # ROWS: e.g. 1,8,16,48
"""

import sys
import time

import torch

from common.kernels.cpu import cpu_kernels
from common.model import gemv

torch.set_num_threads(2)
ROWS = [int(r) for r in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 8, 16, 48]
ops = cpu_kernels()
assert ops is not None
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
layers = [{n: gemv.pack_panels(torch.randn(o, i).bfloat16()) for n, (o, i) in SHAPES.items()} for _ in range(30)]
flush = torch.empty(64 << 20, dtype=torch.uint8)
weight_bytes = sum(o * i * 2 for o, i in SHAPES.values()) * 30
for rows in ROWS:
    xs = {n: torch.randn(rows, i).bfloat16() for n, (o, i) in SHAPES.items()}
    res: dict[str, list[float]] = {"cold": [], "hot": []}
    for mode in ("cold", "hot", "cold", "hot"):
        times = []
        for _ in range(7):
            flush.add_(1)  # evict L3
            start = time.perf_counter()
            for index in range(30):
                layer = layers[index if mode == "cold" else 0]
                for n in SHAPES:
                    ops.dense_matmul_panel(xs[n], layer[n], gemv.NO_AMX, False)
            times.append(time.perf_counter() - start)
        res[mode].append(sorted(times)[3])
    cold, warm = min(res["cold"]), min(res["hot"])
    print(f"{rows} rows: cold {cold * 1e3:.2f} ms ({weight_bytes / cold / 1e9:.1f} GB/s of weights), "
          f"hot {warm * 1e3:.2f} ms", flush=True)

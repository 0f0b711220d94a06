"""oneDNN's bf16 GEMM on prepacked weights: the first call at a new row count (it builds its kernels then) against
the best of three later ones, SmolLM2's four projection shapes (session 33).

    python jit_cost.py CHECKOUT
"""

import sys
import time

sys.path.insert(0, sys.argv[1])
import torch

from common.model import gemv

torch.set_num_threads(2)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
packed = [gemv.onednn_pack(torch.randn(n, k).to(torch.bfloat16)) for n, k in shapes]
firsts: list[float] = []
seconds: list[float] = []
for m in (320, 576, 704, 1152, 1664):
    for (_, k), w in zip(shapes, packed, strict=True):
        x = torch.randn(m, k).to(torch.bfloat16)
        t = time.perf_counter()
        gemv.onednn_linear(x, w)
        first = time.perf_counter() - t
        later = []
        for _ in range(3):
            t = time.perf_counter()
            gemv.onednn_linear(x, w)
            later.append(time.perf_counter() - t)
        firsts.append(first)
        seconds.append(min(later))
    print(f"{m} rows, four shapes: first calls {sum(firsts[-4:]) * 1e3:.1f} ms, later {sum(seconds[-4:]) * 1e3:.1f} ms",
          flush=True)

"""Paged decode attention, ``paged_decode`` (bf16 scores in ``vdpbf16ps`` where the CPU has AVX512-BF16) against
``paged_decode_widened`` (K widened to fp32), in one process, alternating, 6 rounds (session 38): B sequences of
LEN tokens, SmolLM2's heads, 30 layers of a cache in the engine's layout, block tables shuffled; HOT=1 reads layer
0 thirty times (an L3-resident working set).

    B=48 LEN=1050 [HOT=1] PYTHONPATH=CHECKOUT python dot_ab.py
"""

import os
import random
import time

import torch

from common.kernels.cpu import paged_decode_kernel

torch.set_num_threads(2)
kernel = paged_decode_kernel()
assert kernel is not None, "the compiled decode kernel could not be built"
LAYERS, BLOCK, HKV, HQ, D = 30, 16, 3, 9, 64
b, length = int(os.environ.get("B", "48")), int(os.environ.get("LEN", "1050"))
per_seq = -(-length // BLOCK)
num_blocks = b * per_seq + 8
data = torch.randn(num_blocks, LAYERS, 2, BLOCK, HKV, D).bfloat16()
ids = list(range(num_blocks))
random.Random(0).shuffle(ids)
tables = torch.tensor([ids[i * per_seq:(i + 1) * per_seq] for i in range(b)], dtype=torch.int32)
lens = torch.full((b,), length, dtype=torch.int32)
q = torch.randn(b, HQ, D).bfloat16()
hot = bool(os.environ.get("HOT"))
layers = [(data[:, 0 if hot else i, 0], data[:, 0 if hot else i, 1]) for i in range(LAYERS)]
paths = {"dot": kernel.paged_decode, "widened": kernel.paged_decode_widened}
times: dict[str, list[float]] = {name: [] for name in paths}
for _ in range(6):
    for name, fn in paths.items():
        start = time.perf_counter()
        for kc, vc in layers:
            fn(q, kc, vc, tables, lens, D**-0.5, 0)
        times[name].append(time.perf_counter() - start)
outs = [fn(q, *layers[0], tables, lens, D**-0.5, 0).float() for fn in paths.values()]
print(f"B={b} LEN={length} hot={hot}: dot median {sorted(times['dot'])[3] * 1e3:.2f} ms, widened "
      f"{sorted(times['widened'])[3] * 1e3:.2f} ms; outputs differ by at most {(outs[0] - outs[1]).abs().max():.3g}")

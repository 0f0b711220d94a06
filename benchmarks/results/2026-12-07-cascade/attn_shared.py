"""``paged_prefill`` for S sequences of Q new tokens after a CTX-token context, a layer (session 39): their contexts in
the same blocks (SHARED=1, default: the shared-prefix workload's extend steps) or each in its own; SmolLM2's heads,
bf16, 2 threads, median of 9. A plain process (without the engine's malloc settings, common/kernels/host_malloc.py).

    [SHARED=0] PYTHONPATH=CHECKOUT python attn_shared.py S Q CTX          # e.g. 48 64 512; 2 1024 0
"""

import os
import sys
import time
from collections.abc import Callable
from functools import partial

import torch

from common.kernels.cpu import paged_decode_kernel

torch.set_num_threads(2)
_ops = paged_decode_kernel()
assert _ops is not None
ops = _ops
H, HKV, D, BS = 9, 3, 64, 16
S, Q, CTX = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
SHARED = os.environ.get("SHARED", "1") == "1"


def median(fn: Callable[[], object]) -> float:
    fn()
    times = []
    for _ in range(9):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


T = CTX + Q
ctx_blocks, blocks = CTX // BS, -(-T // BS)
total = ctx_blocks + S * (blocks - ctx_blocks) if SHARED else S * blocks
kc, vc = torch.randn(total + 1, BS, HKV, D).bfloat16(), torch.randn(total + 1, BS, HKV, D).bfloat16()
tables = torch.zeros(S, blocks, dtype=torch.int32)
used = ctx_blocks if SHARED else 0
for s in range(S):
    first = 0
    if SHARED:
        tables[s, :ctx_blocks] = torch.arange(ctx_blocks)
        first = ctx_blocks
    tables[s, first:] = torch.arange(used, used + blocks - first)
    used += blocks - first
q = torch.randn(S * Q, H, D).bfloat16()
starts = torch.arange(0, S * Q + 1, Q, dtype=torch.int32)
lens = torch.full((S,), T, dtype=torch.int32)
ms = median(partial(ops.paged_prefill, q, kc, vc, tables, starts, lens, torch.empty(0, dtype=torch.uint8), D**-0.5, 0))
flops = 4 * H * D * S * (Q * CTX + Q * Q / 2)
print(f"S={S} Q={Q} CTX={CTX} shared={SHARED}: {ms:.2f} ms a layer ({flops / ms / 1e6:.0f} GFLOP/s)")

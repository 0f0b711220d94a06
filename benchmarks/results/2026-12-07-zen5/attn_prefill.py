"""Prefill attention a layer (session 37): ``paged_prefill`` on one causal prompt of T tokens (no context), SmolLM2's
9 heads / 3 KV heads of 64, bf16 caches in 16-token blocks, 2 threads, best of 7; torch's SDPA (causal, the KV heads
repeated) beside it. Which path ``paged_prefill`` takes here: AMX, AVX512-BF16 vectors or fp32-widened.

    PYTHONPATH=CHECKOUT python attn_prefill.py [T,T,...]
"""

import sys
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from common.kernels.cpu import paged_decode_kernel

torch.set_num_threads(2)
_ops = paged_decode_kernel()
assert _ops is not None
ops = _ops
print("AMX", ops.prefill_amx_ready(), "AVX512-BF16", getattr(ops, "prefill_bf16dot_ready", lambda: False)())
H, HKV, D, BS = 9, 3, 64, 16


def best(fn: Callable[[], object]) -> float:
    fn()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


for T in [int(t) for t in (sys.argv[1] if len(sys.argv) > 1 else "384,1024,2048").split(",")]:
    nb = (T + BS - 1) // BS
    q = torch.randn(T, H, D).bfloat16()
    kc, vc = torch.randn(nb, BS, HKV, D).bfloat16(), torch.randn(nb, BS, HKV, D).bfloat16()
    tables = torch.arange(nb, dtype=torch.int32)[None]
    starts, lens = torch.tensor([0, T], dtype=torch.int32), torch.tensor([T], dtype=torch.int32)
    skip = torch.empty(0, dtype=torch.uint8)
    kernel = best(partial(ops.paged_prefill, q, kc, vc, tables, starts, lens, skip, D**-0.5, 0))
    k = kc.reshape(-1, HKV, D)[:T].transpose(0, 1).repeat_interleave(H // HKV, 0)
    v = vc.reshape(-1, HKV, D)[:T].transpose(0, 1).repeat_interleave(H // HKV, 0)
    qt = q.transpose(0, 1)
    sdpa = best(partial(F.scaled_dot_product_attention, qt, k, v, is_causal=True))
    flops = 4 * H * D * T * T / 2
    print(f"T={T}: paged_prefill {kernel:.2f} ms ({flops / kernel / 1e6:.0f} GF/s), SDPA bf16 {sdpa:.2f} ms "
          f"({flops / sdpa / 1e6:.0f} GF/s); x30 layers {kernel * 30:.0f} ms", flush=True)

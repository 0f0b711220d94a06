"""Cascade decode attention against the sweep it replaces (session 39): S sequences over a P-token prefix their tables
share plus 1-129 tokens of their own each, SmolLM2's 9 heads / 3 KV heads of 64, bf16 (DTYPE=float32: fp32; with
TANDEM_CPU_ISA=avx2, the AVX2 build), the engine's cache layout
([blocks, 30 layers, K/V, 16, 3, 64]), shuffled own blocks, 2 threads: the largest error against a float64 oracle
(layer 0), then 30 layers' ``paged_decode`` with the cascade off and on, alternating, median of 7.

    [DTYPE=float32] PYTHONPATH=CHECKOUT python cascade_bench.py S P          # e.g. 48 512
"""

import os
import sys
import time

import torch

from common.kernels.cpu import paged_decode_kernel

torch.manual_seed(0)
torch.set_num_threads(2)
_ops = paged_decode_kernel()
assert _ops is not None
ops = _ops
H, HKV, D, BS, LAYERS = 9, 3, 64, 16, 30
S, P = int(sys.argv[1]), int(sys.argv[2])
DTYPE = getattr(torch, os.environ.get("DTYPE", "bfloat16"))
shared_blocks = P // BS
suffix = [int(x) for x in torch.randint(1, 130, (S,))]
blocks = [shared_blocks + -(-x // BS) for x in suffix]
total = shared_blocks + sum(b - shared_blocks for b in blocks)
cache = torch.randn(total + 1, LAYERS, 2, BS, HKV, D).to(DTYPE)
tables = torch.zeros(S, max(blocks), dtype=torch.int32)
own = (torch.randperm(total - shared_blocks) + shared_blocks).tolist()
used = 0
for s in range(S):
    tables[s, :shared_blocks] = torch.arange(shared_blocks)
    n = blocks[s] - shared_blocks
    tables[s, shared_blocks : blocks[s]] = torch.tensor(own[used : used + n], dtype=torch.int32)
    used += n
lens = torch.tensor([P + x for x in suffix], dtype=torch.int32)
q = torch.randn(S, H, D).to(DTYPE)


def run(layer: int) -> torch.Tensor:
    return ops.paged_decode(q, cache[:, layer, 0], cache[:, layer, 1], tables, lens, D**-0.5, 0)  # type: ignore[no-any-return]


def oracle(layer: int) -> torch.Tensor:
    kc, vc = cache[:, layer, 0].reshape(-1, HKV, D).double(), cache[:, layer, 1].reshape(-1, HKV, D).double()
    outs = []
    for s in range(S):
        pos = torch.arange(int(lens[s]))
        rows = tables[s, pos // BS].long() * BS + pos % BS
        qs = q[s].double().view(HKV, H // HKV, D)
        p = (torch.einsum("hgd,thd->hgt", qs, kc[rows]) * D**-0.5).softmax(-1)
        outs.append(torch.einsum("hgt,thd->hgd", p, vc[rows]).reshape(H, D))
    return torch.stack(outs)


want = oracle(0)
ops.set_cascade(False)
flat = run(0)
ops.set_cascade(True)
casc = run(0)
print(f"largest error against float64: sweep {(flat.double() - want).abs().max().item():.2e}, "
      f"cascade {(casc.double() - want).abs().max().item():.2e}")
for on in (False, True, False, True):
    ops.set_cascade(on)
    run(0)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        for layer in range(LAYERS):
            run(layer)
        times.append(time.perf_counter() - start)
    print(f"{'cascade' if on else 'sweep  '} {sorted(times)[3] * 1e3:.2f} ms / {LAYERS} layers", flush=True)
ops.set_cascade(True)

"""Triton weight-only matmul for packed int8 / int4 weights (GPU; the CPU interpreter in tests).

``y[M, N] = x[M, K] @ dequant(W)[N, K]^T``: a program owns a ``BLOCK_M x BLOCK_N`` output tile, walks K in
32-weight steps (one int4 sub-block, one int8 group at the finest), widens the packed codes, applies
the group scale (and zero) in registers and feeds ``tl.dot`` with fp32 accumulation. Only the packed
bytes and the scales come from memory, which is what bounds decode. Layouts as in ``formats.py``.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) it runs on CPU tensors: the
interpreter mishandles 16-bit ``tl.dot``, so there everything is fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

BLOCK_K = 32


@triton.jit
def _weight_only_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, M, N, K, groups,
    GROUP: tl.constexpr, INT4: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=m_mask[:, None], other=0.0)
        g = rk // GROUP  # [BLOCK_K] group of each weight
        s = tl.load(s_ptr + rn[:, None] * groups + g[None, :], mask=n_mask[:, None], other=0.0).to(tl.float32)
        if INT4:
            # 16 bytes per 32 weights: weight j in byte j's low nibble, weight j + 16 in its high nibble
            byte = (rk // 32) * 16 + rk % 16
            shift = ((rk % 32) // 16) * 4
            b = tl.load(q_ptr + rn[:, None] * (K // 2) + byte[None, :], mask=n_mask[:, None], other=0)
            codes = ((b.to(tl.int32) >> shift[None, :]) & 0xF).to(tl.float32)
            z = tl.load(z_ptr + rn[:, None] * groups + g[None, :], mask=n_mask[:, None], other=0.0).to(tl.float32)
            w = codes * s + z
        else:
            codes = tl.load(q_ptr + rn[:, None] * K + rk[None, :], mask=n_mask[:, None], other=0).to(tl.float32)
            w = codes * s
        acc = tl.dot(x.to(COMPUTE_DTYPE), tl.trans(w.to(COMPUTE_DTYPE)), acc, input_precision=DOT_PRECISION)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc, mask=m_mask[:, None] & n_mask[None, :])


INTERPRETED: bool = isinstance(_weight_only_kernel, InterpretedFunction)


def weight_only_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                       group_size: int) -> torch.Tensor:
    """x: [M, K] -> fp32 [M, N]; int4 when ``zeros`` is given (q uint8 [N, K/2]), else int8 (q [N, K])."""
    if x.device.type != "cuda" and not INTERPRETED:
        raise RuntimeError("the Triton quantized matmul needs CUDA tensors, or TRITON_INTERPRET=1 set before "
                           "common.kernels.triton.quant is imported (CPU, slow: tests only)")
    int4 = zeros is not None
    m, k = x.shape
    n = q.shape[0]
    assert k % BLOCK_K == 0 and group_size % BLOCK_K == 0 and k % group_size == 0
    x = x.contiguous()
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if INTERPRETED or x.dtype == torch.float32:
        compute, precision = tl.float32, "ieee"
        x = x.float()
    else:
        compute, precision = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[x.dtype], "tf32"
    block_m = 16 if m <= 16 else 64
    block_n = 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _weight_only_kernel[grid](
        x, q, scales, zeros if int4 else scales, y, m, n, k, k // group_size,
        GROUP=group_size, INT4=int4, COMPUTE_DTYPE=compute, DOT_PRECISION=precision,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
    )
    return y

"""Triton grouped GEMM for a mixture of experts' routed tokens (GPU; the CPU interpreter in tests).

vLLM's fused-MoE layout: the (token, expert) pairs sorted by expert, each expert's rows padded to a multiple of
``BLOCK_M`` so that every row block belongs to one expert (``align``). One launch per projection computes all
experts: program ``(b, n)`` multiplies row block ``b`` — its rows gathered from ``x`` through ``row_src``
(-1: padding) — by the ``n``-th ``BLOCK_N`` rows of its expert's weight ``w[e]`` ``[N, K]``, fp32 accumulation.
Each expert's weight tiles are read by its own row blocks only; experts no token chose are not read.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) it runs on CPU tensors in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

BLOCK_K = 32


@triton.jit
def _grouped_kernel(
    x_ptr, w_ptr, y_ptr, row_src_ptr, block_expert_ptr, N, K,
    COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    src = tl.load(row_src_ptr + rows)  # [BLOCK_M] rows of x, -1 where padding
    valid = src >= 0
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + expert * N * K
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < K
        x = tl.load(x_ptr + src[:, None] * K + rk[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_base + rn[:, None] * K + rk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x.to(COMPUTE_DTYPE), tl.trans(w.to(COMPUTE_DTYPE)), acc, input_precision=DOT_PRECISION)
    tl.store(y_ptr + rows[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=valid[:, None] & n_mask[None, :])


INTERPRETED: bool = isinstance(_grouped_kernel, InterpretedFunction)


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Rows per block: 16 at decode sizes (few rows per expert: less padding), 64 at prefill sizes."""
    return 16 if num_pairs <= 4 * num_experts else 64


def align(expert: torch.Tensor, token: torch.Tensor, num_experts: int, block_m: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs sorted by expert -> (row_src [padded] = each padded row's token or -1, block_expert [blocks], slot [n] =
    each pair's padded row)."""
    counts = torch.bincount(expert, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_starts = padded.cumsum(0) - padded
    starts = counts.cumsum(0) - counts
    slot = padded_starts[expert] + torch.arange(expert.numel(), device=expert.device) - starts[expert]
    total = int(padded.sum())
    row_src = torch.full((total,), -1, dtype=torch.int64, device=expert.device)
    row_src[slot] = token
    block_expert = torch.repeat_interleave(torch.arange(num_experts, device=expert.device), padded // block_m)
    return row_src, block_expert, slot


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, row_src: torch.Tensor, block_expert: torch.Tensor,
                   block_m: int) -> torch.Tensor:
    """``y[r] = x[row_src[r]] @ w[block_expert[r // block_m]].T`` for every padded row r with ``row_src[r] >= 0``:
    x ``[T, K]``, w ``[E, N, K]`` -> y ``[len(row_src), N]`` in x's dtype (padding rows unwritten)."""
    if x.device.type != "cuda" and not INTERPRETED:
        raise RuntimeError("the Triton grouped GEMM needs CUDA tensors, or TRITON_INTERPRET=1 set before "
                           "common.kernels.triton.moe is imported (CPU, slow: tests only)")
    _, n, k = w.shape
    x = x.contiguous()
    y = torch.empty(row_src.numel(), n, dtype=x.dtype, device=x.device)
    if row_src.numel() == 0:
        return y
    if INTERPRETED or x.dtype == torch.float32:
        compute, precision = tl.float32, "ieee"
    else:
        compute, precision = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[x.dtype], "tf32"
    block_n = 64
    grid = (row_src.numel() // block_m, triton.cdiv(n, block_n))
    _grouped_kernel[grid](x, w.contiguous(), y, row_src, block_expert, n, k, COMPUTE_DTYPE=compute,
                          DOT_PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K)
    return y

"""Bounded GEMM shapes for 16-bit linear layers on CPU: the rows of a matmul padded up to a few buckets.

On CPU, bf16/fp16 matmuls run through oneDNN, which builds (JIT-compiles) and keeps kernels for every new
problem shape. A node's row count is the step's token count, so a prefill node sees every M from 1 to its
chunk size: measured (torch 2.13, AVX512-BF16), two 576x1536 bf16 weights over 400 distinct M grew the
process by hundreds of MB (most of it even with ONEDNN_PRIMITIVE_CACHE_CAPACITY=0), and a 6-minute soak's
prefill nodes grew while fp32 (MKL) stays flat (benchmarks/results/2026-12-01-soak-30min/RESULTS.md).
Padding M to buckets bounds the shapes: M <= 16 exact (decode), then 8 buckets per octave (M rounded up to a
multiple of 2^(bits(M)-4)): 56 shapes up to 512, at most 1/8 of the rows wasted (under 6% on average); the
same 400 shapes then grew the process once, by a fraction of that (the figures the soak page lacks:
benchmarks/results/figures-from-code.md).

The float linear methods (``TorchMethod``, ``GemvMethod``, ``PanelMethod``'s tiles and its calls to oneDNN's GEMM on
a prepacked copy) pad their rows so on CPU for 16-bit activations (``wanted``); ``TANDEM_ROW_BUCKETS=off`` turns it
off, ``on`` forces it. (The prepacked path was unpadded until session 32: a served prefill step's row count, its
prompt tokens plus the decoding rows, is new almost every step, and each new one cost 20-60 ms of kernel building
across SmolLM2's four projection shapes, a 1,400-token prompt's step 340 -> 360-420 ms.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

EXACT_ROWS = 16


def bucket_rows(m: int) -> int:
    """The padded row count for ``m`` rows."""
    if m <= EXACT_ROWS:
        return m
    step = 1 << (m.bit_length() - 4)
    return -(-m // step) * step


def bucket_values(lo: int, hi: int) -> list[int]:
    """Every padded row count a call of ``lo`` to ``hi`` rows can take, ascending."""
    values: list[int] = []
    m = max(1, lo)
    while m <= hi:
        values.append(bucket_rows(m))
        m = values[-1] + 1
    return values


def on_bucketed_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for a row-wise ``fn`` over ``x`` [m, k] padded with zero rows to ``bucket_rows(m)`` (the padding's
    output rows dropped: a view of the first m)."""
    m = x.shape[0]
    padded = bucket_rows(m)
    if padded == m or x.dim() != 2:
        return fn(x)
    xp = x.new_empty((padded, x.shape[1]))
    xp[:m] = x
    xp[m:] = 0
    return fn(xp)[:m]


def linear_bucketed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` over ``x`` [m, k] padded to ``bucket_rows(m)`` rows (the padding's output dropped)."""
    return on_bucketed_rows(lambda rows: nn.functional.linear(rows, weight, bias), x)


def wanted(device: torch.device, dtype: torch.dtype) -> bool:
    """auto: on for 16-bit activations on CPU (oneDNN's per-shape kernels); TANDEM_ROW_BUCKETS=on|off."""
    from common.config.settings import kernel_setting

    choice = str(kernel_setting("row_buckets"))  # TANDEM_ROW_BUCKETS
    if choice != "auto":
        return choice == "on"
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)

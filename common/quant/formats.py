"""Packed weight formats (int8, int4, fp8), how to quantize into them, and the reference math.

Each format is a frozen dataclass of tensors for one ``[out_features, in_features]`` matrix; its
``dequantize()`` is the definition the kernels are tested against (``reference_matmul``).

- ``Int8Weight``: ``q`` int8 ``[N, K]``, ``scales`` fp32 ``[N, K / group_size]``; ``w = scale * q``.
  Symmetric; ``group_size == K`` is one scale per output channel, 32 is GGUF's Q8_0.
- ``Int4Weight``: ``q`` uint8 ``[N, K / 2]``, two weights a byte, in 32-weight sub-blocks of 16 bytes
  where byte ``j`` holds weight ``j`` (low nibble) and ``j + 16`` (high nibble) -- GGUF's Q4_1 order, so
  Q4_1 blocks load without repacking; ``scales`` and ``zeros`` fp16 ``[N, K / group_size]``;
  ``w = scale * q + zero`` with ``q`` in 0..15 (the zero is the group's minimum, as in Q4_1).
- ``FP8Weight``: ``q`` float8_e4m3fn ``[N, K]``, ``scales`` fp32 ``[N]``; ``w = scale * q``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUB_BLOCK = 32  # weights per int4 sub-block (16 bytes); every group size is a multiple of it
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass(frozen=True)
class Int8Weight:
    q: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # fp32 [N, K / group_size]
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q.shape[0]), int(self.q.shape[1])

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scales.nbytes

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        groups = self.q.float().view(n, k // self.group_size, self.group_size)
        return (groups * self.scales.unsqueeze(-1)).view(n, k)

    def rows(self, index: torch.Tensor) -> Int8Weight:
        return Int8Weight(self.q[index].contiguous(), self.scales[index].contiguous(), self.group_size)


@dataclass(frozen=True)
class Int4Weight:
    q: torch.Tensor  # uint8 [N, K / 2]
    scales: torch.Tensor  # fp16 [N, K / group_size]
    zeros: torch.Tensor  # fp16 [N, K / group_size]
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q.shape[0]), int(self.q.shape[1]) * 2

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scales.nbytes + self.zeros.nbytes

    def unpack(self) -> torch.Tensor:
        """The 4-bit codes as uint8 ``[N, K]`` in weight order."""
        n, k = self.shape
        blocks = self.q.view(n, k // SUB_BLOCK, SUB_BLOCK // 2)
        return torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).view(n, k)

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        codes = self.unpack().float().view(n, k // self.group_size, self.group_size)
        w = codes * self.scales.float().unsqueeze(-1) + self.zeros.float().unsqueeze(-1)
        return w.view(n, k)

    def rows(self, index: torch.Tensor) -> Int4Weight:
        return Int4Weight(self.q[index].contiguous(), self.scales[index].contiguous(),
                          self.zeros[index].contiguous(), self.group_size)


@dataclass(frozen=True)
class FP8Weight:
    q: torch.Tensor  # float8_e4m3fn [N, K]
    scales: torch.Tensor  # fp32 [N]

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q.shape[0]), int(self.q.shape[1])

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scales.nbytes

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scales.unsqueeze(-1)

    def rows(self, index: torch.Tensor) -> FP8Weight:
        return FP8Weight(self.q[index].contiguous(), self.scales[index].contiguous())


QuantizedWeight = Int8Weight | Int4Weight | FP8Weight


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 ``[N, K]`` -> the packed ``[N, K / 2]`` layout (inverse of ``unpack``)."""
    n, k = codes.shape
    blocks = codes.to(torch.uint8).view(n, k // SUB_BLOCK, SUB_BLOCK)
    half = SUB_BLOCK // 2
    return (blocks[..., :half] | (blocks[..., half:] << 4)).reshape(n, k // 2).contiguous()


def quantize_int8(w: torch.Tensor, group_size: int | None = None) -> Int8Weight:
    """Symmetric int8, one scale per output channel (``group_size=None``) or per group."""
    n, k = w.shape
    g = k if group_size is None else group_size
    groups = w.float().view(n, k // g, g)
    scales = groups.abs().amax(-1).clamp(min=1e-12) / 127.0
    q = torch.round(groups / scales.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q.view(n, k).contiguous(), scales.contiguous(), g)


def quantize_int4(w: torch.Tensor, group_size: int) -> Int4Weight:
    """Asymmetric 4-bit per group: ``zero`` = the group's minimum, ``scale`` = its range / 15."""
    n, k = w.shape
    groups = w.float().view(n, k // group_size, group_size)
    lo, hi = groups.amin(-1), groups.amax(-1)
    # The fp16 scale and zero are what the kernels read, so the codes are rounded against them.
    scales = ((hi - lo) / 15.0).clamp(min=1e-8).half()
    zeros = lo.half()
    codes = torch.round((groups - zeros.float().unsqueeze(-1)) / scales.float().unsqueeze(-1)).clamp(0, 15)
    return Int4Weight(pack_int4(codes.view(n, k)), scales.contiguous(), zeros.contiguous(), group_size)


def quantize_fp8(w: torch.Tensor) -> FP8Weight:
    """float8 e4m3 with one fp32 scale per output channel (amax maps to the largest finite value)."""
    scales = w.float().abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    q = (w.float() / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return FP8Weight(q, scales)


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 per row (token) of activations: (int8 [M, K], fp32 scales [M, 1])."""
    scales = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127.0
    return torch.round(x.float() / scales).clamp(-127, 127).to(torch.int8), scales


def reference_w8a8_matmul(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """W8A8: per-token int8 activations times per-channel int8 weights, exact integer sums, then scales."""
    assert weight.group_size == weight.shape[1], "W8A8 takes one weight scale per output channel"
    xq, xs = quantize_rows_int8(x)
    acc = (xq.double() @ weight.q.double().T).float()  # exact: |sum| < 2^53
    return acc * xs * weight.scales.view(1, -1)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic e4m3 per row (token) of activations: (float8 [M, K], fp32 scales [M, 1])."""
    scales = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (x.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scales


def reference_fp8_matmul(x: torch.Tensor, weight: FP8Weight) -> torch.Tensor:
    """What ``torch._scaled_mm`` computes for FP8 weights: per-token fp8 activations, fp32 sums, scales."""
    xq, xs = quantize_rows_fp8(x)
    return (xq.float() @ weight.q.float().T) * xs * weight.scales.view(1, -1)


def quantize_blocks_int8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x [M, K] rounded as the ``tandem_a8`` kernels round it: int8 in blocks of ``block`` along K, one fp32
    scale ``max|x| / 127`` per block, to nearest even; returns the dequantized fp32 activations."""
    m, k = x.shape
    xb = x.float().reshape(m, k // block, block)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(xb * inv) * (amax / 127.0)).reshape(m, k)


def reference_a8_matmul(x: torch.Tensor, weight: Int4Weight | Int8Weight) -> torch.Tensor:
    """What ``int4_matmul_a8`` / ``int8_matmul_a8`` compute: block-rounded activations times the weight."""
    return quantize_blocks_int8(x) @ weight.dequantize().T


def reference_matmul(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x: [M, K] -> [M, N] in fp32 through the dequantized weight: the oracle of every kernel."""
    return x.float() @ weight.dequantize().T

"""The packed formats and their reference math: packing is lossless, quantization errors are bounded."""

from __future__ import annotations

import pytest
import torch

from common.quant.formats import (
    Int4Weight,
    pack_int4,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    quantize_rows_int8,
    reference_matmul,
    reference_w8a8_matmul,
)


def test_int4_pack_and_unpack_are_inverse_in_gguf_nibble_order() -> None:
    codes = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (3, 32)
    # byte j of a 32-weight sub-block: weight j low, weight j + 16 high
    assert int(packed[1, 5]) == int(codes[1, 5]) | (int(codes[1, 21]) << 4)
    assert int(packed[2, 16 + 3]) == int(codes[2, 32 + 3]) | (int(codes[2, 48 + 3]) << 4)
    weight = Int4Weight(packed, torch.ones(3, 2, dtype=torch.float16), torch.zeros(3, 2, dtype=torch.float16), 32)
    assert torch.equal(weight.unpack(), codes)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_error_is_at_most_half_a_step(group_size: int) -> None:
    w = torch.randn(16, 256)
    q = quantize_int4(w, group_size)
    assert q.shape == (16, 256) and q.scales.shape == (16, 256 // group_size)
    step = q.scales.float().repeat_interleave(group_size, dim=1)
    # half a step, plus the fp16 rounding of the zero
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-3 * w.abs().amax()).all()


def test_int8_per_channel_and_grouped_errors_are_at_most_half_a_step() -> None:
    w = torch.randn(8, 128) * torch.logspace(-2, 1, 8).unsqueeze(1)  # very different row ranges
    per_channel = quantize_int8(w)
    assert per_channel.group_size == 128 and per_channel.scales.shape == (8, 1)
    assert ((per_channel.dequantize() - w).abs() <= per_channel.scales / 2 + 1e-7).all()
    grouped = quantize_int8(w, 32)
    assert grouped.scales.shape == (8, 4)
    assert (grouped.dequantize() - w).abs().max() <= (per_channel.dequantize() - w).abs().max()


def test_fp8_relative_error_is_e4m3_precision() -> None:
    w = torch.randn(8, 64)
    q = quantize_fp8(w)
    assert q.q.dtype == torch.float8_e4m3fn and q.scales.shape == (8,)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values
    big = w.abs() > 0.05 * w.abs().amax(-1, keepdim=True)
    assert ((q.dequantize() - w).abs()[big] <= w.abs()[big] / 16 + 1e-6).all()


def test_reference_matmul_is_the_dequantized_product() -> None:
    w, x = torch.randn(24, 64), torch.randn(3, 64)
    q = quantize_int4(w, 32)
    torch.testing.assert_close(reference_matmul(x, q), x @ q.dequantize().T)


def test_w8a8_reference_rounds_activations_per_token() -> None:
    x = torch.randn(4, 64) * torch.tensor([[0.01], [1.0], [100.0], [3.0]])
    xq, xs = quantize_rows_int8(x)
    assert xq.dtype == torch.int8 and xs.shape == (4, 1)
    assert (xq.abs().amax(-1) == 127).all()
    w = quantize_int8(torch.randn(16, 64))
    expected = (xq.float() * xs) @ w.dequantize().T
    torch.testing.assert_close(reference_w8a8_matmul(x, w), expected, rtol=1e-5, atol=1e-4)

"""``int8_matmul_panel`` / ``int4_matmul_panel`` (16-row panels, int8-rounded activations) against the reference.

Run on the widest build and the next one, so on an AVX-512 machine with VNNI both the ``vpdpbusd`` loop
and the AVX2 ``vpmaddubsw`` loop are checked (on an AVX2 machine: that loop and the plain C++ one).
"""

from __future__ import annotations

import pytest
import torch

from common.kernels.cpu import quant_kernels
from common.kernels.isa import cpu_flags, runnable_isas
from common.quant.formats import quantize_int4, quantize_int8, reference_a8_matmul, reference_matmul
from common.quant.panels import (
    int4_panel_weight,
    pack_int4_panels,
    pack_int8_panels,
    unpack_int4_panels,
    unpack_int8_panels,
)

ISAS = runnable_isas()[:2]
SHAPES = [(32, 16, None), (64, 48, 32), (160, 80, None), (160, 112, 32), (128, 64, 64)]  # K, N, group


@pytest.fixture(scope="module", params=ISAS)
def ops(request: pytest.FixtureRequest) -> object:
    return quant_kernels(request.param)


def test_the_inner_loop_follows_the_cpu(ops: object) -> None:
    path = ops.int8_panel_path()  # type: ignore[attr-defined]
    expected = {"avx512": "vnni" if "avx512_vnni" in cpu_flags() else "maddubs", "avx2": "maddubs",
                "generic": "generic"}
    assert path == expected[ops.isa()]  # type: ignore[attr-defined]


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 9, 64, 261])  # every tile shape; 261 crosses a row chunk
@pytest.mark.parametrize(("k", "n", "group"), SHAPES)
def test_panels_match_the_reference(ops: object, m: int, k: int, n: int, group: int | None) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    x[0, :32] = 0.0  # an all-zero block: scale 0
    weight = quantize_int8(w, group)
    q, scales = pack_int8_panels(weight)
    y = ops.int8_matmul_panel(x, q, scales, weight.group_size)  # type: ignore[attr-defined]
    torch.testing.assert_close(y, reference_a8_matmul(x, weight), rtol=1e-5, atol=1e-4)
    exact = reference_matmul(x, weight)
    assert (y - exact).norm() <= 0.02 * exact.norm()  # the rounding of x costs ~0.5%, not more


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 9, 64, 261])
@pytest.mark.parametrize(("k", "n", "group"), [(32, 16, 32), (64, 48, 32), (256, 80, 64), (256, 112, 128)])
def test_int4_panels_match_the_reference(ops: object, m: int, k: int, n: int, group: int) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + k + n + 1)
    w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    x[0, :32] = 0.0
    weight = quantize_int4(w, group)
    q, scales, zeros = pack_int4_panels(weight)
    y = ops.int4_matmul_panel(x, q, scales, zeros, group)  # type: ignore[attr-defined]
    torch.testing.assert_close(y, reference_a8_matmul(x, weight), rtol=1e-5, atol=1e-4)
    exact = reference_matmul(x, weight)
    assert (y - exact).norm() <= 0.02 * exact.norm()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_row_does_not_depend_on_the_rows_beside_it(ops: object, fmt: str) -> None:
    # speculative verification multiplies k + 1 rows where plain decoding multiplies one: the same bits
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(80, 96, generator=gen)
    x = torch.randn(11, 96, generator=gen)
    if fmt == "int8":
        args = pack_int8_panels(quantize_int8(w, 32))
        kernel = ops.int8_matmul_panel  # type: ignore[attr-defined]
    else:
        args = pack_int4_panels(quantize_int4(w, 32))
        kernel = ops.int4_matmul_panel  # type: ignore[attr-defined]
    together = kernel(x, *args, 32)
    for i in range(11):
        assert torch.equal(kernel(x[i : i + 1].contiguous(), *args, 32)[0], together[i])


def test_bf16_in_and_out_is_the_fp32_result_rounded_once(ops: object) -> None:
    gen = torch.Generator().manual_seed(9)
    weight = quantize_int8(torch.randn(48, 64, generator=gen))
    q, scales = pack_int8_panels(weight)
    x = torch.randn(6, 64, generator=gen).bfloat16()
    y = ops.int8_matmul_panel(x, q, scales, 64)  # type: ignore[attr-defined]
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, ops.int8_matmul_panel(x.float(), q, scales, 64).bfloat16())  # type: ignore[attr-defined]


def test_bad_layouts_are_refused(ops: object) -> None:
    weight = quantize_int8(torch.randn(32, 64))
    q, scales = pack_int8_panels(weight)
    with pytest.raises(RuntimeError, match="group_size"):
        ops.int8_matmul_panel(torch.randn(1, 64), q, scales, 48)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match=r"\[N/16, K/4, 16, 4\]"):
        ops.int8_matmul_panel(torch.randn(1, 64), weight.q, scales, 64)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="x has 32 columns"):
        ops.int8_matmul_panel(torch.randn(1, 32), q, scales, 64)  # type: ignore[attr-defined]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["int8", "int8-grouped", "int4"])
def test_panels_dequantize_to_the_weights(ops: object, fmt: str, dtype: torch.dtype) -> None:
    """The prefill path's dequantize of a row range of panels (rows cutting across panels) equals the
    weights' own dequantize, rounded to the dtype."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(80, 96, generator=gen)
    if fmt == "int4":
        weight4 = quantize_int4(w, 32)
        q4, s4, z4 = pack_int4_panels(weight4)
        got = ops.int4_dequantize_panel(q4, s4, z4, 32, 7, 53, dtype)  # type: ignore[attr-defined]
        want = weight4.dequantize()[7:53]
    else:
        weight8 = quantize_int8(w, 32 if fmt == "int8-grouped" else None)
        q8, s8 = pack_int8_panels(weight8)
        got = ops.int8_dequantize_panel(q8, s8, weight8.group_size, 7, 53, dtype)  # type: ignore[attr-defined]
        want = weight8.dequantize()[7:53]
    assert got.dtype == dtype and got.shape == (46, 96)
    torch.testing.assert_close(got.float(), want.to(dtype).float(), rtol=1e-6 if dtype == torch.float32 else 1e-2,
                               atol=1e-6 if dtype == torch.float32 else 1e-2)
    with pytest.raises(RuntimeError, match="row range"):
        ops.int8_dequantize_panel(*pack_int8_panels(quantize_int8(w)), 96, 0, 81, dtype)  # type: ignore[attr-defined]


def test_the_layout_round_trips() -> None:
    weight = quantize_int8(torch.randn(48, 64), 32)
    q, scales = pack_int8_panels(weight)
    assert q.shape == (3, 16, 16, 4) and scales.shape == (3, 2, 16)
    assert torch.equal(unpack_int8_panels(q), weight.q)
    rows = torch.tensor([31, 0, 16, 17])
    assert torch.equal(unpack_int8_panels(q, rows), weight.q[rows])
    with pytest.raises(ValueError, match="out_features % 16"):
        pack_int8_panels(quantize_int8(torch.randn(40, 64)))
    w4 = quantize_int4(torch.randn(32, 64), 32)
    q4, s4, z4 = pack_int4_panels(w4)
    assert q4.shape == (2, 8, 16, 4) and s4.shape == z4.shape == (2, 2, 16)
    assert torch.equal(unpack_int4_panels(q4), w4.unpack())
    assert torch.equal(unpack_int4_panels(q4, rows), w4.unpack()[rows])
    back = int4_panel_weight(q4, s4, z4, 32)
    assert torch.equal(back.q, w4.q) and torch.equal(back.scales, w4.scales) and torch.equal(back.zeros, w4.zeros)


@pytest.mark.parametrize("fmt", ["int8", "int8-grouped", "int4"])
@pytest.mark.parametrize("m", [1, 5, 16, 17, 32, 40, 64])  # 32-row groups, 16, a padded tail
@pytest.mark.parametrize(("k", "n"), [(64, 48), (576, 80), (1536, 32)])  # one-panel tails; chunks of 1 pair
def test_amx_panels_match_the_reference(m: int, k: int, n: int, fmt: str) -> None:
    ops = quant_kernels()
    if ops.dense_panel_path() != "amx":  # type: ignore[attr-defined]
        pytest.skip("this CPU grants no AMX tiles")
    gen = torch.Generator().manual_seed(m + k + n)
    w = torch.randn(n, k, generator=gen) * 0.1
    x = torch.randn(m, k, generator=gen).bfloat16()
    if fmt == "int4":
        weight = quantize_int4(w, 32)
        y = ops.int4_matmul_panel_amx(x, *pack_int4_panels(weight), 32)  # type: ignore[attr-defined]
    else:
        weight = quantize_int8(w, 32 if fmt == "int8-grouped" else None)
        y = ops.int8_matmul_panel_amx(x, *pack_int8_panels(weight), weight.group_size)  # type: ignore[attr-defined]
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    # x as it is (no int8 rounding); the weights rounded to bf16 once dequantized, the output to bf16
    expected = x.float() @ weight.dequantize().bfloat16().float().T
    torch.testing.assert_close(y.float(), expected, rtol=1.6e-2, atol=1e-2 * k ** 0.5 / 8)


def test_amx_panels_refuse_what_they_cannot_run() -> None:
    ops = quant_kernels()
    weight = quantize_int8(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="x must be a contiguous bf16"):
        ops.int8_matmul_panel_amx(torch.randn(4, 64), *pack_int8_panels(weight), 64)  # type: ignore[attr-defined]
    if ops.dense_panel_path() != "amx":  # type: ignore[attr-defined]
        with pytest.raises(RuntimeError, match="AMX panels need AMX tiles"):
            ops.int8_matmul_panel_amx(torch.randn(4, 64).bfloat16(), *pack_int8_panels(weight), 64)  # type: ignore[attr-defined]


"""Tandem's compiled CPU kernels against the reference, on every instruction set this CPU can run.

The AVX2 build is tested on AVX-512 machines too (``quant_kernels("avx2")``, what ``TANDEM_CPU_ISA=avx2``
forces), so both paths stay correct whichever machine the suite lands on.
"""

from __future__ import annotations

import pytest
import torch

from common.kernels.cpu import quant_kernels
from common.kernels.isa import best_isa, cpu_flags, runnable_isas
from common.quant.formats import quantize_int4, quantize_int8, reference_a8_matmul, reference_matmul

# The widest build and the next one (AVX-512 and AVX2 on AVX-512 machines, AVX2 and plain C++ on AVX2 ones):
# each build compiles for about a minute on a fresh machine.
ISAS = runnable_isas()[:2]
ROWS = [1, 2, 3, 4, 5, 8]  # every tile shape the kernels have (4, 2, 1 rows of x)
SHAPES = [(64, 40, 32), (128, 77, 64), (256, 33, 128), (96, 1, 32)]  # K, N (odd: row tails), group


@pytest.fixture(params=ISAS)
def ops(request: pytest.FixtureRequest) -> object:
    return quant_kernels(request.param)


def test_the_module_is_the_instruction_set_asked_for(ops: object) -> None:
    assert ops.isa() in ISAS  # type: ignore[attr-defined]


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize(("k", "n", "group"), SHAPES)
def test_int4_matmul_matches_reference(ops: object, m: int, k: int, n: int, group: int) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    q = quantize_int4(w, group)
    y = ops.int4_matmul(x, q.q, q.scales, q.zeros, group)  # type: ignore[attr-defined]
    torch.testing.assert_close(y, reference_matmul(x, q), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize(("k", "n", "group"), SHAPES)
@pytest.mark.parametrize("per_channel", [True, False])
def test_int8_matmul_matches_reference(ops: object, m: int, k: int, n: int, group: int, per_channel: bool) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    q = quantize_int8(w, None if per_channel else group)
    y = ops.int8_matmul(x, q.q, q.scales, q.group_size)  # type: ignore[attr-defined]
    torch.testing.assert_close(y, reference_matmul(x, q), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize(("k", "n", "group"), SHAPES)
@pytest.mark.parametrize("fmt", ["int4", "int8", "int8-grouped"])
def test_int8_activation_matmuls_match_their_reference(ops: object, m: int, k: int, n: int, group: int,
                                                       fmt: str) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    x[0, :32] = 0.0  # an all-zero block: scale 0, no division by it
    if fmt == "int4":
        q4 = quantize_int4(w, group)
        y = ops.int4_matmul_a8(x, q4.q, q4.scales, q4.zeros, group)  # type: ignore[attr-defined]
        want = reference_a8_matmul(x, q4)
    else:
        q8 = quantize_int8(w, group if fmt == "int8-grouped" else None)
        y = ops.int8_matmul_a8(x, q8.q, q8.scales, q8.group_size)  # type: ignore[attr-defined]
        want = reference_a8_matmul(x, q8)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-4)
    # the rounding costs about 0.5% of the float product, not more
    exact = reference_matmul(x, q4 if fmt == "int4" else q8)
    assert (y - exact).norm() <= 0.02 * exact.norm()


@pytest.mark.parametrize("fn", ["int4_matmul_a8", "int4_matmul"])
def test_a_row_does_not_depend_on_the_rows_beside_it(ops: object, fn: str) -> None:
    # Speculative verification multiplies k + 1 rows where plain decoding multiplies one: the same row must
    # give the same bits whichever tile shape (4, 2, 1 rows) it lands in.
    gen = torch.Generator().manual_seed(3)
    q = quantize_int4(torch.randn(40, 128, generator=gen), 32)
    x = torch.randn(7, 128, generator=gen)
    kernel = getattr(ops, fn)
    together = kernel(x, q.q, q.scales, q.zeros, 32)
    for i in range(7):
        assert torch.equal(kernel(x[i : i + 1].contiguous(), q.q, q.scales, q.zeros, 32)[0], together[i])


def test_bf16_activations_in_and_out(ops: object) -> None:
    gen = torch.Generator().manual_seed(5)
    q = quantize_int4(torch.randn(40, 128, generator=gen), 32)
    x = torch.randn(3, 128, generator=gen).bfloat16()
    for fn in ("int4_matmul", "int4_matmul_a8"):
        y = getattr(ops, fn)(x, q.q, q.scales, q.zeros, 32)
        want = getattr(ops, fn)(x.float(), q.q, q.scales, q.zeros, 32)
        assert y.dtype == torch.bfloat16
        assert torch.equal(y, want.bfloat16())  # widened exactly, rounded once to nearest even


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_is_exact_in_the_activation_dtype(ops: object, dtype: torch.dtype) -> None:
    w = torch.randn(37, 128)
    q4, q8 = quantize_int4(w, 64), quantize_int8(w, 32)
    d4 = ops.int4_dequantize(q4.q, q4.scales, q4.zeros, 64, 5, 37, dtype)  # type: ignore[attr-defined]
    d8 = ops.int8_dequantize(q8.q, q8.scales, 32, 0, 20, dtype)  # type: ignore[attr-defined]
    assert torch.equal(d4, q4.dequantize()[5:].to(dtype))
    assert torch.equal(d8, q8.dequantize()[:20].to(dtype))


def test_kernels_reject_a_group_that_does_not_divide_k(ops: object) -> None:
    q = quantize_int4(torch.randn(4, 96), 32)
    with pytest.raises(RuntimeError, match="group_size"):
        ops.int4_matmul(torch.randn(1, 96), q.q, q.scales, q.zeros, 64)  # type: ignore[attr-defined]


def test_isa_choice_follows_cpu_flags_and_the_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_CPU_ISA", raising=False)
    avx2 = {"avx", "avx2", "fma", "f16c"}
    assert best_isa(avx2) == "avx2"
    assert best_isa(avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}) == "avx512"
    assert best_isa({"sse4_2"}) == "generic"
    monkeypatch.setenv("TANDEM_CPU_ISA", "avx2")
    assert best_isa(avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}) == "avx2"
    with pytest.raises(ValueError, match="TANDEM_CPU_ISA=avx512: this CPU lacks avx512bw"):
        monkeypatch.setenv("TANDEM_CPU_ISA", "avx512")
        best_isa(avx2)
    monkeypatch.setenv("TANDEM_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="choose one of avx512, avx2, generic"):
        best_isa(avx2)


def test_this_machine_reports_its_flags() -> None:
    flags = cpu_flags()
    assert runnable_isas(flags)[-1] == "generic"
    assert best_isa(flags) in runnable_isas(flags)

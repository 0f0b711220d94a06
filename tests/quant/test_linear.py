"""Every packed ``LinearMethod`` the registry can pick, against the reference math of its format.

CPU: Tandem's kernels (the GEMV path and the tiled dequantize-and-GEMM path), PyTorch's ops, W8A8.
Triton's kernel runs under the interpreter here and compiled on a GPU. The CUDA-only modules (tinygemm
int4, FP8 ``_scaled_mm``) are ``gpu``-marked; FP8's math is also checked on CPU through the same op.
"""

from __future__ import annotations

import pytest
import torch

from common.kernels.cpu import amx_enabled, quant_kernels
from common.model.linear import Linear
from common.quant import cpu_linear
from common.quant.cpu_linear import AMX_QUANT_MIN_ROWS, GEMV_MAX_ROWS, PANEL_MAX_ROWS_NO_VNNI, A8Method, PackedCPUMethod
from common.quant.formats import (
    QuantizedWeight,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    reference_a8_matmul,
    reference_fp8_matmul,
    reference_matmul,
    reference_w8a8_matmul,
)
from common.quant.registry import kernel_names, packed_method, to_device

CPU = torch.device("cpu")
HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (2e-2, 5e-2)}  # rtol, atol


def make_linear(weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype,
                kernel: str = "auto") -> Linear:
    """A ``Linear`` of ``weight``'s shape given the registry's method for it (as the after-load pass does)."""
    n, k = weight.shape
    layer = Linear(k, n, bias=bias is not None, device=device, dtype=dtype)
    if bias is not None:
        layer.bias = torch.nn.Parameter(bias.to(device, dtype), requires_grad=False)
    weight = to_device(weight, device)
    layer.set_method(packed_method(weight, device, dtype, kernel), weight)
    return layer


def _data(m: int, k: int = 128, n: int = 48, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) * 0.1, torch.randn(m, k, generator=gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 40])  # GEMV, then tiled GEMM
@pytest.mark.parametrize("fmt", ["int4", "int8", "int8-grouped"])
def test_tandem_cpu_linear_matches_reference(fmt: str, m: int, dtype: torch.dtype) -> None:
    w, x = _data(m)
    weight = quantize_int4(w, 64) if fmt == "int4" else quantize_int8(w, 32 if fmt == "int8-grouped" else None)
    bias = torch.randn(48)
    linear = make_linear(weight, bias, CPU, dtype, kernel="tandem_cpu")
    assert linear.method.name == "tandem_cpu"
    y = linear(x.to(dtype).view(1, m, 128))  # leading dims are kept, like nn.Linear
    assert y.shape == (1, m, 48) and y.dtype == dtype
    expected = reference_matmul(x.to(dtype), weight) + bias
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(y[0].float(), expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 40, 70])
@pytest.mark.parametrize("fmt", ["int4", "int8", "int8-grouped", "int8-unpaneled", "int4-unpaneled"])
def test_the_default_cpu_linear_rounds_activations_where_its_kernel_does(fmt: str, m: int, dtype: torch.dtype) -> None:
    # weights in 16-row panels round x at every size (above PANEL_MAX_ROWS_NO_VNNI only with VNNI), except
    # bf16 batches of AMX_QUANT_MIN_ROWS and more where AMX runs (dequantized chunks, x as it is); a matrix
    # whose rows are no multiple of 16 keeps the row-major kernels, rounding x at decode sizes only
    w, x = _data(m, n=40 if fmt.endswith("unpaneled") else 48)
    weight = quantize_int4(w, 64) if fmt.startswith("int4") else quantize_int8(w, 32 if fmt == "int8-grouped" else None)
    linear = make_linear(weight, None, CPU, dtype)
    assert linear.method.name == "tandem_a8"
    paneled = not fmt.endswith("unpaneled")
    assert isinstance(linear.method, A8Method) and linear.method.panels == paneled
    y = linear(x.to(dtype))
    assert y.dtype == dtype
    if paneled:
        amx = dtype is torch.bfloat16 and m >= AMX_QUANT_MIN_ROWS and amx_enabled(quant_kernels())
        rounded = not amx and m <= (1 << 62 if quant_kernels().int8_panel_path() == "vnni" else PANEL_MAX_ROWS_NO_VNNI)
    else:
        rounded = m <= GEMV_MAX_ROWS
    reference = reference_a8_matmul if rounded else reference_matmul
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(y.float(), reference(x.to(dtype), weight), rtol=rtol, atol=atol)


@pytest.mark.parametrize("native", [False, True])
def test_bf16_batches_multiply_dequantized_tiles_in_fp32_without_native_bf16(
        native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # oneDNN's bf16 GEMM without AVX512-BF16 / AMX ran at a fifth of fp32's rate: tiles go through fp32 there
    w, x = _data(80, n=40)  # 40 rows: no panels, so 80 rows take the tiled GEMM on every CPU
    linear = make_linear(quantize_int4(w, 64), None, CPU, torch.bfloat16, kernel="tandem_cpu")
    monkeypatch.setattr(cpu_linear, "bf16_gemm_native", lambda: native)
    seen: list[torch.dtype] = []
    assert type(linear.method) is PackedCPUMethod
    dequantize = linear.method._dequantize

    def recording(row0: int, row1: int, dtype: torch.dtype) -> torch.Tensor:
        seen.append(dtype)
        return dequantize(row0, row1, dtype)

    monkeypatch.setattr(linear.method, "_dequantize", recording)
    y = linear(x.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and set(seen) == {torch.bfloat16 if native else torch.float32}
    rtol, atol = TOLERANCE[torch.bfloat16]
    expected = reference_matmul(x.to(torch.bfloat16), quantize_int4(w, 64))
    torch.testing.assert_close(y.float(), expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("fmt", ["int8", "int8-grouped", "int4"])
def test_paneled_rows_and_dequantized_tiles_are_the_weight(fmt: str) -> None:
    w, _ = _data(1, n=64)
    weight = quantize_int4(w, 32) if fmt == "int4" else quantize_int8(w, 32 if fmt == "int8-grouped" else None)
    linear = make_linear(weight, None, CPU, torch.float32)
    method = linear.method
    assert isinstance(method, A8Method) and method.panels
    full = weight.dequantize()
    torch.testing.assert_close(method._dequantize(5, 37, torch.float32), full[5:37], rtol=0, atol=0)
    assert linear.weight_bytes == weight.nbytes  # the same bytes, interleaved
    ids = torch.tensor([0, 17, 63, 16, 5])
    if fmt.startswith("int8"):
        rows = method.rows(linear, ids)
        assert rows is not None
        torch.testing.assert_close(rows, full[ids], rtol=0, atol=0)
        q = method.int8_q(linear)
        assert q is not None and torch.equal(q, weight.q)
    else:
        assert method.rows(linear, ids) is None  # 4-bit rows are no lookup table


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_torch_cpu_ops_match_reference(fmt: str) -> None:
    w, x = _data(5)
    weight = quantize_int4(w, 32) if fmt == "int4" else quantize_int8(w)
    linear = make_linear(weight, None, CPU, torch.bfloat16, kernel="torch")
    assert linear.method.name == "torch"
    expected = reference_matmul(x.bfloat16(), weight)
    torch.testing.assert_close(linear(x.bfloat16()).float(), expected, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("m", [1, 7, 33])
def test_w8a8_matches_its_reference(m: int) -> None:
    w, x = _data(m)
    weight = quantize_int8(w)
    linear = make_linear(weight, None, CPU, torch.float32, kernel="int_mm")
    torch.testing.assert_close(linear(x), reference_w8a8_matmul(x, weight), rtol=1e-5, atol=1e-5)


def test_reference_linear_runs_every_format() -> None:
    w, x = _data(2)
    for weight in (quantize_int4(w, 32), quantize_int8(w), quantize_fp8(w)):
        linear = make_linear(weight, None, CPU, torch.float32, kernel="reference")
        torch.testing.assert_close(linear(x), reference_matmul(x, weight))
        assert linear.weight_bytes == weight.nbytes


def test_fp8_scaled_mm_math_matches_reference_on_cpu() -> None:
    # The CUDA module's arithmetic (per-token e4m3 activations, row-wise scales) through the same op.
    from common.quant.formats import quantize_rows_fp8

    w, x = _data(4)
    weight = quantize_fp8(w)
    xq, xs = quantize_rows_fp8(x)
    try:
        y = torch._scaled_mm(xq, weight.q.T, scale_a=xs, scale_b=weight.scales.view(1, -1), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"this torch has no CPU _scaled_mm: {exc}")
    torch.testing.assert_close(y.float(), reference_fp8_matmul(x, weight), rtol=2e-2, atol=2e-2)


def test_unknown_kernel_names_the_flag_and_the_choices() -> None:
    w, _ = _data(1)
    with pytest.raises(ValueError, match=r"--quantization-kernel 'triton' cannot run int4 weights on cpu; "
                                         r"choose auto or one of tandem_a8, tandem_cpu, torch, reference"):
        make_linear(quantize_int4(w, 32), None, CPU, torch.float32, kernel="triton")
    assert kernel_names("fp8", torch.device("cuda")) == ("scaled_mm", "reference")


@pytest.mark.parametrize("fmt", ["int4", "int8", "int8-grouped"])
@pytest.mark.parametrize("m", [1, 20])
def test_triton_weight_only_matches_reference(fmt: str, m: int) -> None:
    from common.kernels.triton import quant as triton_kernels

    if not HAS_CUDA and not triton_kernels.INTERPRETED:
        pytest.skip("no GPU, and Triton was imported before TRITON_INTERPRET=1 was set")
    device = torch.device("cuda" if HAS_CUDA else "cpu")
    w, x = _data(m, k=96, n=40)
    weight = quantize_int4(w, 32) if fmt == "int4" else quantize_int8(w, 32 if fmt == "int8-grouped" else None)
    q = weight.q.to(device)
    zeros = getattr(weight, "zeros", None)
    y = triton_kernels.weight_only_matmul(x.to(device), q, weight.scales.to(device),
                                          None if zeros is None else zeros.to(device), weight.group_size)
    torch.testing.assert_close(y.cpu(), reference_matmul(x, weight), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("fmt", ["int4-triton", "int4-torch", "int8-triton", "fp8"])
def test_cuda_linear_matches_reference(fmt: str) -> None:
    cuda = torch.device("cuda")
    w, x = _data(9, k=256, n=128)
    weight: QuantizedWeight
    if fmt == "fp8":
        if torch.cuda.get_device_capability() < (8, 9):
            pytest.skip("FP8 needs compute capability >= 8.9")
        weight = quantize_fp8(w)
        expected = reference_fp8_matmul(x, weight)
        kernel = "scaled_mm"
    else:
        weight = quantize_int4(w, 32) if fmt.startswith("int4") else quantize_int8(w)
        expected = reference_matmul(x.bfloat16().float(), weight)
        kernel = fmt.split("-")[1]
    linear = make_linear(weight, None, cuda, torch.bfloat16, kernel=kernel)
    y = linear(x.to(cuda, torch.bfloat16)).float().cpu()
    torch.testing.assert_close(y, expected, rtol=3e-2, atol=3e-2)

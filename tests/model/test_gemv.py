"""The CPU GEMV for float weights (``dense_matmul``) against ``F.linear``, on every build this CPU runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from common.model import gemv
from common.quant.cpu_kernels import quant_kernels, runnable_isas

ISAS = runnable_isas()[:2]
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2)}


@pytest.fixture(params=ISAS)
def ops(request: pytest.FixtureRequest) -> object:
    return quant_kernels(request.param)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize(("k", "n"), [(64, 40), (96, 33), (100, 7), (576, 17)])  # K tails, odd N: row tails
def test_dense_matmul_matches_linear(ops: object, m: int, k: int, n: int, w_dtype: torch.dtype,
                                     x_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(m * 100 + k + n)
    w = torch.randn(n, k, generator=gen).to(w_dtype)
    x = torch.randn(m, k, generator=gen).to(x_dtype)
    y = ops.dense_matmul(x, w)  # type: ignore[attr-defined]
    assert y.dtype == x_dtype and y.shape == (m, n)
    want = nn.functional.linear(x.float(), w.float())  # exact products, fp32 sums
    rtol, atol = TOLERANCE[x_dtype]
    torch.testing.assert_close(y.float(), want, rtol=rtol, atol=atol * k ** 0.5)


def test_a_row_does_not_depend_on_the_rows_beside_it(ops: object) -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(37, 160, generator=gen).bfloat16()
    x = torch.randn(7, 160, generator=gen).bfloat16()
    together = ops.dense_matmul(x, w)  # type: ignore[attr-defined]
    for i in range(7):
        assert torch.equal(ops.dense_matmul(x[i : i + 1].contiguous(), w)[0], together[i])  # type: ignore[attr-defined]


def test_gemv_layers_replace_linear_and_keep_its_results(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CPU_GEMV", "auto")
    assert gemv.wanted(torch.device("cpu"))
    assert not gemv.wanted(torch.device("meta"))
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 16, bias=False))
    reference = [nn.functional.linear(torch.ones(3, 64), model[0].weight, model[0].bias)]
    assert gemv.gemv_linears(model, bucketed=False) == 2
    assert all(type(layer) is gemv.GemvLinear for layer in model)
    x = torch.randn(3, 64)
    torch.testing.assert_close(model(x), nn.functional.linear(nn.functional.linear(x, model[0].weight, model[0].bias),
                                                              model[1].weight))
    torch.testing.assert_close(model[0](torch.ones(3, 64)), reference[0])
    big = torch.randn(40, 64)  # above GEMV_MAX_ROWS: the library's matmul
    torch.testing.assert_close(model[0](big), nn.functional.linear(big, model[0].weight, model[0].bias))


def test_the_mode_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CPU_GEMV", "off")
    assert not gemv.wanted(torch.device("cpu"))
    monkeypatch.setenv("TANDEM_CPU_GEMV", "sometimes")
    with pytest.raises(ValueError, match="TANDEM_CPU_GEMV='sometimes'; choose one of auto, on, off"):
        gemv.wanted(torch.device("cpu"))


def test_the_loaded_model_uses_them_for_the_tied_head_too(tiny_model_dir: object) -> None:
    from common.model.loader import load_model

    model = load_model(tiny_model_dir, dtype="float32")
    assert any(type(m) is gemv.GemvLinear for m in model.modules())
    assert model.head_matmul is gemv.linear

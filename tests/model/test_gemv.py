"""The CPU GEMV for float weights (``dense_matmul``) against ``F.linear``, on every build this CPU runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from common.kernels import cpu as cpu_kernels
from common.kernels.cpu import quant_kernels
from common.kernels.isa import cpu_flags, runnable_isas
from common.model import gemv, start_races
from common.model.linear import Linear, TiedEmbedding, TorchMethod
from common.model.row_buckets import bucket_rows, bucket_values
from common.quant.registry import float_method

ISAS = runnable_isas()[:2]
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2)}


@pytest.fixture(params=ISAS)
def ops(request: pytest.FixtureRequest) -> object:
    return quant_kernels(request.param)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 12, 17, 32])  # up to the largest measured limit (GEMV_PROBES)
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


def _float_layer(weight: torch.Tensor, bias: torch.Tensor | None = None, panels: bool = True) -> Linear:
    layer = Linear.of(weight.clone(), None if bias is None else bias.clone())
    layer.set_method(float_method(layer, torch.device("cpu"), weight.dtype, panels))
    return layer


def test_the_registry_gives_float_layers_the_gemv_methods_and_they_keep_the_results(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CPU_GEMV", "auto")
    monkeypatch.setenv("TANDEM_CPU_PANELS", "on")  # whether they pay here: test_panels_are_held_only_where_they_pay
    assert gemv.wanted(torch.device("cpu"))
    assert not gemv.wanted(torch.device("meta"))
    # 48 rows: panels; 17 rows (no multiple of 16): the row-major GEMV
    w0, b0, w1 = torch.randn(48, 64), torch.randn(48), torch.randn(17, 48)
    first, second = _float_layer(w0, b0), _float_layer(w1)
    assert type(first.method) is gemv.PanelMethod and type(second.method) is gemv.GemvMethod
    assert "weight" not in dict(first.named_parameters()) and first.get_buffer("panels").numel() == w0.numel()
    x = torch.randn(3, 64)
    want = nn.functional.linear(nn.functional.linear(x, w0, b0), w1)
    torch.testing.assert_close(second(first(x)), want, rtol=1e-4, atol=1e-4)  # other summation orders
    big = torch.randn(300, 64)  # above PANEL_MAX_ROWS: panels with AMX, else unpacked tiles through torch's GEMM
    torch.testing.assert_close(first(big), nn.functional.linear(big, w0, b0), rtol=1e-4, atol=1e-4)
    assert type(_float_layer(w0, panels=False).method) is gemv.GemvMethod  # a caller that slices it next
    monkeypatch.setenv("TANDEM_CPU_PANELS", "off")
    assert type(_float_layer(w0).method) is gemv.GemvMethod
    monkeypatch.setenv("TANDEM_CPU_GEMV", "off")
    assert type(_float_layer(w0).method) is TorchMethod


NO_AMX = 1 << 62  # dense_matmul_panel's amx_min_rows: never


def _skip_same_loop(ops: object, dtype: torch.dtype, amx_min_rows: int) -> None:
    """amx_min_rows=1 runs the NO_AMX case's loop again where there is no AMX path (fp32; no AMX)."""
    if amx_min_rows != NO_AMX and (dtype is not torch.bfloat16 or ops.dense_panel_path() != "amx"):  # type: ignore[attr-defined]
        pytest.skip("no AMX path here: the same loop as amx_min_rows=NO_AMX")


@pytest.mark.parametrize("amx_min_rows", [1, NO_AMX])  # AMX tiles where the CPU has them; the vector loops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 15, 17, 33, 64])  # every tile shape (8, 4, 1-7 left; 32, 16)
@pytest.mark.parametrize(("k", "n"), [(48, 32), (64, 16), (96, 48), (576, 80)])  # one-panel tails; K % 32 != 0
def test_dense_matmul_panel_matches_linear(ops: object, m: int, k: int, n: int, dtype: torch.dtype,
                                           amx_min_rows: int) -> None:
    _skip_same_loop(ops, dtype, amx_min_rows)
    gen = torch.Generator().manual_seed(m * 100 + k + n + 5)
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    y = ops.dense_matmul_panel(x, gemv.pack_panels(w), amx_min_rows, False)  # type: ignore[attr-defined]
    assert y.dtype == dtype and y.shape == (m, n)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(y.float(), nn.functional.linear(x.float(), w.float()), rtol=rtol, atol=atol * k ** 0.5)
    assert torch.equal(gemv.unpack_panels(gemv.pack_panels(w)), w)


@pytest.mark.parametrize("amx_min_rows", [1, NO_AMX])
@pytest.mark.parametrize("m", [1, 9, 64])
def test_float_out_is_the_bf16_output_before_its_rounding(ops: object, m: int, amx_min_rows: int) -> None:
    # An LM head's logits: the same fp32 sums, not rounded to bf16 (and no second pass to widen them).
    _skip_same_loop(ops, torch.bfloat16, amx_min_rows)
    gen = torch.Generator().manual_seed(m)
    panels = gemv.pack_panels(torch.randn(80, 576, generator=gen).bfloat16())
    x = torch.randn(m, 576, generator=gen).bfloat16()
    rounded = ops.dense_matmul_panel(x, panels, amx_min_rows, False)  # type: ignore[attr-defined]
    sums = ops.dense_matmul_panel(x, panels, amx_min_rows, True)  # type: ignore[attr-defined]
    assert (rounded.dtype, sums.dtype) == (torch.bfloat16, torch.float32)
    assert torch.equal(sums.bfloat16(), rounded)
    assert not torch.equal(sums, rounded.float())  # the rounding is really gone


def test_a_tied_panel_head_returns_fp32_logits() -> None:
    weight = torch.randn(48, 64).bfloat16()
    layer = Linear.of(weight.clone())
    layer.float_out = True
    layer.set_method(float_method(layer, torch.device("cpu"), torch.bfloat16))
    assert type(layer.method) is gemv.PanelMethod
    x = torch.randn(3, 64).bfloat16()
    for rows in (x, torch.cat([x] * 100)):  # the panel kernel, and the unpacked tiles above PANEL_MAX_ROWS
        y = layer(rows)
        assert y.dtype == torch.float32
        torch.testing.assert_close(y, nn.functional.linear(rows.float(), weight.float()), rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("amx_min_rows", [1, NO_AMX])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [37, 47])  # AMX: a group of 32 rows, then a padded tail; vdpbf16ps: 8s, then 5 or 7
def test_a_panel_row_does_not_depend_on_the_rows_beside_it(ops: object, dtype: torch.dtype, amx_min_rows: int,
                                                           rows: int) -> None:
    _skip_same_loop(ops, dtype, amx_min_rows)
    gen = torch.Generator().manual_seed(2)
    panels = gemv.pack_panels(torch.randn(48, 160, generator=gen).to(dtype))
    x = torch.randn(rows, 160, generator=gen).to(dtype)
    together = ops.dense_matmul_panel(x, panels, amx_min_rows, False)  # type: ignore[attr-defined]
    for i in (0, 1, 16, 31, 32, 36, rows - 1):
        alone = ops.dense_matmul_panel(x[i : i + 1].contiguous(), panels, amx_min_rows, False)  # type: ignore[attr-defined]
        assert torch.equal(alone[0], together[i])


def test_the_amx_path_is_reported_and_its_mode_checked(ops: object, monkeypatch: pytest.MonkeyPatch) -> None:
    path = ops.dense_panel_path()  # type: ignore[attr-defined]
    flags = cpu_flags()
    assert path in ("amx", "avx512bf16", "fma")
    if path == "amx":
        assert {"amx_tile", "amx_bf16"} <= flags
    monkeypatch.setattr(gemv, "_limits", {})
    monkeypatch.setattr(cpu_kernels, "_amx_state", {})
    monkeypatch.setenv("TANDEM_CPU_AMX", "off")
    assert gemv._amx_min_rows(ops) == NO_AMX  # type: ignore[arg-type]
    # without AMX, bf16 panels multiply up to the crossover measured here (one of the probes, or every count)
    limits = (*gemv.CROSSOVER_PROBES, *gemv.TILED_PROBES, NO_AMX)
    assert gemv._panel_max_rows(ops) in limits  # type: ignore[arg-type]
    monkeypatch.setattr(gemv, "_limits", {})
    monkeypatch.setenv("TANDEM_CPU_AMX", "on")
    if path == "amx":
        assert gemv._amx_min_rows(ops) == gemv.AMX_MIN_ROWS  # type: ignore[arg-type]
    else:
        with pytest.raises(RuntimeError, match="TANDEM_CPU_AMX=on"):
            gemv._amx_min_rows(ops)  # type: ignore[arg-type]
    monkeypatch.setattr(gemv, "_limits", {})
    monkeypatch.setenv("TANDEM_CPU_AMX", "maybe")
    with pytest.raises(ValueError, match="TANDEM_CPU_AMX='maybe'; choose one of auto, on, off"):
        gemv._amx_min_rows(ops)  # type: ignore[arg-type]


def test_the_crossover_is_where_the_panels_first_lose() -> None:
    # rows -> (panel kernel s, torch's GEMM s)
    assert gemv.crossover_rows({8: (1, 2), 16: (1, 2), 32: (3, 2), 64: (1, 2)}) == 16  # not past a loss
    assert gemv.crossover_rows({8: (1, 2), 256: (1, 1)}) == 256  # a tie keeps the panels
    assert gemv.crossover_rows({8: (3, 2), 16: (3, 2)}) == 8  # the smallest probe when they always lose


def test_the_panels_limit_is_raced_against_the_tiles_that_take_the_rows_above_it(
        ops: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Above their limit a layer's panels are unpacked into tiles for torch's GEMM (``tiled_matmul``), which cost
    2-3x the panels up to 128 rows on session 34's EPYC where torch's GEMM on row-major weights was at par: the
    limit is where the panels lose to the tiles, from the row-major GEMM's crossover up, every count when they
    never do. Stand-in races (rows -> (panels s, other s)); then the real one runs."""
    races: list[tuple[str, tuple[int, ...]]] = []

    def stand_in(tiled: dict[int, tuple[float, float]]) -> None:
        def crossover(_ops: object, _dtype: torch.dtype, probes: tuple[int, ...] = gemv.CROSSOVER_PROBES,
                      ) -> dict[int, tuple[float, float]]:
            races.append(("gemm", probes))
            return {m: (1.0, 2.0) if m <= 64 else (2.0, 1.0) for m in probes}  # the row-major GEMM from 128

        def against_tiles(_ops: object, _dtype: torch.dtype, probes: tuple[int, ...] = gemv.TILED_PROBES,
                          ) -> dict[int, tuple[float, float]]:
            races.append(("tiled", probes))
            return {m: tiled[m] for m in probes}

        monkeypatch.setattr(gemv, "measure_crossover", crossover)
        monkeypatch.setattr(gemv, "measure_tiled", against_tiles)
        monkeypatch.setattr(gemv, "_limits", {})

    stand_in({128: (1.0, 3.0), 256: (1.0, 1.5), 512: (1.0, 1.1)})  # the panels win at every probe
    assert gemv._panel_max_rows(ops, torch.float32) == NO_AMX  # type: ignore[arg-type]
    assert races == [("gemm", gemv.CROSSOVER_PROBES), ("tiled", (128, 256, 512))]  # the tiles above 64 only
    assert gemv.panels_pay(ops, torch.float32)  # type: ignore[arg-type]
    stand_in({128: (1.0, 3.0), 256: (1.0, 1.5), 512: (1.2, 1.1)})
    assert gemv._panel_max_rows(ops, torch.float32) == 256  # type: ignore[arg-type]
    stand_in({128: (1.2, 1.1), 256: (1.2, 1.1), 512: (1.2, 1.1)})  # the tiles win past the GEMM's crossover
    assert gemv._panel_max_rows(ops, torch.float32) == 64  # type: ignore[arg-type]
    # whether panels pay at all is the row-major GEMM's race alone
    races.clear()
    monkeypatch.setattr(gemv, "_limits", {})
    assert gemv.panels_pay(ops, torch.float32) and races == [("gemm", gemv.CROSSOVER_PROBES)]  # type: ignore[arg-type]
    monkeypatch.undo()
    # the real race: both sides timed at every probe, and the tiles give the panels' products
    timings = gemv.measure_tiled(ops, torch.float32, (8, 32))  # type: ignore[arg-type]
    assert sorted(timings) == [8, 32] and all(min(t) > 0 for t in timings.values())
    w = torch.randn(48, 64)
    x = torch.randn(37, 64)
    for bucketed in (False, True):
        out = gemv.tiled_matmul(gemv.pack_panels(w), x, 48, bucketed)
        assert out.shape == (37, 48)
        torch.testing.assert_close(out, x @ w.T, rtol=1e-5, atol=1e-5)


def test_a_crossover_out_of_order_is_timed_again() -> None:
    # rows -> (kernel s, GEMM s): a loss at 16 below a win at 32 (and that win above it) is one burst's doing
    first = {8: (1.0, 2.0), 16: (3.0, 2.0), 32: (1.0, 2.0), 64: (3.0, 2.0)}
    asked: list[tuple[int, ...]] = []

    def race(probes: tuple[int, ...]) -> dict[int, tuple[float, float]]:
        asked.append(probes)
        return {16: (1.5, 2.0), 32: (2.5, 0.9)}  # 32's GEMM ran in a burst the first time

    settled = gemv.retime_out_of_order(first, race)
    assert asked == [(16, 32)]  # both sides of the break, once: in order after it
    assert settled[16] == (1.5, 2.0) and settled[32] == (1.0, 0.9)  # the best of each side's timings
    assert gemv.crossover_rows(first) == 8 and gemv.crossover_rows(settled) == 16
    # in order (wins, then losses): nothing timed again
    asked.clear()
    in_order = {8: (1.0, 2.0), 16: (1.0, 2.0), 32: (3.0, 2.0)}
    assert gemv.retime_out_of_order(in_order, race) == in_order and asked == []


def test_panels_are_held_only_where_they_pay(ops: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from common.model.linear import Linear
    from common.quant.registry import float_method

    layer = Linear(64, 48, bias=False)
    for crossover, panels in ((16, False), (gemv.PANEL_MIN_CROSSOVER, True)):
        monkeypatch.setattr(gemv, "_limits", {f"measured_{torch.float32}": crossover})
        assert gemv.panels_pay(ops, torch.float32) is panels  # type: ignore[arg-type]
        method = float_method(layer, torch.device("cpu"), torch.float32)
        assert isinstance(method, gemv.PanelMethod if panels else gemv.GemvMethod)
    monkeypatch.setenv("TANDEM_CPU_PANELS", "on")  # on: panels whatever the measurement
    monkeypatch.setattr(gemv, "_limits", {f"measured_{torch.float32}": 16})
    assert isinstance(float_method(layer, torch.device("cpu"), torch.float32), gemv.PanelMethod)
    monkeypatch.setattr(gemv, "_limits", {})
    timings = gemv.measure_crossover(ops, torch.float32)  # type: ignore[arg-type]
    assert sorted(timings) == list(gemv.CROSSOVER_PROBES) and all(min(t) > 0 for t in timings.values())


def test_the_row_major_gemv_runs_up_to_its_measured_limit(ops: object, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    class Spy:  # the kernels, counting the rows dense_matmul is given
        def dense_matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            calls.append(x.shape[0])
            return ops.dense_matmul(x, w)  # type: ignore[attr-defined, no-any-return]

    monkeypatch.setattr(gemv, "_limits", {f"gemv_{torch.float32}": 12})
    w, b = torch.randn(40, 64), torch.randn(40)
    layer = Linear.of(w.clone(), b.clone())
    layer.set_method(gemv.GemvMethod(Spy(), bucketed=False))  # type: ignore[arg-type]
    x = torch.randn(13, 64)
    for m in (1, 12, 13):  # 13: past the limit, torch's GEMM
        torch.testing.assert_close(layer(x[:m]), nn.functional.linear(x[:m], w, b), rtol=1e-5, atol=1e-4)
    assert calls == [1, 12]
    assert gemv._gemv_max_rows(ops, torch.float32) == 12  # type: ignore[arg-type]  # the measured limit, as set
    timings = gemv.measure_gemv(ops, torch.float32)  # type: ignore[arg-type]
    assert sorted(timings) == list(gemv.GEMV_PROBES) and all(min(t) > 0 for t in timings.values())
    assert gemv.crossover_rows(timings) in gemv.GEMV_PROBES


def test_fp32_weights_above_the_gemv_rows_go_to_onednn_where_it_pays(ops: object,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    if not gemv.onednn_available():
        pytest.skip("this torch build has no oneDNN linear")
    monkeypatch.delenv("TANDEM_CPU_ONEDNN", raising=False)  # auto: the measured choice, set below
    gemm_rows: list[int] = []
    linear = gemv.onednn_linear

    def counted(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        gemm_rows.append(x.shape[0])
        return linear(x, blocked, bias)

    monkeypatch.setattr(gemv, "onednn_linear", counted)
    w, b = torch.randn(40, 64), torch.randn(40)
    x = torch.randn(300, 64)
    for pays in (1, 0):
        monkeypatch.setattr(gemv, "_limits", {f"gemv_{torch.float32}": 12, f"onednn_{torch.float32}": pays})
        gemm_rows.clear()
        layer = Linear.of(w.clone(), b.clone())
        layer.set_method(gemv.GemvMethod(ops, bucketed=False))  # type: ignore[arg-type]
        for m in (1, 12, 13, 300):
            torch.testing.assert_close(layer(x[:m]), nn.functional.linear(x[:m], w, b), rtol=1e-5, atol=1e-4)
        # A second copy of the weight in oneDNN's layout, counted in the layer's bytes, where oneDNN pays.
        assert gemm_rows == ([13, 300] if pays else [])
        assert ("onednn_weight" in dict(layer.named_buffers())) == bool(pays)
        assert layer.weight_bytes == (2 if pays else 1) * w.nbytes + b.nbytes
        assert ("oneDNN above 12 rows" in layer.method.describe()) == bool(pays)
    # Each row's result does not depend on the rows beside it on oneDNN's path either.
    blocked = gemv.onednn_pack(w)
    whole = counted(x, blocked)
    for m in (13, 17, 64, 257):
        assert torch.equal(counted(x[:m], blocked), whole[:m])


def test_the_onednn_choice_is_measured_and_its_mode_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    if not gemv.onednn_available():
        pytest.skip("this torch build has no oneDNN linear")
    monkeypatch.delenv("TANDEM_CPU_ONEDNN", raising=False)
    monkeypatch.setattr(gemv, "_limits", {})
    assert not gemv.onednn_pays(torch.bfloat16)  # fp32 weights only
    chosen = gemv.onednn_pays(torch.float32)  # auto: measured once against F.linear, then kept
    assert gemv._limits == {f"onednn_{torch.float32}": int(chosen)}
    timings = start_races.race(torch.float32, gemv.ONEDNN_PROBES, gemv.onednn_pack, gemv.onednn_linear)
    assert sorted(timings) == list(gemv.ONEDNN_PROBES) and all(min(t) > 0 for t in timings.values())
    monkeypatch.setattr(gemv, "_limits", {})
    monkeypatch.setenv("TANDEM_CPU_ONEDNN", "off")
    assert not gemv.onednn_pays(torch.float32) and gemv._limits == {}
    monkeypatch.setenv("TANDEM_CPU_ONEDNN", "on")
    assert gemv.onednn_pays(torch.float32) and gemv._limits == {}
    monkeypatch.setattr(gemv, "onednn_available", lambda: False)
    with pytest.raises(RuntimeError, match="TANDEM_CPU_ONEDNN=on but this torch build has no oneDNN linear"):
        gemv.onednn_pays(torch.float32)
    monkeypatch.setenv("TANDEM_CPU_ONEDNN", "sometimes")
    with pytest.raises(ValueError, match="TANDEM_CPU_ONEDNN='sometimes'; choose one of auto, on, off"):
        gemv.onednn_pays(torch.float32)


def test_panel_layouts_are_refused_when_wrong(ops: object) -> None:
    with pytest.raises(RuntimeError, match=r"\[N/16, K/2, 16, 2\]"):
        ops.dense_matmul_panel(torch.randn(1, 64), torch.randn(48, 64).bfloat16(), 1, False)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="x must be a contiguous"):
        ops.dense_matmul_panel(torch.randn(1, 32), gemv.pack_panels(torch.randn(16, 64)), 1, False)  # type: ignore[attr-defined]


def test_the_mode_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CPU_GEMV", "off")
    assert not gemv.wanted(torch.device("cpu"))
    monkeypatch.setenv("TANDEM_CPU_GEMV", "sometimes")
    with pytest.raises(ValueError, match="TANDEM_CPU_GEMV='sometimes'; choose one of auto, on, off"):
        gemv.wanted(torch.device("cpu"))


def test_the_loaded_model_uses_them_for_the_tied_head_too(tiny_model_dir: object,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from common.attention.metadata import AttentionMetadata
    from common.model.loader import load_model

    monkeypatch.setenv("TANDEM_CPU_PANELS", "on")  # whether fp32 panels pay here: a measurement

    model = load_model(tiny_model_dir, dtype="float32")
    monkeypatch.setenv("TANDEM_CPU_GEMV", "off")
    reference = load_model(tiny_model_dir, dtype="float32")  # F.linear everywhere
    assert any(isinstance(m, Linear) and type(m.method) is gemv.PanelMethod for m in model.modules())
    assert type(model.lm_head.method) is gemv.PanelMethod and model.lm_head.float_out
    assert type(reference.lm_head.method) is TorchMethod
    assert model.weight_bytes == reference.weight_bytes
    for n in (1, 12):  # decode size and a prefill
        ids = torch.arange(1, n + 1)
        meta = AttentionMetadata.build([n], [0])
        with torch.no_grad():
            got = model.compute_logits(model(ids, torch.arange(n), meta))
            want = reference.compute_logits(reference(ids, torch.arange(n), meta))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_tied_head_as_panels_is_read_by_the_lookup_too(tiny_model_factory: Callable[..., Path],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from common.model.loader import load_model

    monkeypatch.setenv("TANDEM_CPU_PANELS", "on")  # whether fp32 panels pay here: a measurement

    model_dir = tiny_model_factory(tie_word_embeddings=True)
    loaded = load_model(model_dir, dtype="float32", prepare=False)  # one Parameter at both ends
    table = loaded.embed_tokens.weight.detach()
    model = load_model(model_dir, dtype="float32")
    assert type(model.lm_head.method) is gemv.PanelMethod and isinstance(model.embed_tokens, TiedEmbedding)
    ids = torch.tensor([0, 17, 63, 16])
    assert torch.equal(model.embed_tokens(ids), table[ids])
    x = torch.randn(2, table.shape[1])
    torch.testing.assert_close(model.lm_head(x), x @ table.T)
    # one copy of the matrix: the head's panels, no float table
    assert not any(p.shape == table.shape for p in model.parameters())
    assert model.weight_bytes == loaded.weight_bytes


def test_a_loss_beside_wins_is_timed_again_before_it_sets_the_crossover() -> None:
    # session 31's start-up: oneDNN (second) won at 256 and 2,048 rows, "lost" at 1,024 in one burst
    first = {256: (1.08, 0.93), 512: (2.14, 1.85), 1024: (6.70, 9.66), 2048: (13.55, 9.56)}
    asked: list[tuple[int, ...]] = []

    def race(probes: tuple[int, ...]) -> dict[int, tuple[float, float]]:
        asked.append(probes)
        return {m: (4.68, 3.36) for m in probes}

    settled = gemv.retime_losses_beside_wins(first, race)
    assert asked == [(1024,)]  # only the doubtful probe, once: the second look settled it
    assert settled[1024] == (4.68, 3.36) and settled[2048] == first[2048]
    assert gemv.onednn_from_rows(first) == 2048 and gemv.onednn_from_rows(settled) == 256

    # a loss that holds is kept (the best of every timing of each side), after every try
    def slow(probes: tuple[int, ...]) -> dict[int, tuple[float, float]]:
        asked.append(probes)
        return {m: (7.0, 9.0) for m in probes}

    asked.clear()
    held = gemv.retime_losses_beside_wins(first, slow, tries=3)
    assert asked == [(1024,)] * 3 and held[1024] == (6.70, 9.0)
    assert gemv.onednn_from_rows(held) == 2048

    # session 33's start-ups: oneDNN won at every probe but the largest, which set "panels at every size"
    lost_last = {256: (0.57, 0.55), 512: (1.13, 1.00), 1024: (2.33, 1.93), 2048: (4.87, 6.95)}
    asked.clear()

    def calm(probes: tuple[int, ...]) -> dict[int, tuple[float, float]]:
        asked.append(probes)
        return {m: (4.70, 3.40) for m in probes}

    settled = gemv.retime_losses_beside_wins(lost_last, calm)
    assert asked == [(2048,)] and gemv.onednn_from_rows(lost_last) == gemv.NO_AMX
    assert gemv.onednn_from_rows(settled) == 256

    # a loss at every probe is nothing to doubt: no second look
    lost_everywhere = {256: (1.0, 2.0), 1024: (1.0, 2.0)}
    asked.clear()
    assert gemv.retime_losses_beside_wins(lost_everywhere, race) == lost_everywhere and asked == []


def test_fp32_onednn_is_not_turned_off_by_one_burst(monkeypatch: pytest.MonkeyPatch) -> None:
    # onednn_pays: oneDNN (first) must win at every probe; a lone loss is timed again first
    calls: list[tuple[int, ...]] = []

    def race(dtype: torch.dtype, probes: tuple[int, ...], *rest: object) -> dict[int, tuple[float, float]]:
        calls.append(probes)
        if len(calls) == 1:
            return {m: ((3.0, 2.0) if m == probes[-1] else (1.0, 2.0)) for m in probes}
        return {m: (1.5, 2.0) for m in probes}

    monkeypatch.setattr(start_races, "race", race)
    monkeypatch.setattr(gemv, "_limits", {})
    monkeypatch.setenv("TANDEM_CPU_ONEDNN", "auto")
    monkeypatch.setattr(gemv, "onednn_available", lambda: True)
    assert gemv.onednn_pays(torch.float32)
    assert calls == [gemv.ONEDNN_PROBES, (gemv.ONEDNN_PROBES[-1],)]
    # lost everywhere: nothing to doubt, oneDNN stays off
    calls.clear()
    monkeypatch.setattr(gemv, "_limits", {})
    def slower(dtype: torch.dtype, probes: tuple[int, ...], *rest: object) -> dict[int, tuple[float, float]]:
        calls.append(probes)
        return {m: (3.0, 2.0) for m in probes}

    monkeypatch.setattr(start_races, "race", slower)
    assert not gemv.onednn_pays(torch.float32)
    assert calls == [gemv.ONEDNN_PROBES]


def test_onednn_takes_bf16_panels_from_the_measured_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    # the rule: from the smallest probe where oneDNN (second) was no slower at it and every larger probe
    assert gemv.onednn_from_rows({256: (1, 2), 512: (2, 1), 1024: (2, 1)}) == 512
    assert gemv.onednn_from_rows({256: (2, 1), 512: (1, 2), 1024: (2, 1)}) == 1024  # not past a loss
    assert gemv.onednn_from_rows({256: (2, 1), 1024: (1, 1)}) == 256  # a tie goes to oneDNN
    assert gemv.onednn_from_rows({256: (2, 1), 1024: (1, 2)}) == gemv.NO_AMX  # lost at the largest: never
    ops = quant_kernels()
    monkeypatch.setattr(gemv, "_limits", {})
    monkeypatch.setenv("TANDEM_CPU_ONEDNN", "off")
    assert gemv.onednn_bf16_rows(ops) == gemv.NO_AMX
    monkeypatch.setenv("TANDEM_CPU_ONEDNN", "on")
    native = gemv._amx_min_rows(ops) < gemv.NO_AMX or ops.dense_panel_path() == "avx512bf16"  # type: ignore[arg-type]
    if not native or not gemv.onednn_available():
        assert gemv.onednn_bf16_rows(ops) == gemv.NO_AMX or not gemv.onednn_available()
        pytest.skip("no AMX tiles or AVX512-BF16, or no oneDNN here: bf16 panels never hand calls to oneDNN")
    assert gemv.onednn_bf16_rows(ops) == gemv.AMX_ONEDNN_PROBES[0]
    monkeypatch.setenv("TANDEM_CPU_ONEDNN", "auto")
    measured = gemv.onednn_bf16_rows(ops)  # measured once, then kept
    assert measured in (*gemv.AMX_ONEDNN_PROBES, gemv.NO_AMX) and gemv._limits["onednn_bf16_rows"] == measured

    # a layer holds the copy and sends calls from the limit on to oneDNN; below it, and its float_out sums, panels
    monkeypatch.setitem(gemv._limits, "onednn_bf16_rows", 8)
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 64, generator=gen).to(torch.bfloat16)
    bias = torch.randn(48, generator=gen).to(torch.bfloat16)

    def loaded(bucketed: bool) -> tuple[Linear, gemv.PanelMethod]:
        layer = Linear(64, 48, bias=True)
        layer.weight.data = weight.clone()
        layer.bias.data = bias.clone()  # type: ignore[union-attr]
        method = gemv.PanelMethod(ops, bucketed=bucketed)
        layer.method = method
        method.process_weights_after_loading(layer, None)
        return layer, method

    layer, method = loaded(bucketed=False)
    assert "onednn_weight" in layer._buffers and "oneDNN from 8 rows" in method.describe()
    calls: list[int] = []
    real = gemv.onednn_linear
    monkeypatch.setattr(gemv, "onednn_linear", lambda x, b, bias=None: calls.append(x.shape[0]) or real(x, b, bias))
    for m in (3, 7, 8, 40):
        x = torch.randn(m, 64, generator=gen).to(torch.bfloat16)
        y = method.apply(layer, x)
        want = nn.functional.linear(x.float(), weight.float(), bias.float())
        torch.testing.assert_close(y.float(), want, rtol=1.6e-2, atol=5e-2)
    assert calls == [8, 40]
    # bucketed (16-bit activations on CPU): oneDNN sees bucketed row counts only, the caller its own rows
    padded, bucketed = loaded(bucketed=True)
    calls.clear()
    for m in (37, 40, 45):
        x = torch.randn(m, 64, generator=gen).to(torch.bfloat16)
        y = bucketed.apply(padded, x)
        assert y.shape == (m, 48) and y.is_contiguous()
        want = nn.functional.linear(x.float(), weight.float(), bias.float())
        torch.testing.assert_close(y.float(), want, rtol=1.6e-2, atol=5e-2)
    assert calls == [bucket_rows(37), 40, bucket_rows(45)] == [40, 40, 48]
    # warmed at start-up: every bucket from the limit (8 here) to a step's most rows, once per weight shape
    calls.clear()
    model = nn.Sequential(layer, padded, loaded(bucketed=True)[0])  # unbucketed (not warmed), two of one shape
    assert gemv.warm_onednn_buckets(model, 40) == len(calls) == 19
    assert calls == bucket_values(8, 40) == [8, 9, 10, 11, 12, 13, 14, 15, 16, 18, 20, 22, 24, 26, 28, 30, 32, 36, 40]
    assert gemv.warm_onednn_buckets(model, 7) == 0  # no step reaches oneDNN's rows
    float_out = Linear(64, 48, bias=False)
    float_out.weight.data = weight.clone()
    float_out.float_out = True
    kept = gemv.PanelMethod(ops, bucketed=False)
    float_out.method = kept
    kept.process_weights_after_loading(float_out, None)
    assert "onednn_weight" not in float_out._buffers  # fp32 sums: the panels at every size

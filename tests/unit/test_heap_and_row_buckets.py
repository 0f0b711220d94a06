"""Heap trimming between engine steps and the row buckets of 16-bit CPU linears (common/engine/heap.py,
common/model/row_buckets.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from common.engine.heap import HeapTrimmer, trim_heap
from common.model.linear import Linear, TorchMethod
from common.model.row_buckets import bucket_rows, linear_bucketed, wanted


def test_trimmer_trims_at_most_once_per_interval() -> None:
    now = [0.0]
    calls: list[float] = []
    trimmer = HeapTrimmer(10.0, clock=lambda: now[0], trim=lambda: calls.append(now[0]) or True)
    for t in (1.0, 9.9, 10.0, 12.0, 19.9, 20.5, 31.0):
        now[0] = t
        trimmer.maybe_trim()
    assert calls == [10.0, 20.5, 31.0] and trimmer.num_trims == 3
    off = HeapTrimmer(0.0, clock=lambda: 1e9, trim=lambda: pytest.fail("trimmed while off"))
    off.maybe_trim()
    with pytest.raises(ValueError, match="interval"):
        HeapTrimmer(-1.0)


def test_trim_heap_runs_here() -> None:
    assert isinstance(trim_heap(), bool)  # glibc: malloc_trim; elsewhere a no-op


def test_buckets_are_few_and_waste_at_most_an_eighth() -> None:
    assert [bucket_rows(m) for m in (1, 7, 16)] == [1, 7, 16]  # decode batches: exact
    assert [bucket_rows(m) for m in (17, 18, 33, 65, 129, 257, 512, 513)] == [18, 18, 36, 72, 144, 288, 512, 576]
    for m in range(1, 4097):
        b = bucket_rows(m)
        assert m <= b and (b - m) <= m / 8 + 1e-9
    assert len({bucket_rows(m) for m in range(1, 513)}) == 56


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bucketed_linear_equals_linear_row_for_row(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    ref = nn.Linear(24, 40, bias=True).to(dtype)
    lin = Linear.of(ref.weight.detach().clone(), ref.bias.detach().clone())
    lin.set_method(TorchMethod(bucketed=True))
    for m in (1, 16, 17, 37, 100):
        x = torch.randn(m, 24).to(dtype)
        out = lin(x)
        assert out.shape == (m, 40)
        # each row is the padded matmul's row: compare with the reference at the same padded shape
        padded = torch.cat([x, x.new_zeros(bucket_rows(m) - m, 24)])
        torch.testing.assert_close(out, ref(padded)[:m], rtol=0, atol=0)
        torch.testing.assert_close(out.float(), ref(x).float(), rtol=2e-2, atol=2e-2)
    assert linear_bucketed(torch.randn(3, 5, 24).to(dtype), lin.weight).shape == (3, 5, 40)  # not 2-D: as is


def test_wanted_follows_dtype_device_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.delenv("TANDEM_ROW_BUCKETS", raising=False)
    assert wanted(cpu, torch.bfloat16) and wanted(cpu, torch.float16) and not wanted(cpu, torch.float32)
    assert not wanted(torch.device("cuda"), torch.bfloat16)
    monkeypatch.setenv("TANDEM_ROW_BUCKETS", "off")
    assert not wanted(cpu, torch.bfloat16)
    monkeypatch.setenv("TANDEM_ROW_BUCKETS", "on")
    assert wanted(cpu, torch.float32)
    monkeypatch.setenv("TANDEM_ROW_BUCKETS", "maybe")
    with pytest.raises(ValueError, match="TANDEM_ROW_BUCKETS"):
        wanted(cpu, torch.float32)

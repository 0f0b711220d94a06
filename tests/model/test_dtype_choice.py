"""``--dtype auto`` on CPU: the decision over injected timings, and the TANDEM_HOME cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.model import dtype_choice
from common.model.dtype_choice import DtypeTiming, cache_key, candidate_dtypes, choose_dtype, read_cached, write_cached
from common.model.loader import resolve_dtype


def _t(dtype: str, decode_us: float, prefill_us: float) -> DtypeTiming:
    return DtypeTiming(dtype, decode_us * 1e-6, prefill_us * 1e-6)


def test_faster_decode_wins() -> None:
    # AVX-512-BF16: bf16 halves the bytes streamed and its GEMM is native.
    assert choose_dtype([_t("float32", 560, 390), _t("bfloat16", 410, 200)]) == "bfloat16"
    assert choose_dtype([_t("float32", 400, 390), _t("bfloat16", 410, 200)]) == "float32"


def test_pathological_prefill_is_never_picked() -> None:
    # AVX2 without native bf16: faster GEMV (fewer bytes), but its GEMM at a fifth of fp32's speed (Zen 3).
    assert choose_dtype([_t("float32", 700, 400), _t("bfloat16", 500, 2000)]) == "float32"
    # exactly 1.25x is still allowed; just above is not
    assert choose_dtype([_t("float32", 700, 400), _t("bfloat16", 500, 500)]) == "bfloat16"
    assert choose_dtype([_t("float32", 700, 400), _t("bfloat16", 500, 501)]) == "float32"
    assert choose_dtype([_t("float32", 700, 400), _t("bfloat16", 500, 1000)], max_prefill_slowdown=3.0) == "bfloat16"


def test_three_candidates_and_ties() -> None:
    timings = [_t("float32", 700, 400), _t("bfloat16", 500, 300), _t("float16", 450, 350)]
    assert choose_dtype(timings) == "float16"
    assert choose_dtype([_t("bfloat16", 500, 300), _t("float32", 500, 400)]) == "float32"  # fp32 keeps a tie
    with pytest.raises(ValueError, match="float32"):
        choose_dtype([_t("bfloat16", 500, 300)])


def test_fp16_is_a_candidate_only_with_native_fp16() -> None:
    assert candidate_dtypes({"avx2", "avx512_bf16"}) == ["float32", "bfloat16"]
    assert candidate_dtypes({"avx512_fp16"}) == ["float32", "bfloat16", "float16"]


def test_cache_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = cache_key("EPYC", {"avx2", "fma"}, "2.9", 2, (576, 1536))
    assert key != cache_key("EPYC", {"avx2", "fma"}, "2.9", 1, (576, 1536))  # threads are part of it
    assert key != cache_key("EPYC", {"avx2", "fma", "avx512f"}, "2.9", 2, (576, 1536))
    monkeypatch.setattr(dtype_choice, "CHOICE_VERSION", "old")  # a choice made under another rule is stale
    assert key != cache_key("EPYC", {"avx2", "fma"}, "2.9", 2, (576, 1536))
    monkeypatch.undo()
    assert read_cached(tmp_path, key) is None
    write_cached(tmp_path, key, "bfloat16", [_t("float32", 1, 1)], "test")
    other = cache_key("EPYC", {"avx2"}, "2.9", 2, (576, 1536))
    write_cached(tmp_path, other, "float32", [_t("float32", 1, 1)], "test")
    assert read_cached(tmp_path, key) == "bfloat16"
    assert read_cached(tmp_path, other) == "float32"
    (tmp_path / dtype_choice.CACHE_FILE).write_text("not json")
    assert read_cached(tmp_path, key) is None  # a corrupt cache is measured again, not fatal


def test_auto_measures_once_then_reads_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def fake_measure(name: str, shape: tuple[int, int]) -> DtypeTiming:
        calls.append(name)
        return _t(name, 100 if name == "bfloat16" else 200, 300)

    monkeypatch.setattr(dtype_choice, "measure", fake_measure)
    assert resolve_dtype("auto", "cpu", home=tmp_path) == torch.bfloat16
    assert resolve_dtype("auto", "cpu", home=tmp_path) == torch.bfloat16
    # measured once, in rounds that alternate the dtypes (fp16 too where the CPU has native fp16)
    from common.kernels.isa import cpu_flags

    assert calls == candidate_dtypes(cpu_flags()) * dtype_choice.MEASURE_ROUNDS
    assert resolve_dtype("float32", "cpu", home=tmp_path) == torch.float32
    assert resolve_dtype("auto", "cuda", home=tmp_path) == torch.bfloat16


def test_rounds_keep_each_dtypes_best_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    # a neighbour's burst slows the first round of fp32 and the last of bf16: neither decides the choice
    probes = iter([_t("float32", 900, 4000), _t("bfloat16", 500, 2000), _t("float32", 700, 400),
                   _t("bfloat16", 450, 2100), _t("float32", 800, 450), _t("bfloat16", 5000, 9000)])
    monkeypatch.setattr(dtype_choice, "measure", lambda name, shape: next(probes))
    timings = dtype_choice.measure_rounds(["float32", "bfloat16"], (64, 128))
    assert timings == [_t("float32", 700, 400), _t("bfloat16", 450, 2000)]
    assert choose_dtype(timings) == "float32"


def test_real_measurement_is_positive_and_short() -> None:
    t = dtype_choice.measure("float32", (64, 128))
    assert t.dtype == "float32" and 0 < t.decode_s < 1 and 0 < t.prefill_s < 1

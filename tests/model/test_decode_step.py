"""The one-call decode step (common/model/decode_step.py, cpu_step.cpp) against the op-by-op forward: the
same hidden states and the same K/V, bit for bit, for fp32, int8 and int4 panels and row-major fp32 weights with
fp32 activations and bf16 panels with bf16 activations (AMX tiles on and off where the CPU has them), and the same
greedy text."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from common.attention.metadata import AttentionMetadata
from common.config.engine_config import CacheConfig, SchedulerConfig
from common.engine.engine_core import ColocatedEngine
from common.engine.model_runner import kv_cache_spec
from common.kernels.cpu import cpu_kernels
from common.kv.kv_cache import KVCache
from common.model import gemv
from common.model.decode_step import MAX_ROWS, MIN_ROWS, DecodeStep, step_mode
from common.model.llama import LlamaForCausalLM
from common.model.loader import load_model
from common.sampling.params import SamplingParams

BLOCK = 4
# head_dim 16 takes the attention kernel's generic loop (rows split over threads), 64 its SIMD loop (KV heads
# split too).
SHAPES = {"head16": {}, "head64": {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}}


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if cpu_kernels() is None:
        pytest.skip("no C++ compiler / ninja here")


@pytest.fixture(autouse=True)
def _panels(monkeypatch: pytest.MonkeyPatch) -> None:
    # The step runs on panels; whether fp32 weights are held in them depends on this CPU's measured crossover
    # (common/model/gemv.py panels_pay), so these tests hold them there always.
    monkeypatch.setenv("TANDEM_CPU_PANELS", "on")
    # ... and multiply up to PANEL_MAX_ROWS rows as they lie, as where they win that far (a 40-row batch here)
    # (row-major fp32 weights, "rows" below: their GEMV up to 64 rows, past the 40-row batch)
    monkeypatch.setattr(gemv, "_limits", {f"{what}_{dtype}": gemv.PANEL_MAX_ROWS
                                          for dtype in (torch.float32, torch.bfloat16)
                                          for what in ("measured", "panel_limit")} | {f"gemv_{torch.float32}": 64})


def _model(factory: Callable[..., Path], shape: str, quantization: str, dtype: str = "float32") -> LlamaForCausalLM:
    model = load_model(factory("llama", **SHAPES[shape]), dtype=dtype, quantization=quantization)
    assert model.decode_step is not None, "the step should apply to every projection of this model"
    return model


def _prefilled(model: LlamaForCausalLM, lengths: list[int]) -> tuple[KVCache, list[list[int]]]:
    """A cache holding ``lengths`` prompts (prefilled op by op), blocks scattered over the cache."""
    stride = max(5, len(lengths))
    cache = KVCache(kv_cache_spec(model, BLOCK), num_blocks=max(64, 3 + 8 * stride))
    tables = [[3 + stride * b + i for b in range(8)] for i in range(len(lengths))]  # interleaved, 32 tokens each
    g = torch.Generator().manual_seed(len(lengths))
    ids = torch.randint(3, model.config.vocab_size, (sum(lengths),), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.inference_mode():
        model(ids, positions, AttentionMetadata.build(lengths, [0] * len(lengths), tables, BLOCK), cache)
    return cache, tables


Result = tuple[torch.Tensor, torch.Tensor]  # (hidden, cache data)


def _both_ways(model: LlamaForCausalLM, cache: KVCache, tables: list[list[int]], lengths: list[int],
               num_layers: int | None = None, chunks: list[int] | None = None) -> tuple[Result, Result]:
    """(hidden, cache) after ``chunks`` new tokens per sequence (default one: a decode step) over the cached
    ``lengths``: through the step, then op by op from the same cache."""
    chunks = [1] * len(lengths) if chunks is None else chunks
    ids = torch.randint(3, model.config.vocab_size, (sum(chunks),), generator=torch.Generator().manual_seed(7))
    positions = torch.cat([torch.arange(n, n + c) for n, c in zip(lengths, chunks, strict=True)])
    meta = AttentionMetadata.build(chunks, lengths, tables, BLOCK)
    step = model.decode_step
    assert step is not None and step.applies(model.embed_tokens(ids), meta, cache)
    before = cache.data.clone()
    with torch.inference_mode():
        got = model(ids, positions, meta, cache, num_layers=num_layers), cache.data.clone()
        cache.data.copy_(before)
        model.decode_step = None
        try:
            want = model(ids, positions, meta, cache, num_layers=num_layers), cache.data.clone()
        finally:
            model.decode_step = step
    return got, want


def _set_amx(amx: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 panels through AMX tiles from 2 rows (where the CPU grants them), or never (``vdpbf16ps``, or fp32
    multiply-adds without AVX512-BF16)."""
    from common.kernels.cpu import NO_AMX
    from common.model import gemv

    if amx == "rows":  # fp32 weights row-major (where panels do not pay): dense_matmul's tiles in the step
        monkeypatch.setenv("TANDEM_CPU_PANELS", "off")
        return
    if amx == "amx" and gemv.amx_min_rows() == NO_AMX:
        pytest.skip("no AMX tiles on this CPU")
    if amx == "no-amx":  # both paths read the same thresholds
        monkeypatch.setitem(gemv._limits, "amx_min_rows", NO_AMX)
        monkeypatch.setattr("common.quant.cpu_linear.AMX_QUANT_MIN_ROWS", NO_AMX)


MODES = [("float32", "none", ""), ("float32", "none", "rows"), ("float32", "int8", ""), ("float32", "int4", ""),
         *(("bfloat16", q, amx) for q in ("none", "int8", "int4") for amx in ("amx", "no-amx"))]


@pytest.mark.parametrize(("dtype", "quantization", "amx"), MODES, ids=["-".join(filter(None, m)) for m in MODES])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_step_equals_the_op_by_op_forward_bit_for_bit(tiny_model_factory: Callable[..., Path], shape: str,
                                                          dtype: str, quantization: str, amx: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    _set_amx(amx, monkeypatch)
    model = _model(tiny_model_factory, shape, quantization, dtype)
    if amx == "rows":
        assert all(type(lin.method) is gemv.GemvMethod for lin in model.layers[0].modules() if hasattr(lin, "method"))
    for lengths in ([9], [5, 17, 1]):
        cache, tables = _prefilled(model, lengths)
        (got, got_cache), (want, want_cache) = _both_ways(model, cache, tables, lengths)
        assert torch.equal(got, want)
        assert torch.equal(got_cache, want_cache)  # the new K/V, in the same slots, nothing else touched
        assert not torch.equal(got_cache, cache.data.new_zeros(()).expand_as(got_cache))
    # a batch of decode rows past the point where the elementwise parts split over the threads
    lengths = [1 + (7 * i) % 23 for i in range(40)]
    cache, tables = _prefilled(model, lengths)
    (got, got_cache), (want, want_cache) = _both_ways(model, cache, tables, lengths)
    assert torch.equal(got, want) and torch.equal(got_cache, want_cache)
    # short chunks over the cached prefix (a verification, a draft's catch-up): one decode row per token
    cache, tables = _prefilled(model, [9, 5, 12])
    (got, got_cache), (want, want_cache) = _both_ways(model, cache, tables, [9, 5, 12], chunks=[4, 1, 3])
    assert torch.equal(got, want) and torch.equal(got_cache, want_cache)
    # the first layers only (the early-layer draft's forward), then the final norm
    cache, tables = _prefilled(model, [6, 2])
    for n in (0, 1):
        (got, _), (want, _) = _both_ways(model, cache, tables, [6, 2], num_layers=n)
        assert torch.equal(got, want)


def _greedy(model: LlamaForCausalLM, prompts: list[list[int]], n: int) -> dict[str, list[int]]:
    engine = ColocatedEngine(model, CacheConfig(block_size=BLOCK, num_blocks=128),
                             SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_prefill_chunk=16))
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        out[str(i)] = []
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    engine.close()
    return out


@pytest.mark.parametrize(("dtype", "quantization", "panels"), [("float32", "none", "on"), ("float32", "none", "off"),
                                                               ("float32", "int4", "on"), ("bfloat16", "none", "on")])
def test_greedy_text_is_unchanged(tiny_model_factory: Callable[..., Path], dtype: str, quantization: str, panels: str,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CPU_PANELS", panels)  # off: fp32 row-major
    model = _model(tiny_model_factory, "head64", quantization, dtype)
    calls = 0
    step = model.decode_step
    assert step is not None
    run = step.run

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return run(*args, **kwargs)  # type: ignore[arg-type]

    step.run = counted  # type: ignore[method-assign]
    prompts = [[5, 9, 11, 3], [7], list(range(10, 31))]
    got = _greedy(model, prompts, 12)
    assert calls > 0  # decode steps went through it
    model.decode_step = None
    assert _greedy(model, prompts, 12) == got


def test_where_it_does_not_apply(tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(tiny_model_factory, "head16", "none")
    step = model.decode_step
    assert step is not None
    cache, tables = _prefilled(model, [3, 3])
    x = torch.zeros(2, model.config.hidden_size)
    assert not step.applies(x, AttentionMetadata.build([2, 1], [0, 0], tables, BLOCK), cache)  # prompts: prefill
    long_tables = [list(range(10, 20)), tables[1]]  # 40 tokens
    assert not step.applies(x, AttentionMetadata.build([33, 1], [3, 3], long_tables, BLOCK), cache)  # a long chunk
    assert not step.applies(x, AttentionMetadata.build([1, 1], [3, 3], tables, BLOCK), None)
    assert not step.applies(x.bfloat16(), AttentionMetadata.build([1, 1], [3, 3], tables, BLOCK), cache)
    assert MIN_ROWS <= step.max_rows <= MAX_ROWS
    rows = step.max_rows + 1 if step.max_rows < MAX_ROWS else MAX_ROWS + 1
    many = AttentionMetadata.build([1] * rows, [1] * rows, [[i] for i in range(rows)], BLOCK)
    assert not step.applies(torch.zeros(rows, model.config.hidden_size), many, cache)
    model_dir = tiny_model_factory("llama", **SHAPES["head16"])
    # a projection it does not know (int8 weights through torch's _int_mm): op by op
    assert load_model(model_dir, dtype="float32", quantization="w8a8").decode_step is None
    monkeypatch.setenv("TANDEM_DECODE_STEP", "off")
    assert load_model(model_dir, dtype="float32").decode_step is None
    monkeypatch.setenv("TANDEM_DECODE_STEP", "fast")
    with pytest.raises(ValueError, match="TANDEM_DECODE_STEP"):
        step_mode()


def test_bad_rows_are_refused_by_the_kernel(tiny_model_factory: Callable[..., Path]) -> None:
    model = _model(tiny_model_factory, "head16", "none")
    step = model.decode_step
    assert isinstance(step, DecodeStep)
    cache, tables = _prefilled(model, [3])
    meta = AttentionMetadata.build([1], [3], tables, BLOCK)
    x = model.embed_tokens(torch.tensor([4]))
    with pytest.raises(RuntimeError, match="beyond the rotary table"):
        step.run(x, torch.tensor([10_000]), meta, cache, 2)
    rows = MAX_ROWS + 1
    many = AttentionMetadata.build([1] * rows, [3] * rows, tables * rows, BLOCK)
    with pytest.raises(RuntimeError, match=f"1 to {MAX_ROWS} rows"):
        step.run(torch.zeros(rows, model.config.hidden_size), torch.full((rows,), 3), many, cache, 2)


def test_profiling_times_the_parts_of_a_step(tiny_model_factory: Callable[..., Path]) -> None:
    model = _model(tiny_model_factory, "head64", "int8")
    step = model.decode_step
    assert step is not None
    step.profile(True)
    cache, tables = _prefilled(model, [5, 9])
    _both_ways(model, cache, tables, [5, 9])
    matmul, attention, rest = step.times()
    assert matmul > 0 and attention > 0 and rest > 0
    assert step.times() == (0.0, 0.0, 0.0)  # read and reset
    step.profile(False)
    _both_ways(model, cache, tables, [5, 9])
    assert step.times() == (0.0, 0.0, 0.0)

"""Decode graphs (common/engine/cuda_graphs.py): the padded static-buffer decode equals the eager forward.

On CPU the static-buffer path runs eagerly (no capture): the same buffers, padding rows and metadata a
captured graph reads, so these tests check everything but the capture itself; the GPU test captures.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from common.config.engine_config import CacheConfig, SchedulerConfig, SpeculativeConfig, SpeculativeMethod
from common.engine.cuda_graphs import DecodeGraphs, DecodeGraphSpec, batch_buckets, capture_refusal
from common.engine.engine_core import ColocatedEngine
from common.engine.flat_batch import FlatBatch
from common.engine.model_runner import ModelRunner
from common.engine.request import Request
from common.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from common.model.llama import LlamaForCausalLM
from common.model.loader import load_model, load_skeleton
from common.sampling.params import SamplingParams
from tests.engine.test_colocated_engine import contiguous_greedy, prompts, run_staggered

BLOCK_SIZE = 4
NUM_BLOCKS = 192
MAX_MODEL_LEN = 40  # tables 10 blocks wide
BLOCKS_PER_REQUEST = MAX_MODEL_LEN // BLOCK_SIZE


@pytest.fixture(scope="module")
def tiny(tiny_model_factory: Callable[..., Path]) -> LlamaForCausalLM:
    return load_model(tiny_model_factory("llama", num_hidden_layers=3), dtype="float32")


def requests_with_tables(model: LlamaForCausalLM, n: int, seed: int) -> tuple[list[Request], list[list[int]]]:
    """``n`` greedy requests with prompts of 3-11 tokens, each given scattered blocks of the cache."""
    order = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
    reqs = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
            for i, p in enumerate(prompts(n, model.config.vocab_size, seed=seed, lo=3, hi=12))]
    tables = [order[i * BLOCKS_PER_REQUEST:(i + 1) * BLOCKS_PER_REQUEST] for i in range(n)]
    return reqs, tables


def prefill(reqs: list[Request], tables: list[list[int]]) -> SchedulerOutput:
    return SchedulerOutput([ScheduledChunk(r, 0, r.num_tokens, t) for r, t in zip(reqs, tables, strict=True)])


def decode(reqs: list[Request], tables: list[list[int]]) -> SchedulerOutput:
    return SchedulerOutput([ScheduledChunk(r, r.num_tokens - 1, 1, t) for r, t in zip(reqs, tables, strict=True)])


def last_logits(runner: ModelRunner, output: SchedulerOutput) -> torch.Tensor:
    """The logits at each chunk's last row: [num_chunks, vocab]."""
    with torch.inference_mode():
        hidden, meta = runner.forward(output)
        ends = meta.query_start_loc.tolist()[1:]
        return runner.model.compute_logits(hidden[[e - 1 for e in ends]])


def test_buckets_and_the_bucket_a_batch_takes() -> None:
    assert batch_buckets(1) == (1,)
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert batch_buckets(20) == (1, 2, 4, 8, 16, 20)  # the max itself, so every batch up to it has a bucket
    assert batch_buckets(128)[-3:] == (96, 112, 128)


@pytest.mark.parametrize("batch", [1, 3, 5, 17])
def test_static_buffer_decode_equals_eager(tiny: LlamaForCausalLM, batch: int) -> None:
    eager = ModelRunner(tiny, BLOCK_SIZE, NUM_BLOCKS)
    graphed = ModelRunner(tiny, BLOCK_SIZE, NUM_BLOCKS, decode_graphs=DecodeGraphSpec(32, MAX_MODEL_LEN))
    graphs = graphed.decode_graphs
    assert graphs is not None and not graphs.capture  # CPU: the static buffers, run eagerly
    assert graphed.kv_cache.num_blocks == NUM_BLOCKS + 1 and graphs.pad_block == NUM_BLOCKS
    assert graphs.bucket(batch) == {1: 1, 3: 4, 5: 8, 17: 32}[batch]
    reqs, tables = requests_with_tables(tiny, batch, seed=batch)
    torch.testing.assert_close(last_logits(graphed, prefill(reqs, tables)), last_logits(eager, prefill(reqs, tables)))
    assert graphs.num_replays == 0  # a prefill runs eager
    for step in range(6):  # lengths grow, across block boundaries
        want = last_logits(eager, decode(reqs, tables))
        got = last_logits(graphed, decode(reqs, tables))
        assert graphs.num_replays == step + 1
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        for r, token in zip(reqs, want.argmax(-1).tolist(), strict=True):
            r.output_token_ids.append(token)
    # padding rows wrote only to the pad block: every block a request owns holds the eager run's K/V
    torch.testing.assert_close(graphed.kv_cache.data[:NUM_BLOCKS], eager.kv_cache.data, rtol=1e-5, atol=1e-5)


def test_an_engine_with_static_buffer_decode_generates_the_oracle_s_tokens(tiny: LlamaForCausalLM) -> None:
    """Staggered arrivals: steps mix prefill chunks with decodes (eager) and pure decode steps of changing
    batch sizes (the static buffers); every request's greedy tokens are the cache-less oracle's."""
    engine = ColocatedEngine(tiny, CacheConfig(num_blocks=64, block_size=8), SchedulerConfig(max_num_batched_tokens=48))
    spec = DecodeGraphSpec(engine.scheduler.config.max_num_seqs, engine.max_model_len)
    engine.runner = ModelRunner(tiny, 8, 64, decode_graphs=spec)  # what a CUDA engine builds, run on CPU
    work = [(p, SamplingParams(temperature=0.0, max_tokens=12 + 2 * i, ignore_eos=True))
            for i, p in enumerate(prompts(7, tiny.config.vocab_size, seed=11))]
    got = run_staggered(engine, work, arrivals=[0, 0, 1, 3, 3, 8, 12])
    for i, (p, params) in enumerate(work):
        assert got[f"r{i}"] == contiguous_greedy(tiny, p, params.max_tokens), i
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.num_replays > 10
    engine.kv.check_integrity()


def test_speculation_and_static_buffer_decode_share_an_engine(tiny: LlamaForCausalLM) -> None:
    """The target as its own draft, speculating up to 2 decoding requests: steps with drafts verify eager, the
    larger pure decode steps take the static buffers; the draft copies prompt K/V from the target's cache, which
    holds the padding block too. Tokens stay the oracle's."""
    spec = SpeculativeConfig(method=SpeculativeMethod.DRAFT_MODEL, draft_model="(loaded by the test)",
                             num_speculative_tokens=3, max_batch_size=2)
    engine = ColocatedEngine(tiny, CacheConfig(num_blocks=64, block_size=8), SchedulerConfig(max_num_batched_tokens=48),
                             speculative=spec, draft_model=tiny)
    engine.runner = ModelRunner(tiny, 8, 64, spec, draft_model=tiny,
                                decode_graphs=DecodeGraphSpec(16, engine.max_model_len))
    draft = engine.runner.draft
    assert draft is not None and draft.prompt_kv is engine.runner.kv_cache
    work = [(p, SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))
            for p in prompts(5, tiny.config.vocab_size, seed=12)]
    got = run_staggered(engine, work, arrivals=[0, 0, 0, 6, 6])
    for i, (p, params) in enumerate(work):
        assert got[f"r{i}"] == contiguous_greedy(tiny, p, params.max_tokens), i
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.num_replays > 0 and engine.scheduler.num_draft_tokens > 0


def test_what_runs_eager(tiny: LlamaForCausalLM) -> None:
    graphs = DecodeGraphs(tiny, ModelRunner(tiny, BLOCK_SIZE, NUM_BLOCKS + 1).kv_cache, BLOCK_SIZE,
                          DecodeGraphSpec(4, MAX_MODEL_LEN), pad_block=NUM_BLOCKS, capture=False)
    reqs, tables = requests_with_tables(tiny, 6, seed=1)
    for r in reqs:
        r.output_token_ids.append(5)

    def flat(output: SchedulerOutput, drafts: list[list[int]] | None = None) -> FlatBatch:
        return FlatBatch.of(output.chunks, drafts, BLOCK_SIZE)

    assert graphs.applies(flat(decode(reqs[:4], tables[:4])))
    assert not graphs.applies(flat(decode(reqs[:5], tables[:5])))  # above the largest bucket
    assert not graphs.applies(flat(prefill(reqs[:2], tables[:2])))  # prefill
    mixed = SchedulerOutput(decode(reqs[:1], tables[:1]).chunks + prefill(reqs[1:2], tables[1:2]).chunks)
    assert not graphs.applies(flat(mixed))  # a decode mixed with a prefill chunk
    spec = SchedulerOutput([ScheduledChunk(reqs[0], reqs[0].num_tokens - 1, 1, tables[0], num_draft_slots=2)])
    assert not graphs.applies(flat(spec, [[7, 8]]))  # speculative verification: three rows for one sequence
    long = Request("long", [3] * (MAX_MODEL_LEN + 1), SamplingParams())
    assert not graphs.applies(flat(decode([long], [list(range(BLOCKS_PER_REQUEST + 1))])))  # wider than the tables
    assert graphs.bucket(5) is None


def test_a_failed_capture_runs_the_step_and_the_next_ones_eager(tiny: LlamaForCausalLM,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    eager = ModelRunner(tiny, BLOCK_SIZE, NUM_BLOCKS)
    runner = ModelRunner(tiny, BLOCK_SIZE, NUM_BLOCKS, decode_graphs=DecodeGraphSpec(8, MAX_MODEL_LEN))
    # capture on a machine without CUDA: the capture itself fails, as an uncapturable op would on a GPU
    runner.decode_graphs = DecodeGraphs(tiny, runner.kv_cache, BLOCK_SIZE, DecodeGraphSpec(8, MAX_MODEL_LEN),
                                        pad_block=NUM_BLOCKS, capture=True)
    reqs, tables = requests_with_tables(tiny, 3, seed=4)
    last_logits(eager, prefill(reqs, tables))
    last_logits(runner, prefill(reqs, tables))
    with caplog.at_level("WARNING", logger="common.engine.cuda_graphs"):
        got = last_logits(runner, decode(reqs, tables))
    assert "capture of the batch-4 decode step failed" in caplog.text
    assert runner.decode_graphs is None  # eager from now on
    torch.testing.assert_close(got, last_logits(eager, decode(reqs, tables)))


def test_what_cannot_be_captured_is_declined(tiny: LlamaForCausalLM, tiny_model_factory: Callable[..., Path]) -> None:
    refusal = capture_refusal(tiny)  # the torch backend loops over sequences with host lengths
    assert refusal is not None and "'torch'" in refusal
    moe = load_skeleton(tiny_model_factory("qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32))
    assert "MoE" in (capture_refusal(moe) or "")
    gemma = load_skeleton(tiny_model_factory("gemma2", head_dim=16))
    assert "embedding scale" in (capture_refusal(gemma) or "")


def test_cpu_engines_run_eager_whatever_the_knob(tiny: LlamaForCausalLM) -> None:
    for enforce_eager in (False, True):
        engine = ColocatedEngine(tiny, CacheConfig(num_blocks=32, block_size=8),
                                 SchedulerConfig(enforce_eager=enforce_eager))
        assert engine.runner.decode_graphs is None
        assert engine.runner.kv_cache.num_blocks == 32


def test_the_enforce_eager_knob_is_a_flag_and_a_variable() -> None:
    from common.config.settings import EngineSettings, NodeSettings, load_settings
    from tandem_cli.cli import build_parser

    assert SchedulerConfig().enforce_eager is False  # graphs on by default (on CUDA)
    assert load_settings(EngineSettings, environ={"TANDEM_ENFORCE_EAGER": "1"}).configs("cuda")[1].enforce_eager
    assert NodeSettings(enforce_eager=True).configs("cuda:0")[1].enforce_eager
    assert build_parser().parse_args(["serve", "decode", "--enforce-eager"]).enforce_eager is True
    assert build_parser().parse_args(["serve", "decode"]).enforce_eager is None  # unset: the default


@pytest.mark.gpu
def test_captured_decode_equals_eager_on_cuda(tiny_model_factory: Callable[..., Path]) -> None:
    model = load_model(tiny_model_factory("llama", num_hidden_layers=3), dtype="float32", device="cuda",
                       attention_backend="triton")
    assert capture_refusal(model) is None
    eager = ModelRunner(model, BLOCK_SIZE, NUM_BLOCKS)
    graphed = ModelRunner(model, BLOCK_SIZE, NUM_BLOCKS, decode_graphs=DecodeGraphSpec(32, MAX_MODEL_LEN))
    graphs = graphed.decode_graphs
    assert graphs is not None and graphs.capture
    for batch in (1, 3, 17):
        reqs, tables = requests_with_tables(model, batch, seed=batch)
        torch.testing.assert_close(last_logits(graphed, prefill(reqs, tables)),
                                   last_logits(eager, prefill(reqs, tables)))
        for _ in range(5):
            want = last_logits(eager, decode(reqs, tables))
            got = last_logits(graphed, decode(reqs, tables))
            # the captured kernels split K/V by the tables' capacity, eager ones by the batch's longest sequence:
            # the same sums in another order (tf32 dots where Triton uses them)
            torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
            for r, token in zip(reqs, want.argmax(-1).tolist(), strict=True):
                r.output_token_ids.append(token)
    assert graphs.captured_buckets == (1, 4, 32)  # one capture per bucket used

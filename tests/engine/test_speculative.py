"""Speculative decoding inside continuous batching: exact, leak-free, and actually accepting drafts."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from common.attention.metadata import AttentionMetadata
from common.config.engine_config import CacheConfig, SchedulerConfig, SpeculativeConfig, SpeculativeMethod
from common.engine.engine_core import ColocatedEngine
from common.model.llama import LlamaForCausalLM
from common.model.loader import load_model
from common.sampling.params import SamplingParams
from tests.engine.test_colocated_engine import contiguous_greedy, prompts, run_staggered

METHODS = [SpeculativeMethod.NGRAM, SpeculativeMethod.DRAFT_LAYERS]


@pytest.fixture(scope="module")
def tiny(tiny_model_factory: Callable[..., Path]) -> LlamaForCausalLM:
    return load_model(tiny_model_factory("llama", num_hidden_layers=3), dtype="float32")


def repetitive(n: int, vocab: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a motif, so n-gram lookup has something to find."""
    out = []
    for p in prompts(n, vocab, seed=seed, lo=4, hi=9):
        out.append((p * 6)[: 5 * len(p)])
    return out


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.value)
def test_greedy_with_speculation_equals_without(tiny: LlamaForCausalLM, method: SpeculativeMethod) -> None:
    ps = repetitive(4, tiny.config.vocab_size, seed=5) + prompts(3, tiny.config.vocab_size, seed=6)
    work = [(p, SamplingParams(temperature=0.0, max_tokens=20 + 3 * i, ignore_eos=True)) for i, p in enumerate(ps)]
    spec = SpeculativeConfig(method=method, num_speculative_tokens=4, draft_layers=2, max_batch_size=16)
    engine = ColocatedEngine(tiny, CacheConfig(num_blocks=64, block_size=8),
                             SchedulerConfig(max_num_batched_tokens=96), speculative=spec)
    got = run_staggered(engine, work, arrivals=[0, 0, 1, 2, 2, 6, 9])
    for i, (p, params) in enumerate(work):
        assert got[f"r{i}"] == contiguous_greedy(tiny, p, params.max_tokens), i
    assert engine.scheduler.num_draft_tokens > 0
    assert engine.scheduler.num_accepted_tokens > 0  # the test exercised acceptance, not only rejection
    engine.kv.check_integrity()
    assert engine.kv.num_used_blocks == 0


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.value)
def test_no_leaks_after_many_accept_reject_cycles_with_tiny_budget(tiny: LlamaForCausalLM,
                                                                    method: SpeculativeMethod) -> None:
    ps = repetitive(6, tiny.config.vocab_size, seed=7)
    # greedy and sampled requests mixed: greedy ones accept often, sampled ones (near-uniform random model) rarely
    work = [(p, SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=30, ignore_eos=True))
            for i, p in enumerate(ps)]
    spec = SpeculativeConfig(method=method, num_speculative_tokens=3, draft_layers=1, max_batch_size=16)
    engine = ColocatedEngine(tiny, CacheConfig(num_blocks=20, block_size=4),
                             SchedulerConfig(max_num_batched_tokens=64, watermark=0.0), speculative=spec)
    pool_start = engine.kv.num_free_blocks
    got = run_staggered(engine, work, arrivals=[0, 0, 0, 1, 1, 2])
    assert all(len(v) == 30 for v in got.values())
    assert engine.scheduler.num_draft_tokens > engine.scheduler.num_accepted_tokens > 0
    assert engine.scheduler.num_preemptions > 0  # the budget forced preemption during speculation too
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == pool_start and engine.kv.num_used_blocks == 0


def test_per_request_override_and_batch_size_switch(tiny: LlamaForCausalLM) -> None:
    spec = SpeculativeConfig(method=SpeculativeMethod.NGRAM, max_batch_size=2)
    engine = ColocatedEngine(tiny, CacheConfig(num_blocks=64, block_size=8), speculative=spec)
    p = repetitive(1, tiny.config.vocab_size, seed=8)[0]
    off = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, num_speculative_tokens=0)
    run_staggered(engine, [(p, off)], [0])
    assert engine.scheduler.num_draft_tokens == 0
    on = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    run_staggered(engine, [(p, on)] * 3, [0, 0, 0])  # 3 decoding > max_batch_size 2: no speculation
    assert engine.scheduler.num_draft_tokens == 0
    run_staggered(engine, [(p, on)], [0])
    assert engine.scheduler.num_draft_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.value)
def test_sampled_distribution_matches_target(tiny_model_factory: Callable[..., Path],
                                             method: SpeculativeMethod) -> None:
    """Second sampled token over many seeded requests vs the exact marginal sum_t1 p(t1) p(t2 | t1)."""
    vocab = 6
    model = load_model(tiny_model_factory("llama", seed=3, vocab_size=vocab, num_hidden_layers=2,
                                          bos_token_id=0, eos_token_id=1), dtype="float32")
    prompt = [2, 3, 4, 2, 3]
    temperature = 1.3

    def probs(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            meta = AttentionMetadata.build([len(ids)], [0])
            h = model(torch.tensor(ids), torch.arange(len(ids)), meta)
            return torch.softmax(model.compute_logits(h[-1:])[0] / temperature, -1).double()

    p1 = probs(prompt)
    marginal = sum(p1[t] * probs([*prompt, t]) for t in range(vocab))
    n = 3000
    spec = SpeculativeConfig(method=method, num_speculative_tokens=2, draft_layers=1, max_batch_size=4096,
                             adaptive=False)
    engine = ColocatedEngine(model, CacheConfig(num_blocks=2048, block_size=4),
                             SchedulerConfig(max_num_seqs=512, max_num_batched_tokens=4096), speculative=spec)
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=3, ignore_eos=True) for i in range(n)]
    got = run_staggered(engine, [(prompt, p) for p in params], [0] * n)
    assert engine.scheduler.num_draft_tokens > 0
    counts = torch.bincount(torch.tensor([v[1] for v in got.values()]), minlength=vocab).double()
    expected = marginal * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    dof = vocab - 1
    crit = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3  # p = 0.001
    assert chi2 < crit, (counts.tolist(), expected.tolist())


@pytest.mark.real_model
@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.value)
def test_smollm2_greedy_with_speculation_equals_without(smollm2_dir: Path, method: SpeculativeMethod) -> None:
    from common.tokenizer import Tokenizer

    model = load_model(smollm2_dir, dtype="float32")
    tok = Tokenizer(smollm2_dir)
    texts = ["Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
             "def add(a, b):\n    return a + b\n\ndef add3(a, b, c):\n    return"]
    work = [(tok.encode(t), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)) for t in texts]
    base = run_staggered(ColocatedEngine(model, CacheConfig(num_blocks=64)), work, [0, 1])
    spec = SpeculativeConfig(method=method, num_speculative_tokens=4, draft_layers=24)
    engine = ColocatedEngine(model, CacheConfig(num_blocks=64), speculative=spec)
    assert run_staggered(engine, work, [0, 1]) == base
    assert engine.scheduler.num_accepted_tokens > 0


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.value)
def test_speculates_when_a_prefill_chunk_leaves_one_prompt_token(tiny: LlamaForCausalLM,
                                                                 method: SpeculativeMethod) -> None:
    """A running request one prompt token short of its end 'decodes' (and drafts) before it has any output."""
    prompt = repetitive(1, tiny.config.vocab_size, seed=9)[0][:9]
    spec = SpeculativeConfig(method=method, num_speculative_tokens=3, draft_layers=2, adaptive=False)
    # a budget of 8 tokens: the prompt's first chunk is 8 tokens; its last one comes with draft slots
    engine = ColocatedEngine(tiny, CacheConfig(num_blocks=32, block_size=8),
                             SchedulerConfig(max_num_batched_tokens=8), speculative=spec)
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    engine.step()
    request = engine.scheduler.running[0]
    assert request.num_computed_tokens == 8 and not request.output_token_ids
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    assert tokens == contiguous_greedy(tiny, prompt, 12)
    assert engine.scheduler.num_draft_tokens > 0
    engine.kv.check_integrity()
    assert engine.kv.num_used_blocks == 0


def test_batch_1_steps_measure_what_a_draft_costs(tiny: LlamaForCausalLM) -> None:
    """The runner times batch-1 decode steps with and without drafts; once it has enough of each, the
    scheduler prices drafts with the measured cost (and the output stays plain greedy decoding's)."""
    spec = SpeculativeConfig(method=SpeculativeMethod.NGRAM, num_speculative_tokens=4)
    engine = ColocatedEngine(tiny, CacheConfig(num_blocks=64, block_size=8), SchedulerConfig(),
                             speculative=spec)
    # A motif repeated (the lookup drafts) and then new text (it finds nothing: plain steps).
    prompt = repetitive(1, tiny.config.vocab_size, seed=9)[0] + prompts(1, tiny.config.vocab_size, seed=10)[0]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    got = run_staggered(engine, [(prompt, params)], arrivals=[0])
    assert got["r0"] == contiguous_greedy(tiny, prompt, 60)
    meter = engine.runner.draft_cost
    assert meter.num_plain + meter.num_drafted > 0 and meter.plain_s is not None and meter.plain_s > 0
    if min(meter.num_plain, meter.num_drafted) >= meter.min_samples:  # what the scheduler was told
        assert engine.scheduler.speculation is not None
        assert engine.scheduler.speculation.draft_cost == pytest.approx(meter.cost, rel=0.5)

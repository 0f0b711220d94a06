"""Speculative decoding with a separate draft model: exact (greedy output = plain decoding), leak-free under
preemption, the draft's KV kept in step with the target's, and a draft with another vocabulary refused."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from common.config.engine_config import CacheConfig, SchedulerConfig, SpeculativeConfig, SpeculativeMethod
from common.engine.engine_core import ColocatedEngine
from common.engine.node_setup import check_same_tokenizer
from common.model.llama import LlamaForCausalLM
from common.model.loader import load_model
from common.sampling.params import SamplingParams
from tests.engine.test_colocated_engine import contiguous_greedy, prompts, run_staggered

SPEC = SpeculativeConfig(method=SpeculativeMethod.DRAFT_MODEL, draft_model="(loaded by the test)",
                         num_speculative_tokens=4, max_batch_size=16)


@pytest.fixture(scope="module")
def target(tiny_model_factory: Callable[..., Path]) -> LlamaForCausalLM:
    return load_model(tiny_model_factory("llama", num_hidden_layers=3), dtype="float32")


@pytest.fixture(scope="module")
def other_draft(tiny_model_factory: Callable[..., Path]) -> LlamaForCausalLM:
    """Another random model with the same vocabulary: its drafts are mostly rejected."""
    return load_model(tiny_model_factory("llama", seed=7, num_hidden_layers=1), dtype="float32")


def test_the_target_as_its_own_draft_is_exact_and_accepts_its_drafts(target: LlamaForCausalLM) -> None:
    ps = prompts(5, target.config.vocab_size, seed=11)
    work = [(p, SamplingParams(temperature=0.0, max_tokens=16 + 3 * i, ignore_eos=True)) for i, p in enumerate(ps)]
    engine = ColocatedEngine(target, CacheConfig(num_blocks=64, block_size=8),
                             SchedulerConfig(max_num_batched_tokens=96), speculative=SPEC, draft_model=target)
    got = run_staggered(engine, work, arrivals=[0, 0, 1, 3, 5])
    for i, (p, params) in enumerate(work):
        assert got[f"r{i}"] == contiguous_greedy(target, p, params.max_tokens), i
    s = engine.scheduler
    assert s.num_draft_tokens > 20
    # the same weights propose what the target then picks: nearly every draft is accepted (float ties aside)
    assert s.num_accepted_tokens >= 0.9 * s.num_draft_tokens
    engine.kv.check_integrity()
    assert engine.kv.num_used_blocks == 0 and engine.runner.draft is not None
    assert engine.runner.draft._computed == {}  # every finished request was forgotten


def test_a_quantized_self_draft_starts_from_the_targets_prompt_kv(target: LlamaForCausalLM,
                                                                   tiny_model_factory: Callable[..., Path]) -> None:
    """The target's own int8 copy copies the prompt's K/V from the target instead of prefilling it: its
    forwards never see a prompt, only each step's few tokens; the output stays the target's greedy text."""
    draft = load_model(tiny_model_factory("llama", num_hidden_layers=3), dtype="float32", quantization="int8")
    ps = prompts(4, target.config.vocab_size, seed=13, lo=20, hi=40)
    work = [(p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)) for p in ps]
    engine = ColocatedEngine(target, CacheConfig(num_blocks=64, block_size=8),
                             SchedulerConfig(max_num_batched_tokens=96), speculative=SPEC, draft_model=draft)
    proposer = engine.runner.draft
    assert proposer is not None and proposer.prompt_kv is engine.runner.kv_cache
    sizes: list[int] = []
    forward = draft.forward

    def spy(input_ids: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        sizes.append(input_ids.shape[0])
        return forward(input_ids, *args, **kwargs)  # type: ignore[arg-type]

    draft.forward = spy  # type: ignore[method-assign]
    got = run_staggered(engine, work, arrivals=[0, 0, 2, 3])
    for i, (p, params) in enumerate(work):
        assert got[f"r{i}"] == contiguous_greedy(target, p, params.max_tokens), i
    assert sizes and max(sizes) <= 4 * (SPEC.num_speculative_tokens + 1) < min(map(len, ps)) * 2
    assert engine.scheduler.num_accepted_tokens >= 0.5 * engine.scheduler.num_draft_tokens > 0
    other = ColocatedEngine(target, CacheConfig(num_blocks=64, block_size=8), SchedulerConfig(), speculative=SPEC,
                            draft_model=load_model(tiny_model_factory("llama", seed=7, num_hidden_layers=3),
                                                   dtype="float32"))
    assert other.runner.draft is not None and other.runner.draft.prompt_kv is None  # another model: its own


def test_another_draft_model_stays_exact_and_leak_free_under_preemption(target: LlamaForCausalLM,
                                                                         other_draft: LlamaForCausalLM) -> None:
    ps = prompts(6, target.config.vocab_size, seed=12)
    work = [(p, SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=24, ignore_eos=True))
            for i, p in enumerate(ps)]
    engine = ColocatedEngine(target, CacheConfig(num_blocks=20, block_size=4),
                             SchedulerConfig(max_num_batched_tokens=64, watermark=0.0), speculative=SPEC,
                             draft_model=other_draft)
    got = run_staggered(engine, work, arrivals=[0, 0, 0, 1, 1, 2])
    assert all(len(v) == 24 for v in got.values())
    for i, (p, params) in enumerate(work):
        if params.greedy:
            assert got[f"r{i}"] == contiguous_greedy(target, p, params.max_tokens), i
    assert engine.scheduler.num_draft_tokens > 0 and engine.scheduler.num_preemptions > 0
    engine.kv.check_integrity()
    assert engine.kv.num_used_blocks == 0


def test_kv_memory_counts_the_draft(target: LlamaForCausalLM, other_draft: LlamaForCausalLM) -> None:
    cache = CacheConfig(kv_cache_memory_gb=0.001, block_size=8)
    alone = ColocatedEngine(target, cache).kv.pool.num_blocks
    with_draft = ColocatedEngine(target, cache, speculative=SPEC, draft_model=other_draft).kv.pool.num_blocks
    assert with_draft < alone  # each block also holds the draft's KV


def test_a_draft_needs_the_targets_vocabulary(tiny_served_model_dir: Path, tmp_path: Path) -> None:
    check_same_tokenizer(tiny_served_model_dir, tiny_served_model_dir)
    same = tmp_path / "same"
    shutil.copytree(tiny_served_model_dir, same)
    check_same_tokenizer(same, tiny_served_model_dir)  # another directory, the same vocabulary
    other = tmp_path / "other"
    shutil.copytree(tiny_served_model_dir, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first = next(iter(vocab))
    vocab["<a-token-the-target-lacks>"] = vocab.pop(first)
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match=r"--draft-model .* tokenizer differs"):
        check_same_tokenizer(other, tiny_served_model_dir)
    (other / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        check_same_tokenizer(other, tiny_served_model_dir)


def test_a_missing_draft_directory_is_refused_naming_the_flag(tmp_path: Path, tiny_served_model_dir: Path) -> None:
    from common.config.settings import ModelSettings
    from common.engine.node_setup import load_draft_model

    spec = SpeculativeConfig(method=SpeculativeMethod.DRAFT_MODEL, draft_model=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"--draft-model: .*nowhere"):
        load_draft_model(spec, ModelSettings(home=tmp_path), tiny_served_model_dir)


def test_draft_model_method_needs_a_model() -> None:
    with pytest.raises(ValueError, match="--draft-model"):
        SpeculativeConfig(method=SpeculativeMethod.DRAFT_MODEL)


def test_ngram_first_drafts_repeats_by_lookup_and_stays_exact(target: LlamaForCausalLM,
                                                            other_draft: LlamaForCausalLM) -> None:
    """draft_model with ngram_first: requests whose tokens repeat get the lookup's drafts (no draft forward),
    the others the draft model's; greedy stays plain decoding's, sampled requests keep running, no leak."""
    import dataclasses

    spec = dataclasses.replace(SPEC, ngram_first=True)
    vocab = target.config.vocab_size
    repeating = [list(range(10, 30)) * 3, [5, 6, 7, 8] * 8]  # the lookup finds the continuation in the prompt
    work = [(p, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
            for p in repeating + prompts(3, vocab, seed=13)]
    work.append((prompts(1, vocab, seed=14)[0], SamplingParams(temperature=0.9, seed=3, max_tokens=20,
                                                               ignore_eos=True)))
    engine = ColocatedEngine(target, CacheConfig(num_blocks=64, block_size=8),
                             SchedulerConfig(max_num_batched_tokens=96), speculative=spec, draft_model=other_draft)
    got = run_staggered(engine, work, arrivals=[0, 0, 1, 2, 3, 4])
    for i, (p, params) in enumerate(work[:-1]):
        assert got[f"r{i}"] == contiguous_greedy(target, p, params.max_tokens), i
    assert len(got[f"r{len(work) - 1}"]) == 20
    assert engine.runner.ngram_proposals > 0  # the lookup drafted for the repeating prompts
    assert engine.scheduler.num_draft_tokens > engine.runner.ngram_proposals  # and the draft model for others
    engine.kv.check_integrity()
    assert engine.kv.num_used_blocks == 0


def test_ngram_first_needs_the_draft_model_method() -> None:
    with pytest.raises(ValueError, match="--speculative-ngram-first goes with --speculative draft_model"):
        SpeculativeConfig(method=SpeculativeMethod.NGRAM, ngram_first=True)


def test_the_lookup_may_propose_past_the_draft_models_k(target: LlamaForCausalLM,
                                                        other_draft: LlamaForCausalLM) -> None:
    """ngram_first_max_tokens: a repeated span is drafted up to that many tokens at once; the draft model
    still proposes at most k. Greedy stays plain decoding's; no block leaks."""
    import dataclasses

    spec = dataclasses.replace(SPEC, num_speculative_tokens=2, ngram_first=True, ngram_first_max_tokens=8,
                               adaptive=False)
    assert spec.max_drafts_per_step == 8
    proposed: list[tuple[bool, int]] = []  # (by the lookup, how many) per speculating request-step
    engine = ColocatedEngine(target, CacheConfig(num_blocks=64, block_size=8),
                             SchedulerConfig(max_num_batched_tokens=96), speculative=spec, draft_model=other_draft)
    runner = engine.runner
    propose = runner._propose

    def counted(chunks: list) -> tuple:  # type: ignore[type-arg]
        before = runner.ngram_proposals
        drafts, probs = propose(chunks)
        by_lookup = runner.ngram_proposals > before
        proposed.extend((by_lookup, len(d)) for d in drafts if d)
        return drafts, probs

    setattr(runner, "_propose", counted)  # noqa: B010
    vocab = target.config.vocab_size
    work = [(list(range(10, 30)) * 3, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)),
            (prompts(1, vocab, seed=21)[0], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))]
    got = run_staggered(engine, work, arrivals=[0, 0])
    for i, (p, params) in enumerate(work):
        assert got[f"r{i}"] == contiguous_greedy(target, p, params.max_tokens), i
    assert max(n for lookup, n in proposed if lookup) > 2  # the lookup ran past k
    assert all(n <= 2 for lookup, n in proposed if not lookup)  # the draft model did not
    engine.kv.check_integrity()
    assert engine.kv.num_used_blocks == 0


def test_the_lookups_own_limit_needs_ngram_first_and_a_range() -> None:
    with pytest.raises(ValueError, match="--speculative-ngram-max-tokens goes with --speculative-ngram-first"):
        SpeculativeConfig(method=SpeculativeMethod.DRAFT_MODEL, draft_model="d", ngram_first_max_tokens=8)
    with pytest.raises(ValueError, match=r"--speculative-ngram-max-tokens must be in \[1, 16\], got 17"):
        SpeculativeConfig(method=SpeculativeMethod.DRAFT_MODEL, draft_model="d", ngram_first=True,
                          ngram_first_max_tokens=17)
    spec = SpeculativeConfig(method=SpeculativeMethod.DRAFT_MODEL, draft_model="d", num_speculative_tokens=8)
    assert spec.max_drafts_per_step == 8

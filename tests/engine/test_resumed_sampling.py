"""A request continued from its prompt plus its first k tokens (the gateway's migration after a node died:
``SamplingParams.resumed_output_tokens = k``, max_tokens and min_tokens lowered by k) samples exactly the
tokens an undisturbed run samples after those k: seeded randomness is keyed by output position, penalties
count the resumed tokens as output. Also across the prefill/decode split (the first token sampled by one
engine, the rest by another)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from common.config.engine_config import CacheConfig
from common.engine.engine_core import ColocatedEngine
from common.model.llama import LlamaForCausalLM
from common.model.loader import load_model
from common.sampling.params import SamplingParams
from tests.engine.test_colocated_engine import prompts, run_staggered


@pytest.fixture(scope="module")
def tiny(tiny_model_factory: Callable[..., Path]) -> LlamaForCausalLM:
    return load_model(tiny_model_factory("llama", num_hidden_layers=2), dtype="float32")


def continued(params: SamplingParams, k: int) -> SamplingParams:
    """What gateway.coordinator.continued sends after k streamed tokens."""
    return replace(params, max_tokens=params.max_tokens - k, min_tokens=max(0, params.min_tokens - k),
                   resumed_output_tokens=k)


def run_one(model: LlamaForCausalLM, prompt: list[int], params: SamplingParams) -> list[int]:
    engine = ColocatedEngine(model, CacheConfig(num_blocks=64, block_size=8))
    return run_staggered(engine, [(prompt, params)], [0])["r0"]


CASES = [
    pytest.param(SamplingParams(temperature=1.0, seed=77, max_tokens=24, ignore_eos=True), id="seeded"),
    pytest.param(SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=5, max_tokens=24, ignore_eos=True),
                 id="seeded-top-p-top-k"),
    pytest.param(SamplingParams(temperature=1.0, seed=9, max_tokens=24, frequency_penalty=1.5,
                                presence_penalty=1.0, repetition_penalty=1.3, ignore_eos=True), id="penalties"),
    pytest.param(SamplingParams(temperature=0.0, max_tokens=24, frequency_penalty=2.0, ignore_eos=True),
                 id="greedy-penalties"),
]


@pytest.mark.parametrize("params", CASES)
def test_continued_request_samples_what_the_undisturbed_run_did(tiny: LlamaForCausalLM,
                                                               params: SamplingParams) -> None:
    prompt = prompts(1, tiny.config.vocab_size, seed=11, lo=9, hi=10)[0]
    whole = run_one(tiny, prompt, params)
    assert len(whole) == params.max_tokens
    for k in (1, 7, 23):
        rest = run_one(tiny, prompt + whole[:k], continued(params, k))
        assert rest == whole[k:], k


def test_position_not_the_engine_decides_a_seeded_token(tiny: LlamaForCausalLM) -> None:
    """The disaggregated split: a prefill samples output 0, a decode node samples from output 1 on; a
    seeded request's second token is not drawn with the first one's uniform (it was, with a fresh
    generator per node)."""
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    prompt = prompts(1, tiny.config.vocab_size, seed=12, lo=6, hi=7)[0]
    whole = run_one(tiny, prompt, params)
    first = run_one(tiny, prompt, replace(params, max_tokens=1))  # the "prefill node"
    assert first == whole[:1]
    assert run_one(tiny, prompt + first, continued(params, 1)) == whole[1:]
    other_seed = run_one(tiny, prompt, replace(params, seed=4))
    assert other_seed != whole  # the seed matters (a 12-token collision on a random model: never)

"""Sampling parameters and the batched sampler."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from common.sampling.params import SamplingParams, SamplingParamsError
from common.sampling.sampler import RequestSamplingState, Sampler


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"seed": -1}, "seed"),
])
def test_bad_params_name_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(SamplingParamsError, match=field) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


def _state(params: SamplingParams, prompt: list[int] | None = None) -> RequestSamplingState:
    return RequestSamplingState.create(params, prompt or [0], eos_token_ids=(2,))


def test_greedy_is_argmax_and_logprobs_are_raw() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, -1.0], [5.0, 0.0, 0.0, 0.0]])
    out = Sampler()(logits, [_state(SamplingParams(temperature=0, logprobs=2)),
                             _state(SamplingParams(temperature=0))])
    assert out.token_ids == [1, 0]
    expected = torch.log_softmax(logits[0], -1)
    assert out.logprobs[0] == pytest.approx(float(expected[1]))
    assert [t for t, _ in out.top_logprobs[0] or []] == [1, 2]
    assert out.logprobs[1] is None and out.top_logprobs[1] is None


def test_seeded_sampling_is_independent_of_batch_composition() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    p = SamplingParams(temperature=1.0, seed=1234)

    def run(batch: list[int], steps: int = 20) -> list[int]:
        seeded = _state(p)
        others = [_state(SamplingParams(temperature=0.7, seed=i)) for i in range(len(batch) - 1)]
        tokens = []
        for _ in range(steps):
            states = [*others[: batch.index(0)], seeded, *others[batch.index(0):]]
            out = Sampler()(logits[batch], states)
            tokens.append(out.token_ids[batch.index(0)])
        return tokens

    assert run([0]) == run([1, 0, 2]) == run([3, 2, 1, 0])


def _empirical(params: SamplingParams, logits: torch.Tensor, n: int) -> torch.Tensor:
    counts = torch.zeros(logits.shape[-1])
    batch = 500
    for b in range(n // batch):
        # A seeded request's randomness is a function of (seed, position): a sample per seed.
        seeds = [None] * batch if params.seed is None else [params.seed + b * batch + i for i in range(batch)]
        states = [_state(replace(params, seed=seed)) for seed in seeds]
        out = Sampler()(logits.expand(batch, -1).contiguous(), states)
        counts += torch.bincount(torch.tensor(out.token_ids), minlength=logits.shape[-1])
    return counts / counts.sum()


def _chi2_ok(freq: torch.Tensor, expected: torch.Tensor, n: int) -> bool:
    support = expected > 0
    obs, exp = freq[support] * n, expected[support] * n
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    dof = int(support.sum()) - 1
    # critical value at p=0.001 via Wilson-Hilferty (good for dof >= 1)
    z = 3.09
    crit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return chi2 < crit


LOGITS = torch.log(torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))


@pytest.mark.parametrize(("params", "expected"), [
    (SamplingParams(temperature=1.0, seed=7), [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]),
    (SamplingParams(temperature=1.0, top_k=2, seed=7), [0.4 / 0.65, 0.25 / 0.65, 0, 0, 0, 0]),
    # top_p=0.7: 0.4 and 0.25 reach 0.65 < 0.7, so 0.15 is kept too
    (SamplingParams(temperature=1.0, top_p=0.7, seed=7), [0.5, 0.3125, 0.1875, 0, 0, 0]),
    # min_p=0.3: keep p >= 0.12
    (SamplingParams(temperature=1.0, min_p=0.3, seed=7), [0.5, 0.3125, 0.1875, 0, 0, 0]),
])
def test_filters_sample_from_allowed_set_with_expected_frequencies(
    params: SamplingParams, expected: list[float]
) -> None:
    n = 20000
    freq = _empirical(params, LOGITS, n)
    exp = torch.tensor(expected)
    assert bool((freq[exp == 0] == 0).all()), "sampled a token outside the allowed set"
    assert _chi2_ok(freq, exp, n)


def test_temperature_sharpens() -> None:
    n = 10000
    freq = _empirical(SamplingParams(temperature=0.5, seed=3), LOGITS, n)
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]) ** 2
    assert _chi2_ok(freq, p / p.sum(), n)


def test_min_tokens_blocks_eos_and_penalties_apply() -> None:
    logits = torch.tensor([[0.0, 0.0, 10.0, 1.0]])  # EOS (2) would win
    state = _state(SamplingParams(temperature=0, min_tokens=1))
    assert Sampler()(logits, [state]).token_ids == [3]
    state.output_token_ids.append(3)
    assert Sampler()(logits, [state]).token_ids == [2]
    # a frequency penalty large enough pushes token 3 below token 0
    rep = _state(SamplingParams(temperature=0, frequency_penalty=2.0, ignore_eos=True))
    rep.output_token_ids.extend([3, 3])
    assert Sampler()(torch.tensor([[2.0, 0.0, -9.0, 5.0]]), [rep]).token_ids == [0]
    # repetition penalty divides a positive logit of a prompt token
    pen = _state(SamplingParams(temperature=0, repetition_penalty=4.0), prompt=[3])
    assert Sampler()(torch.tensor([[2.0, 0.0, -9.0, 5.0]]), [pen]).token_ids == [0]


def test_inverse_cdf_picks_by_mass_never_a_zero_probability_token() -> None:
    from common.sampling.sampler import sample_from

    # Unnormalised rows with zero-probability entries at both ends and in the middle.
    probs = torch.tensor([[0.0, 2.0, 0.0, 2.0, 0.0], [0.0, 0.0, 5.0, 0.0, 0.0]])
    edges = [0.0, 0.2499, 0.5, 0.7501, 1.0 - 2.0**-40]
    picks = [sample_from(probs, torch.tensor([u, u], dtype=torch.float64)).tolist() for u in edges]
    assert [p[0] for p in picks] == [1, 1, 3, 3, 3] and all(p[1] == 2 for p in picks)

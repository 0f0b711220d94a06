"""Verification: greedy prefix matching, target_probs, and seeded reproducibility independent of the batch."""

from __future__ import annotations

import pytest
import torch

from common.sampling.params import SamplingParams
from common.sampling.sampler import RequestSamplingState, Sampler, target_probs
from common.spec_decode.rejection import verify

GREEDY = SamplingParams(temperature=0.0)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _state(params: SamplingParams, device: str = "cpu") -> RequestSamplingState:
    return RequestSamplingState.create(params, [0], eos_token_ids=(2,), device=device)


def _one_hot_logits(argmax: list[int], vocab: int = 8) -> torch.Tensor:
    # [len(argmax), vocab]: row j peaks at argmax[j]
    logits = torch.zeros((len(argmax), vocab))
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 5.0
    return logits


@pytest.mark.parametrize(("drafts", "tokens", "accepted"), [
    ([3, 1, 4], [3, 1, 4, 6], 3),  # all accepted + bonus
    ([0, 1, 4], [3], 0),  # first rejected: the target's argmax replaces it
    ([3, 2, 4], [3, 1], 1),  # middle rejected: later matches do not count
    ([], [3], 0),  # no drafts: a plain greedy step
])
def test_greedy_accepts_longest_matching_prefix(drafts: list[int], tokens: list[int], accepted: int) -> None:
    argmax = [3, 1, 4, 6][: len(drafts) + 1]
    out = verify(_one_hot_logits(argmax), [drafts], [None], [_state(GREEDY)])
    assert out.token_ids == [tokens]
    assert out.num_accepted == [accepted]


def test_ragged_mixed_batch_keeps_requests_apart() -> None:
    # request 0: greedy, k=2, all accepted; request 1: sampling with a certain target, k=1, rejected;
    # request 2: greedy, k=0; request 3: greedy with draft probs (ignored), k=3, second rejected
    rows = [[5, 6, 7], [2, 0], [4], [1, 2, 3, 4]]
    logits = torch.cat([_one_hot_logits(r) for r in rows])
    logits[3:5] *= 100.0  # request 1's target is a point mass even at temperature 1
    drafts = [[5, 6], [3], [], [1, 7, 3]]
    probs: list[torch.Tensor | None] = [None, None, None, torch.full((3, 8), 1 / 8)]
    states = [_state(GREEDY), _state(SamplingParams(seed=3)), _state(GREEDY), _state(GREEDY)]
    out = verify(logits, drafts, probs, states)
    assert out.token_ids == [[5, 6, 7], [2], [4], [1, 2]]
    assert out.num_accepted == [2, 0, 0, 1]


def test_target_probs_processing() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.25, 0.15, 0.1, 0.06, 0.04]])).expand(4, -1)
    params = [GREEDY, SamplingParams(top_k=2), SamplingParams(min_p=0.3), SamplingParams(temperature=0.5)]
    probs = target_probs(logits, params)
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(4))
    assert probs[0].tolist() == [1.0, 0, 0, 0, 0, 0]
    torch.testing.assert_close(probs[1], torch.tensor([0.4, 0.25, 0, 0, 0, 0]) / 0.65)
    torch.testing.assert_close(probs[2], torch.tensor([0.4, 0.25, 0.15, 0, 0, 0]) / 0.8)
    squared = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]) ** 2
    torch.testing.assert_close(probs[3], squared / squared.sum())


def _seeded_run(position: int, neighbours: list[RequestSamplingState], device: str,
                steps: int = 10) -> list[list[int]]:
    """Verify one seeded request (k=3, dense q) for a few steps at ``position`` among ``neighbours``.

    The request's own inputs repeat from run to run; its neighbours' are different every time.
    """
    gen = torch.Generator().manual_seed(0)
    vocab = 16
    me = _state(SamplingParams(temperature=0.9, top_p=0.9, seed=1234), device)
    outputs = []
    for _ in range(steps):
        own_logits = torch.randn((4, vocab), generator=gen)
        own_q = torch.softmax(torch.randn((3, vocab), generator=gen), dim=-1)
        own_drafts = torch.multinomial(own_q, 1, generator=gen).squeeze(1).tolist()
        other_k = [(2 * i) % 7 for i in range(len(neighbours))]  # 0, 2, 4, 6, 1: some longer than ours
        other_logits = [torch.randn((k + 1, vocab)) for k in other_k]
        other_drafts = [torch.randint(vocab, (k,)).tolist() for k in other_k]
        other_q: list[torch.Tensor | None] = [
            torch.softmax(torch.randn((k, vocab)), -1) if i % 2 else None for i, k in enumerate(other_k)]
        logits = torch.cat([*other_logits[:position], own_logits, *other_logits[position:]]).to(device)
        drafts = [*other_drafts[:position], own_drafts, *other_drafts[position:]]
        probs = [q if q is None else q.to(device) for q in [*other_q[:position], own_q, *other_q[position:]]]
        states = [*neighbours[:position], me, *neighbours[position:]]
        out = verify(logits, drafts, probs, states)
        outputs.append(out.token_ids[position])
    return outputs


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_request_is_independent_of_batch_neighbours(device: str) -> None:
    alone = _seeded_run(0, [], device)
    assert _seeded_run(0, [], device) == alone  # same seed, same tokens
    neighbours = [_state(SamplingParams(temperature=0.7, seed=i), device) for i in range(3)]
    neighbours += [_state(SamplingParams(temperature=1.0), device), _state(GREEDY, device)]
    assert _seeded_run(2, neighbours, device) == alone
    assert _seeded_run(5, neighbours, device) == alone
    assert _seeded_run(0, neighbours[::-1], device) == alone
    assert any(len(t) > 1 for t in alone) and any(len(t) < 4 for t in alone), "exercise accept and reject"


@pytest.mark.parametrize("device", DEVICES)
def test_no_drafts_gives_the_same_tokens_as_the_sampler(device: str) -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50).to(device)
    params = [SamplingParams(seed=5), SamplingParams(temperature=0.6, top_k=10, seed=6),
              SamplingParams(min_p=0.2, top_p=0.8, seed=7)]
    sampler_states = [_state(p, device) for p in params]
    verify_states = [_state(p, device) for p in params]
    for _ in range(20):
        sampled = Sampler()(logits, sampler_states).token_ids
        verified = verify(logits, [[], [], []], [None, None, None], verify_states).token_ids
        assert verified == [[t] for t in sampled]

"""Speculative sampling is exact: emitted tokens follow the target's distribution, whatever the draft's.

Tiny vocabulary, a target whose distribution depends on the previous tokens (a table per position), a
different draft distribution, k=2 drafts, and N independent trials verified as one batch. Each chi-square
test runs at p=0.001 and is paired with a check that it rejects a wrong distribution, so it has power.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch

from common.sampling.params import SamplingParams
from common.sampling.sampler import RequestSamplingState
from common.spec_decode.rejection import verify

V = 5
N = 20000
Tables = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _chi2(counts: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom of ``counts`` [..., V] against ``expected_probs`` [..., V]."""
    totals = counts.sum(dim=-1, keepdim=True)
    expected = expected_probs * totals
    support = expected_probs > 0
    assert bool((counts[~support] == 0).all()), "emitted a token the target gives probability 0"
    stat = float(((counts - expected)[support] ** 2 / expected[support]).sum())
    dof = int(support.sum()) - counts[..., 0].numel()
    return stat, dof


def _critical(dof: int, z: float = 3.09) -> float:
    """Chi-square critical value at p=0.001 (Wilson-Hilferty; z is the standard normal's 0.999 quantile)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def _fits(counts: torch.Tensor, expected_probs: torch.Tensor) -> bool:
    stat, dof = _chi2(counts, expected_probs)
    return stat < _critical(dof)


def _reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature -> top-k -> top-p -> min-p written out plainly, independent of the sampler's code."""
    rows = []
    for row in logits.reshape(-1, V):  # [V]
        probs = torch.softmax(row / params.temperature, dim=-1).tolist()
        order = sorted(range(V), key=lambda t: -probs[t])[: params.top_k or V]
        kept: list[int] = []
        mass = 0.0
        for t in order:
            if mass < params.top_p:  # keep tokens until the mass before them reaches top_p
                kept.append(t)
                mass += probs[t]
        top = max(probs[t] for t in kept)
        kept = [t for t in kept if probs[t] >= params.min_p * top]
        total = sum(probs[t] for t in kept)
        rows.append([probs[t] / total if t in kept else 0.0 for t in range(V)])
    return torch.tensor(rows).reshape(logits.shape)


@dataclass
class Trials:
    first: torch.Tensor  # [N] first emitted token
    second: torch.Tensor  # [N] second token, or -1 where the first draft was rejected
    third: torch.Tensor  # [N] bonus token, or -1 where a draft was rejected


def _tables(seed: int) -> Tables:
    # Target logits per position, given the previous tokens: [V], [V, V], [V, V, V].
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(V, generator=gen), torch.randn((V, V), generator=gen),
            torch.randn((V, V, V), generator=gen))


def _run(params: SamplingParams, dense_draft: bool, shared_seed: bool,
         device: str) -> tuple[Trials, Tables, tuple[torch.Tensor, torch.Tensor]]:
    """N trials in one verify call; returns them, the target's logit tables and the drafts' distributions."""
    torch.manual_seed(0)
    l0, l1, l2 = _tables(1)
    # Draft distributions: different from the target, with a zero where the target has mass and mass on
    # tokens the target's filters remove.
    q0 = torch.tensor([0.05, 0.4, 0.0, 0.25, 0.3])
    q1 = torch.softmax(torch.randn((V, V), generator=torch.Generator().manual_seed(2)) * 2, dim=-1)  # [V, V]
    if not dense_draft:
        # A deterministic proposer guesses from the context; drawing its guesses from a distribution
        # nearer the target just gives more accepted drafts to test with. Verification sees point masses.
        q0, q1 = (q0 + torch.softmax(l0, -1)) / 2, (q1 + torch.softmax(l1, -1)) / 2
    d0 = torch.multinomial(q0, N, replacement=True)  # [N]
    d1 = torch.multinomial(q1[d0], 1).squeeze(1)  # [N]
    # [N, 3, V] -> [3N, V]: request n's rows are positions 0, 1 (after d0) and 2 (after d0, d1)
    logits = torch.stack([l0.expand(N, V), l1[d0], l2[d0, d1]], dim=1).reshape(3 * N, V)
    drafts = torch.stack([d0, d1], dim=1).tolist()
    q = torch.stack([q0.expand(N, V), q1[d0]], dim=1)  # [N, 2, V]
    draft_probs: list[torch.Tensor | None] = list(q.to(device).unbind(0)) if dense_draft else [None] * N
    if shared_seed:
        # Seeded: a request's randomness is a function of (seed, position), so one seed per trial.
        assert params.seed is not None
        states = [RequestSamplingState.create(replace(params, seed=params.seed + n), [0], device=device)
                  for n in range(N)]
    else:
        states = [RequestSamplingState.create(params, [0], device=device) for _ in range(N)]
    out = verify(logits.to(device), drafts, draft_probs, states)
    padded = [t + [-1] * (3 - len(t)) for t in out.token_ids]
    tokens = torch.tensor(padded)  # [N, 3]
    assert [len(t) - 1 for t in out.token_ids] == out.num_accepted
    assert all(t[:n] == d[:n] for t, d, n in zip(out.token_ids, drafts, out.num_accepted, strict=True))
    trials = Trials(tokens[:, 0], tokens[:, 1], tokens[:, 2])
    return trials, (l0, l1, l2), (q0, q1)


CASES = [
    pytest.param(SamplingParams(temperature=1.0), True, False, "cpu", id="dense-q"),
    pytest.param(SamplingParams(temperature=1.0), False, False, "cpu", id="point-mass-q"),
    pytest.param(SamplingParams(temperature=0.7, top_k=3), True, False, "cpu", id="temperature-top-k"),
    pytest.param(SamplingParams(temperature=1.3, top_p=0.8, seed=11), True, True, "cpu", id="top-p-seeded"),
    pytest.param(SamplingParams(temperature=1.0, min_p=0.1, seed=12), False, True, "cpu",
                 id="min-p-point-mass-seeded"),
    pytest.param(SamplingParams(temperature=0.7, top_k=3), True, False, "cuda", id="cuda", marks=pytest.mark.gpu),
    pytest.param(SamplingParams(temperature=1.3, top_p=0.8, seed=11), False, True, "cuda", id="cuda-seeded",
                 marks=pytest.mark.gpu),
]


@pytest.mark.parametrize(("params", "dense_draft", "shared_seed", "device"), CASES)
def test_emitted_tokens_follow_the_target(params: SamplingParams, dense_draft: bool, shared_seed: bool,
                                          device: str) -> None:
    trials, (l0, l1, l2), (q0, q1) = _run(params, dense_draft, shared_seed, device)
    p0, p1, p2 = (_reference_probs(t, params) for t in (l0, l1, l2))  # [V], [V, V], [V, V, V]

    # Power: the same test rejects a verifier that leans 20% towards the draft.
    def biased(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return 0.8 * p + 0.2 * q

    # First token: its distribution is p0.
    first = torch.bincount(trials.first, minlength=V).float()
    assert _fits(first, p0)
    assert not _fits(first, biased(p0, q0)), "the test cannot tell a biased verifier"

    # Second token, where the first draft was accepted: given first token t it follows p1[t].
    cont = trials.second >= 0
    assert 0.1 * N < int(cont.sum()) < 0.9 * N, "both accepts and rejects must be exercised"
    second = torch.zeros((V, V))
    second.index_put_((trials.first[cont], trials.second[cont]), torch.ones(int(cont.sum())), accumulate=True)
    seen = second.sum(dim=1) >= 200  # conditionals with enough samples for the chi-square approximation
    assert int(seen.sum()) >= 2
    assert _fits(second[seen], p1[seen])
    assert not _fits(second[seen], biased(p1[seen], q1[seen])), "the test cannot tell a biased verifier"

    # Bonus token, where both drafts were accepted: given (t, u) it follows p2[t, u].
    bonus = trials.third >= 0
    third = torch.zeros((V, V, V))
    third.index_put_((trials.first[bonus], trials.second[bonus], trials.third[bonus]),
                     torch.ones(int(bonus.sum())), accumulate=True)
    seen2 = third.sum(dim=-1) >= 200
    assert int(seen2.sum()) >= 2
    assert _fits(third[seen2], p2[seen2])

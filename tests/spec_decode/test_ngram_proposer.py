"""Prompt-lookup proposer: exact proposals on crafted sequences and against a brute-force reference."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.spec_decode.ngram import NgramProposer


def _reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, literally: longest n first, then the most recent earlier occurrence."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_longest_ngram_wins_over_a_more_recent_shorter_one() -> None:
    tokens = [7, 2, 3, 4, 8, 2, 5, 7, 2]
    # [7, 2] occurred at 0 (followed by 3 4 8); [2] alone occurred more recently at 5 (followed by 5 7 2)
    assert NgramProposer().propose(tokens, 3) == [3, 4, 8]
    assert NgramProposer(min_n=1, max_n=1).propose(tokens, 3) == [5, 7, 2]


def test_most_recent_occurrence_and_k_truncation() -> None:
    tokens = [1, 2, 10, 1, 2, 20, 1, 2]
    assert NgramProposer().propose(tokens, 3) == [20, 1, 2]
    assert NgramProposer().propose(tokens, 1) == [20]
    assert NgramProposer().propose(tokens, 0) == []


def test_match_near_the_end_proposes_fewer_than_k() -> None:
    assert NgramProposer().propose([5, 6, 5], 5) == [6, 5]
    # overlapping occurrence: the suffix [4, 4] last occurred at 1, followed by one token
    assert NgramProposer(min_n=1, max_n=2).propose([4, 4, 4, 4], 3) == [4]


def test_no_match_proposes_nothing() -> None:
    assert NgramProposer().propose([1, 2, 3, 4], 4) == []
    assert NgramProposer().propose([], 4) == []
    assert NgramProposer().propose([9], 4) == []
    # only a 1-gram repeats, and min_n asks for 2
    assert NgramProposer(min_n=2, max_n=3).propose([1, 2, 3, 1], 4) == []
    assert NgramProposer(min_n=1, max_n=3).propose([1, 2, 3, 1], 4) == [2, 3, 1]


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"min_n": 0}, "min_n"),
    ({"min_n": 3, "max_n": 2}, "max_n"),
])
def test_bad_config_names_the_field(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        NgramProposer(**kwargs)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    k=st.integers(0, 6),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
)
def test_matches_reference(tokens: list[int], k: int, min_n: int, extra: int) -> None:
    proposer = NgramProposer(min_n=min_n, max_n=min_n + extra)
    assert proposer.propose(tokens, k) == _reference(tokens, k, min_n, min_n + extra)
    assert proposer.propose(tuple(tokens), k) == _reference(tokens, k, min_n, min_n + extra)


def _reference_with_options(tokens: list[int], k: int, min_n: int, max_n: int, per_token: int | None,
                            continue_past_end: bool) -> list[int]:
    """The options literally: cap k by the match length, then copy from tokens + the proposal so far."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                limit = k if per_token is None else min(k, n * per_token)
                proposal: list[int] = []
                source = start + n
                while len(proposal) < limit:
                    if source + len(proposal) >= len(tokens) and not continue_past_end:
                        break
                    proposal.append((tokens + proposal)[source + len(proposal)])
                return proposal
    return []


def test_drafts_per_matched_token_caps_short_matches() -> None:
    tokens = [7, 2, 3, 4, 8, 9, 10, 11, 12, 5, 2]
    # [2] matched alone (1 token): at most 2 drafts; the literal proposer copies k
    assert NgramProposer(drafts_per_matched_token=2).propose(tokens, 6) == [3, 4]
    assert NgramProposer().propose(tokens, 6) == [3, 4, 8, 9, 10, 11]
    # [8, 9, 10] ... a 3-token match allows 6
    tokens = [8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 0, 8, 9, 10]
    assert NgramProposer(max_n=3, drafts_per_matched_token=2).propose(tokens, 8) == [1, 2, 3, 4, 5, 6]


def test_continue_past_end_repeats_the_period() -> None:
    assert NgramProposer(continue_past_end=True).propose([5, 6, 5], 5) == [6, 5, 6, 5, 6]
    assert NgramProposer(min_n=1, max_n=2, continue_past_end=True).propose([4, 4, 4, 4], 3) == [4, 4, 4]
    # a match far from the end is copied as before
    assert NgramProposer(continue_past_end=True).propose([1, 2, 10, 1, 2, 20, 1, 2], 3) == [20, 1, 2]


def test_bad_drafts_per_matched_token_names_the_field() -> None:
    with pytest.raises(ValueError, match="drafts_per_matched_token"):
        NgramProposer(drafts_per_matched_token=0)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    k=st.integers(0, 8),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
    per_token=st.one_of(st.none(), st.integers(1, 3)),
    continue_past_end=st.booleans(),
)
def test_options_match_reference(tokens: list[int], k: int, min_n: int, extra: int, per_token: int | None,
                                 continue_past_end: bool) -> None:
    proposer = NgramProposer(min_n=min_n, max_n=min_n + extra, drafts_per_matched_token=per_token,
                             continue_past_end=continue_past_end)
    expected = _reference_with_options(tokens, k, min_n, min_n + extra, per_token, continue_past_end)
    assert proposer.propose(tokens, k) == expected

"""Prompt-lookup (n-gram) proposer: guess the continuation by copying what followed the same n-gram before.

Pure Python, no torch: it runs on the scheduler's token lists once per speculating request per decode step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NgramProposer:
    """Prompt-lookup decoding (Saxena 2023; vLLM's ``ngram`` proposer).

    The longest suffix of length ``max_n`` down to ``min_n`` that occurred earlier in the sequence wins;
    among its earlier occurrences the most recent one is used. The proposal is a point mass: verify it
    with ``draft_probs=None``.

    Two options trade the literal definition for acceptance (both off by default):

    - ``drafts_per_matched_token``: a match of ``n`` tokens proposes at most ``n * drafts_per_matched_token``
      tokens. A 1-token match is a weak guess (its first draft is mostly rejected on chat outputs:
      benchmarks/results/figures-from-code.md) while a long one is usually a copy in progress, so long
      matches get long drafts and short ones short drafts instead of one length for both.
    - ``continue_past_end``: when the copied span reaches the end of the sequence (the match is a
      repetition of the latest tokens), keep copying from the proposal itself, i.e. continue the period,
      instead of proposing fewer tokens.
    """

    min_n: int = 1
    max_n: int = 4
    drafts_per_matched_token: int | None = None
    continue_past_end: bool = False

    def __post_init__(self) -> None:
        if self.min_n < 1:
            raise ValueError(f"min_n must be >= 1, got {self.min_n}")
        if self.max_n < self.min_n:
            raise ValueError(f"max_n must be >= min_n={self.min_n}, got {self.max_n}")
        if self.drafts_per_matched_token is not None and self.drafts_per_matched_token < 1:
            raise ValueError(f"drafts_per_matched_token must be >= 1 (or None), got {self.drafts_per_matched_token}")

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest matching suffix.

        ``token_ids`` is the whole sequence so far (prompt + output). Returns ``[]`` when no suffix of
        length >= ``min_n`` occurred before, or when ``k == 0``. Fewer than ``k`` tokens come back when the
        match is close to the end of the sequence (unless ``continue_past_end``) or short (with
        ``drafts_per_matched_token``).
        """
        assert k >= 0, k
        length = len(token_ids)
        if k == 0 or length < self.min_n + 1:
            return []
        # Search the reversed sequence, so that list.index (C speed) walks from the most recent position
        # backwards: rev[r] is token_ids[length - 1 - r], and the suffix of length n is rev[:n].
        rev = list(token_ids)[::-1]
        last = rev[0]
        best_n, best_r = 0, 0
        r = 0
        while best_n < self.max_n:
            try:
                r = rev.index(last, r + 1)
            except ValueError:
                break
            # Only positions whose token equals the last token are compared, at most max_n tokens each:
            # O(occurrences of the last token * max_n), never a rescan per n.
            n = 1
            while n < self.max_n and r + n < length and rev[r + n] == rev[n]:
                n += 1
            # Strictly longer only: an equal-length match further back is less recent.
            if n > best_n:
                best_n, best_r = n, r
        if best_n < self.min_n:
            return []
        if self.drafts_per_matched_token is not None:
            k = min(k, best_n * self.drafts_per_matched_token)
        # The match ends at token_ids[length - 1 - best_r]; propose what followed it (r >= 1, so >= 1 token).
        start = length - best_r
        proposal = list(token_ids[start : start + k])
        if self.continue_past_end:
            # The copy source runs on into the proposal: token i of it is (token_ids + proposal)[start + i],
            # so a match best_r tokens back repeats with period best_r.
            while len(proposal) < k:
                proposal.append(proposal[len(proposal) - best_r])
        return proposal

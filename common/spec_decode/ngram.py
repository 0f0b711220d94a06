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
    """

    min_n: int = 1
    max_n: int = 4

    def __post_init__(self) -> None:
        if self.min_n < 1:
            raise ValueError(f"min_n must be >= 1, got {self.min_n}")
        if self.max_n < self.min_n:
            raise ValueError(f"max_n must be >= min_n={self.min_n}, got {self.max_n}")

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest matching suffix.

        ``token_ids`` is the whole sequence so far (prompt + output). Returns ``[]`` when no suffix of
        length >= ``min_n`` occurred before, or when ``k == 0``. Fewer than ``k`` tokens come back when the
        match is close to the end of the sequence.
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
        # The match ends at token_ids[length - 1 - best_r]; propose what followed it (r >= 1, so >= 1 token).
        start = length - best_r
        return list(token_ids[start : start + k])

"""The scheduler's pure prefill policies (no state of their own): the ``shortest`` prefill order's key and
pass-over count. The scheduler itself (which the planner's simulator runs as it is):
common/engine/scheduler.py; its speculation policy: common/spec_decode/policy.py."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


def prefill_priority(remaining: int, arrival: int, urgent: bool) -> tuple[int, int, int]:
    """The ``shortest`` prefill order's sort key: urgent requests
    (preempted, or passed over too long) first in arrival order, then fewest uncomputed tokens."""
    return (0, 0, arrival) if urgent else (1, remaining, arrival)


class _Prefill(Protocol):
    arrival_seq: int
    prefill_skips: int


def count_prefill_skips(candidates: Sequence[_Prefill], scheduled: Sequence[_Prefill]) -> None:
    """After a step: a prefill without a chunk while one that arrived after it got one was passed over once
    more; one with a chunk starts counting again."""
    latest = max((r.arrival_seq for r in scheduled), default=-1)
    done = {id(r) for r in scheduled}
    for request in candidates:
        if id(request) in done:
            request.prefill_skips = 0
        elif request.arrival_seq < latest:
            request.prefill_skips += 1

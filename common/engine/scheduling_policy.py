"""The scheduler's pure policies (no state of their own): how many drafts a request gets when speculating,
and the ``shortest`` prefill order's key and pass-over count, shared with the planner's simulator
(benchmarks/planner/simulator.py). The scheduler itself: common/engine/scheduler.py."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from common.config.engine_config import DraftEconomics
    from common.engine.request import Request


# While speculation is paused for a request, its acceptance estimate drifts back toward the prior at this
# rate per step, so the request is probed again after a while (a text can turn repetitive later).
_PAUSED_RECOVERY = 0.1
_ACCEPTANCE_PRIOR = 0.6


def adaptive_num_drafts(request: Request, max_drafts: int, economics: DraftEconomics,
                        measured_cost: float | None = None) -> int:
    """How many of ``max_drafts`` are worth proposing for ``request``.

    ``request.spec_acceptance`` estimates a, the chance that the first draft is accepted; drafts 1..j
    are then all accepted with chance a * h**(j - 1) (h: the request's own ``spec_continuation`` estimate,
    else ``economics.continuation``, or a itself for independent drafts). Draft j pays while that exceeds
    its cost c (``measured_cost`` where the runner has measured it, else ``economics.cost``):
    k = 1 + floor(log(c / a) / log(h)). When not even one draft pays (a <= c) speculation pauses (0) and
    the estimate recovers a little (``_PAUSED_RECOVERY``).
    """
    a = request.spec_acceptance
    cost = measured_cost if measured_cost is not None else economics.cost
    if a <= cost:
        request.spec_acceptance = a + _PAUSED_RECOVERY * (_ACCEPTANCE_PRIOR - a)
        return 0
    if economics.continuation is None:  # independent drafts: each as likely as the first
        h = a
    else:
        h = request.spec_continuation if request.spec_continuation is not None else economics.continuation
    if h <= 0.0:
        return 1
    if h >= 1.0 or cost <= 0.0:  # every draft pays (a measured cost can be ~0: drafts free within noise)
        return max_drafts
    return min(max_drafts, 1 + int(math.log(cost / a) / math.log(h)))


def prefill_priority(remaining: int, arrival: int, urgent: bool) -> tuple[int, int, int]:
    """The ``shortest`` prefill order's sort key: urgent requests
    (preempted, or passed over too long) first in arrival order, then fewest uncomputed tokens."""
    return (0, 0, arrival) if urgent else (1, remaining, arrival)


class _Prefill(Protocol):
    arrival_seq: int
    prefill_skips: int


def count_prefill_skips(candidates: Sequence[_Prefill], scheduled: Sequence[_Prefill]) -> None:
    """After a step: a prefill without a chunk while one that arrived after it got one was passed over once
    more; one with a chunk starts counting again (shared with the planner's simulator)."""
    latest = max((r.arrival_seq for r in scheduled), default=-1)
    done = {id(r) for r in scheduled}
    for request in candidates:
        if id(request) in done:
            request.prefill_skips = 0
        elif request.arrival_seq < latest:
            request.prefill_skips += 1

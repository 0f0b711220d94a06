"""The scheduler's side of speculative decoding: how many draft slots a request gets this step, and what a
verified step teaches (pure Python: the scheduler imports no torch).

The runner's side (propose, verify, accept) is ``common/spec_decode/proposer.py``; the two meet in
``ScheduledChunk.num_draft_slots`` (what the policy granted) and ``StepResult.num_drafts`` /
``num_accepted`` (what was proposed and kept). The scheduler asks ``speculates`` once per step and
``num_drafts`` per decoding request, and hands every verified step back to ``record``; it holds no
acceptance maths of its own.

Adaptive k: ``request.spec_acceptance`` estimates the chance the first draft is accepted and
``request.spec_continuation`` the chance a draft after an accepted one is; a draft is proposed while its
chance of being kept beats its cost (``adaptive_num_drafts``), priced by what the runner measured at batch 1
(``common/spec_decode/draft_cost.py``) unless the config pins its own ``DraftEconomics``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.config.engine_config import DraftEconomics, SpeculativeConfig
    from common.engine.request import Request

# While speculation is paused for a request, its acceptance estimate drifts back toward the prior at this
# rate per step, so the request is probed again after a while (a text can turn repetitive later).
_PAUSED_RECOVERY = 0.1
_ACCEPTANCE_PRIOR = 0.6


class SpeculationPolicy:
    """Draft slots per request and step, the acceptance estimates, and the node's speculative counters
    (``num_spec_steps``, ``num_draft_tokens``, ``num_accepted_tokens``: what the metrics read)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        assert config.enabled, "a speculation policy needs a speculative method"
        self.config = config
        self.max_model_len = max_model_len
        self.num_spec_steps = 0  # request-steps that verified at least one draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.draft_cost: float | None = None  # the runner's measured cost of a draft (StepResult.draft_cost)

    def speculates(self, running: Iterable[Request]) -> bool:
        """Whether this step speculates: only while few requests decode (a big decode batch is compute-bound
        already)."""
        decoding = sum(1 for r in running if r.num_computed_tokens == r.num_tokens - 1)
        return 0 < decoding <= self.config.max_batch_size

    def num_drafts(self, request: Request, budget: int) -> int:
        """How many draft slots a decoding request gets this step (0: plain decode), at most ``budget``."""
        spec = self.config
        p = request.params
        if (request.num_computed_tokens != request.num_tokens - 1 or not p.can_speculate
                or len(request.output_token_ids) < p.min_tokens):
            return 0
        k = p.num_speculative_tokens if p.num_speculative_tokens is not None else spec.max_drafts_per_step
        if spec.adaptive:
            k = adaptive_num_drafts(request, k, spec.draft_economics, self.draft_cost)
        # No drafts past the end: the last token is the target's own.
        remaining = min(p.max_tokens - len(request.output_token_ids), self.max_model_len - request.num_tokens) - 1
        return max(0, min(k, remaining, budget))

    def record_cost(self, draft_cost: float | None) -> None:
        """The runner measured what a draft costs: that price replaces the default economics' (a config
        that names its own keeps it)."""
        if draft_cost is not None and self.config.economics is None:
            self.draft_cost = draft_cost

    def record(self, request: Request, drafts: int, accepted: int) -> None:
        """A verified step: ``accepted`` of the request's ``drafts`` were kept."""
        if drafts == 0:
            return
        request.num_draft_tokens += drafts
        request.num_accepted_tokens += accepted
        # The estimate is of the first draft's acceptance (see adaptive_num_drafts). accepted / drafts would
        # also count the drafts after a rejection, never judged, as failures, and shrink k when it was generous.
        request.spec_acceptance = 0.7 * request.spec_acceptance + 0.3 * (1.0 if accepted else 0.0)
        # After an accepted first draft, drafts 2..accepted continued the run and the next one (if any was
        # proposed) broke it: the continuation h's observations in this step.
        if accepted and drafts > 1:
            kept, broke = accepted - 1, int(accepted < drafts)
            if kept + broke:
                h = (request.spec_continuation if request.spec_continuation is not None
                     else self.config.draft_economics.continuation)
                if h is not None:
                    request.spec_continuation = h + 0.3 * (kept / (kept + broke) - h)
        self.num_spec_steps += 1
        self.num_draft_tokens += drafts
        self.num_accepted_tokens += accepted


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

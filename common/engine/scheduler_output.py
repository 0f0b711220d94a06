"""What the scheduler hands the model runner for one step, and what comes back (pure data, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.engine.request import Request
    from common.kv.kv_cache_manager import BlockCopy
    from common.sampling.sampler import SampleResult


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute tokens ``start .. start+num_tokens-1`` of ``request`` this step.

    A decoding request may also get ``num_draft_slots`` KV slots after its token for speculative
    decoding: the model runner fills them with up to that many proposed tokens and verifies them.
    """

    request: Request
    start: int
    num_tokens: int
    block_ids: list[int]  # the request's whole block table
    num_draft_slots: int = 0

    @property
    def samples(self) -> bool:
        """The chunk reaches the request's last token, so the step samples the next one."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass(frozen=True)
class StepResult:
    """What the model runner produced for the chunks that sample, in chunk order."""

    token_ids: list[list[int]]  # one token, or with speculation: the accepted drafts + 1
    logprobs: list[list[tuple[float, list[tuple[int, float]]]] | None]
    num_drafts: list[int]  # drafts verified per chunk (0 without speculation)
    num_accepted: list[int]
    # What one draft cost in this runner, as a fraction of a plain decode step (proposing plus verifying;
    # measured at batch 1 by common/spec_decode/draft_cost.py's DraftCostMeter); None: not measured yet.
    draft_cost: float | None = None

    @staticmethod
    def from_samples(sampled: SampleResult) -> StepResult:
        n = len(sampled.token_ids)
        logprobs: list[list[tuple[float, list[tuple[int, float]]]] | None] = [
            None if lp is None else [(lp, top or [])]
            for lp, top in zip(sampled.logprobs, sampled.top_logprobs, strict=True)
        ]
        return StepResult([[t] for t in sampled.token_ids], logprobs, [0] * n, [0] * n)


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted: list[str] = field(default_factory=list)
    block_copies: list[BlockCopy] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens + c.num_draft_slots for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

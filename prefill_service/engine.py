"""The prefill engine: chunked prefill that pushes each chunk's KV to a decode node as it is produced."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from common.engine.engine_core import EngineCore

if TYPE_CHECKING:
    from common.config.engine_config import CacheConfig, SchedulerConfig
    from common.engine.request import RequestOutput
    from common.engine.scheduler import SchedulerOutput
    from common.model.llama import LlamaForCausalLM


class KVPushTarget(Protocol):
    """Where written blocks go (kv_transfer's TransferHandle); ``push`` must not block."""

    def push(self, src_block_ids: list[int], dst_block_ids: list[int]) -> None: ...


@dataclass
class TransferPlan:
    """One request's KV destination: decode-side block ids, of which the first ``skip_blocks`` are cached there."""

    target: KVPushTarget
    dst_block_ids: list[int]
    skip_blocks: int
    next_block: int = 0  # index of the first block not pushed yet


@dataclass(frozen=True, slots=True)
class ChunkTiming:
    """One prefill chunk of a traced request: the engine step that computed it (wall-clock ns, for spans)."""

    start_ns: int  # the step began (scheduling included)
    end_ns: int  # the step's forward finished: the chunk's KV is in the cache
    start_token: int
    num_tokens: int
    step_tokens: int  # tokens of every request batched in that step


class PrefillEngine(EngineCore):
    """A prefill-only engine: requests end with their first token and keep their blocks until released."""

    def __init__(self, model: LlamaForCausalLM, cache: CacheConfig | None = None,
                 scheduler: SchedulerConfig | None = None) -> None:
        super().__init__(model, cache, scheduler, prefill_only=True)
        self.plans: dict[str, TransferPlan] = {}
        # Traced requests only: the servicer owns each list and reads it once the first token is out.
        self.chunk_timings: dict[str, list[ChunkTiming]] = {}
        self._step_start_ns = 0

    def attach(self, request_id: str, plan: TransferPlan, chunk_timings: list[ChunkTiming] | None = None) -> None:
        """Send the request's KV along ``plan``; append its chunks' timings to ``chunk_timings`` if given."""
        self.plans[request_id] = plan
        if chunk_timings is not None:
            self.chunk_timings[request_id] = chunk_timings

    def step(self) -> list[RequestOutput]:
        self._step_start_ns = time.time_ns()
        return super().step()

    def on_kv_written(self, scheduled: SchedulerOutput) -> None:
        """Push every block this step completed. The prompt's last, partial block goes once the prompt is done.

        A block is pushed only once it can no longer change, so the transfer never races later writes.
        """
        if self.chunk_timings:
            self._record_chunks(scheduled)
        bs = self.kv.block_size
        for chunk in scheduled.chunks:
            plan = self.plans.get(chunk.request.request_id)
            if plan is None:
                continue
            end = chunk.start + chunk.num_tokens
            done = -(-end // bs) if end >= chunk.request.num_prompt_tokens else end // bs
            first = max(plan.next_block, plan.skip_blocks)
            if done > first:
                plan.target.push(chunk.block_ids[first:done], plan.dst_block_ids[first:done])
                plan.next_block = done

    def _record_chunks(self, scheduled: SchedulerOutput) -> None:
        now = time.time_ns()
        step_tokens = scheduled.num_tokens
        for chunk in scheduled.chunks:
            timings = self.chunk_timings.get(chunk.request.request_id)
            if timings is not None:
                timings.append(ChunkTiming(self._step_start_ns, now, chunk.start, chunk.num_tokens, step_tokens))

    def release(self, request_id: str) -> None:
        """The transfer finished or was abandoned: free the request's blocks (they stay prefix-cached)."""
        self.plans.pop(request_id, None)
        self.chunk_timings.pop(request_id, None)
        self.scheduler.release(request_id)

    def abort(self, request_id: str) -> bool:
        self.plans.pop(request_id, None)
        self.chunk_timings.pop(request_id, None)
        return super().abort(request_id)

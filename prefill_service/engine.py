"""The prefill engine: chunked prefill that pushes each chunk's KV to a decode node as it is produced."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from common.engine.engine_core import EngineCore

if TYPE_CHECKING:
    from common.config.engine_config import CacheConfig, SchedulerConfig
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


class PrefillEngine(EngineCore):
    """A prefill-only engine: requests end with their first token and keep their blocks until released."""

    def __init__(self, model: LlamaForCausalLM, cache: CacheConfig | None = None,
                 scheduler: SchedulerConfig | None = None) -> None:
        super().__init__(model, cache, scheduler, prefill_only=True)
        self.plans: dict[str, TransferPlan] = {}

    def attach(self, request_id: str, plan: TransferPlan) -> None:
        self.plans[request_id] = plan

    def on_kv_written(self, scheduled: SchedulerOutput) -> None:
        """Push every block this step completed. The prompt's last, partial block goes once the prompt is done.

        A block is pushed only once it can no longer change, so the transfer never races later writes.
        """
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

    def release(self, request_id: str) -> None:
        """The transfer finished or was abandoned: free the request's blocks (they stay prefix-cached)."""
        self.plans.pop(request_id, None)
        self.scheduler.release(request_id)

    def abort(self, request_id: str) -> bool:
        self.plans.pop(request_id, None)
        return super().abort(request_id)

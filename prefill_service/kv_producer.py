"""The prefill node's role: compute a prompt's KV, push each chunk's blocks to a decode node as it is
produced, end the request at its first token and hold its blocks until the transfer has read them."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.engine.commands import ChunkTiming
from common.engine.kv_connector import KVConnector
from common.kv.kv_cache_manager import NULL_BLOCK

if TYPE_CHECKING:
    from common.engine.commands import KVDestination
    from common.engine.request import Request
    from common.engine.scheduler_output import SchedulerOutput


@dataclass
class _Push:
    """One request's KV destination and how far it has been pushed."""

    destination: KVDestination
    next_block: int = 0  # index of the first block not pushed yet


class KVProducer(KVConnector):
    """Prefill role (vLLM's ``kv_producer``): KV computed here, sent away, blocks held until released."""

    role = "prefill"
    ends_at_first_token = True

    def __init__(self, block_size: int) -> None:
        super().__init__()
        self.block_size = block_size
        self._pushes: dict[str, _Push] = {}
        # Traced requests only: the servicer owns each list and reads it once the first token is out.
        self._chunk_timings: dict[str, list[ChunkTiming]] = {}

    def request_finished(self, request: Request) -> bool:
        return True  # the KV transfer reads the blocks after the first token; its end frees them

    def kv_read_from(self, request: Request) -> int | None:
        # Blocks before skip_blocks are never pushed: cached on the decode node, or outside its window there.
        push = self._pushes.get(request.request_id)
        return push.destination.skip_blocks if push is not None else None

    def can_preempt(self, request: Request) -> bool:
        # A pushed block is read by the sender's thread later on: freeing it could hand it to another request first.
        push = self._pushes.get(request.request_id)
        return push is None or push.next_block == 0

    def attach(self, request_id: str, destination: KVDestination,
               chunk_timings: list[ChunkTiming] | None) -> None:
        self._pushes[request_id] = _Push(destination)
        # Once every send ended (the blocks are read, or the transfer failed and nothing is in flight), the
        # next step frees the held blocks; a request still computing is the servicer's to abort.
        destination.target.when_finished(lambda: self.finished.sent(request_id))
        if chunk_timings is not None:
            self._chunk_timings[request_id] = chunk_timings

    def save_kv(self, scheduled: SchedulerOutput, step_start_ns: int) -> None:
        """Push every block this step completed. The prompt's last, partial block goes once the prompt is done.

        A block is pushed only once it can no longer change, so the transfer never races later writes.
        """
        if self._chunk_timings:
            self._record_chunks(scheduled, step_start_ns)
        bs = self.block_size
        for chunk in scheduled.chunks:
            push = self._pushes.get(chunk.request.request_id)
            if push is None:
                continue
            end = chunk.start + chunk.num_tokens
            done = -(-end // bs) if end >= chunk.request.num_prompt_tokens else end // bs
            dest = push.destination
            first = max(push.next_block, dest.skip_blocks)
            if done > first:
                # dest.block_ids[0] is the prompt's block dest.first_block (<= skip_blocks)
                dst = dest.block_ids[first - dest.first_block : done - dest.first_block]
                src = chunk.block_ids[first:done]
                # kv_read_from keeps every block from skip_blocks on: none sent was freed behind the window
                assert NULL_BLOCK not in src, f"{chunk.request.request_id}: a freed block would be sent"
                dest.target.push(src, list(dst))
                push.next_block = done

    def forget(self, request_id: str) -> None:
        self._pushes.pop(request_id, None)
        self._chunk_timings.pop(request_id, None)

    def _record_chunks(self, scheduled: SchedulerOutput, step_start_ns: int) -> None:
        now = time.time_ns()
        step_tokens = scheduled.num_tokens
        for chunk in scheduled.chunks:
            timings = self._chunk_timings.get(chunk.request.request_id)
            if timings is not None:
                timings.append(ChunkTiming(step_start_ns, now, chunk.start, chunk.num_tokens, step_tokens))

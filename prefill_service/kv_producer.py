"""The prefill node's role: compute a prompt's KV, push each chunk's blocks to a decode node as it is
produced, end the request at its first token and hold its blocks until the transfer has read them.

The destination may come after the request (the gateway starts the prefill before the decode node has
reserved): until it does, the computed blocks are only recorded, every block is kept (even outside a sliding
window: the destination says which ones it needs) and the request is not preempted once a block is done; when
it comes, every block computed so far is pushed at once."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
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

    destination: KVDestination | None  # None: still to come (attach_destination)
    next_block: int = 0  # index of the first block not pushed yet
    # While the destination is to come: how many of the prompt's blocks are computed (they can no longer
    # change) and the request's block ids for them, pushed once it comes.
    done_blocks: int = 0
    block_ids: list[int] = field(default_factory=list)


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
        # Before the destination is known any block may be sent: all of them stay.
        push = self._pushes.get(request.request_id)
        if push is None:
            return None
        return push.destination.skip_blocks if push.destination is not None else 0

    def can_preempt(self, request: Request) -> bool:
        # A pushed block is read by the sender's thread later on: freeing it could hand it to another request first.
        # Before the destination is known, a recorded block would be pushed when it comes: the same holds.
        push = self._pushes.get(request.request_id)
        if push is None:
            return True
        return push.next_block == 0 if push.destination is not None else push.done_blocks == 0

    def attach(self, request_id: str, destination: KVDestination,
               chunk_timings: list[ChunkTiming] | None) -> None:
        self.await_destination(request_id, chunk_timings)
        self.attach_destination(request_id, destination)

    def await_destination(self, request_id: str, chunk_timings: list[ChunkTiming] | None) -> None:
        self._pushes[request_id] = _Push(None)
        if chunk_timings is not None:
            self._chunk_timings[request_id] = chunk_timings

    def attach_destination(self, request_id: str, destination: KVDestination) -> None:
        push = self._pushes[request_id]
        assert push.destination is None, f"{request_id}: a second destination"
        push.destination = destination
        # Once every send ended (the blocks are read, or the transfer failed and nothing is in flight), the
        # next step frees the held blocks; a request still computing is the servicer's to abort.
        destination.target.when_finished(lambda: self.finished.sent(request_id))
        self._push(request_id, push, push.done_blocks, push.block_ids)
        push.block_ids = []

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
            if push.destination is None:  # recorded, pushed when it comes (kv_read_from keeps these blocks)
                if done > push.done_blocks:
                    push.done_blocks, push.block_ids = done, chunk.block_ids[:done]
                continue
            self._push(chunk.request.request_id, push, done, chunk.block_ids)

    def _push(self, request_id: str, push: _Push, done: int, block_ids: list[int]) -> None:
        """Push the request's blocks from the first not pushed yet up to ``done`` (``block_ids``: its table)."""
        dest = push.destination
        assert dest is not None
        first = max(push.next_block, dest.skip_blocks)
        if done > first:
            # dest.block_ids[0] is the prompt's block dest.first_block (<= skip_blocks)
            dst = dest.block_ids[first - dest.first_block : done - dest.first_block]
            src = block_ids[first:done]
            # kv_read_from keeps every block from skip_blocks on: none sent was freed behind the window
            assert NULL_BLOCK not in src, f"{request_id}: a freed block would be sent"
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

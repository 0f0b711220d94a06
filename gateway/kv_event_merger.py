"""The gateway's ``SubscribeKvEvents``: every node's prefix-cache event stream merged into one.

Each subscriber gets its own fan-in: one ``SubscribeKvEvents`` call per node, each batch tagged with the
address the gateway dials (``target``; the node already set ``node_id`` and ``role``) and put on the
subscriber's drop-oldest queue, so a slow subscriber loses its oldest batches (counted in ``dropped``)
and never slows the gateway. A node that is down or restarts is re-subscribed after ``retry_s``; its first
batch after a gap carries ``dropped`` = 0, so a router should treat a new stream from a node (a restart
resets the node's ``event_id``) as a fresh view of it. The nodes are the live membership's: a node that
joins after a subscriber connected is followed from the next ``retry_s`` on, one that leaves is let go.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from common.serving.kv_event_queue import DEFAULT_MAX_QUEUED_BATCHES, KvEventQueue
from tandem.v1 import common_pb2

log = logging.getLogger(__name__)

# target -> the node's SubscribeKvEvents (a server-streaming callable of a prefill or decode stub)
NodeStreams = dict[str, Callable[..., grpc.aio.UnaryStreamCall]]


class KvEventMerger:
    """Merges the ``SubscribeKvEvents`` streams of the nodes ``streams()`` returns (the members now)."""

    def __init__(self, streams: Callable[[], NodeStreams], retry_s: float = 1.0) -> None:
        self._streams = streams
        self._retry_s = retry_s

    async def subscribe(self, max_queued_batches: int = 0) -> AsyncIterator[common_pb2.KvEventBatch]:
        q = KvEventQueue(max_queued_batches or DEFAULT_MAX_QUEUED_BATCHES)
        tasks: dict[str, asyncio.Task[None]] = {}
        watcher = asyncio.create_task(self._follow_members(tasks, q), name="kv-events-members")
        try:
            while True:
                yield await q.get()
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            for task in tasks.values():
                task.cancel()
            for task in tasks.values():
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _follow_members(self, tasks: dict[str, asyncio.Task[None]], q: KvEventQueue) -> None:
        """Keep one follower per member: start one for each node that joined, cancel those of nodes that left."""
        while True:
            streams = self._streams()
            for target in [t for t in tasks if t not in streams]:
                tasks.pop(target).cancel()
            for target, rpc in streams.items():
                if target not in tasks:
                    tasks[target] = asyncio.create_task(self._follow(target, rpc, q), name=f"kv-events-{target}")
            await asyncio.sleep(self._retry_s)

    async def _follow(self, target: str, rpc: Callable[..., grpc.aio.UnaryStreamCall], q: KvEventQueue) -> None:
        while True:
            try:
                async for batch in rpc(common_pb2.SubscribeKvEventsRequest()):
                    batch.target = target
                    q.put(batch)
            except grpc.aio.AioRpcError as exc:
                log.debug("KV events of %s: %s %s", target, exc.code().name, exc.details())
            await asyncio.sleep(self._retry_s)

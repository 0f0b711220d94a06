"""The gateway's ``SubscribeKvEvents``: every node's prefix-cache event stream merged into one.

Each subscriber gets its own fan-in: one ``SubscribeKvEvents`` call per node, each batch tagged with the
address the gateway dials (``target``; the node already set ``node_id`` and ``role``) and put on the
subscriber's drop-oldest queue, so a slow subscriber loses its oldest batches (counted in ``dropped``)
and never slows the gateway. A node that is down or restarts is re-subscribed after ``retry_s``. Each batch
keeps its node's ``incarnation`` and ``sequence``, so a router sees a gap (a skipped sequence) or a restart
(another incarnation) and can heal from the node itself (``SubscribeKvEvents`` with a resume point or a
snapshot); the gateway's own prefix index does exactly that (``KvIndexSync`` below, ``gateway.kv_index``).
The nodes are the live membership's: a node that joins after a subscriber connected is followed from the next
``retry_s`` on, one that leaves is let go.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from common.serving.kv_event_queue import DEFAULT_MAX_QUEUED_BATCHES, KvEventQueue
from common.telemetry.metrics import GatewayMetrics
from gateway.kv_index import KvIndex, Resync
from tandem.v1 import common_pb2

log = logging.getLogger(__name__)

UNIMPLEMENTED_RETRY_S = 10.0

# target -> the node's SubscribeKvEvents (a server-streaming callable of a prefill or decode stub)
NodeStreams = dict[str, Callable[..., grpc.aio.UnaryStreamCall]]


class KvEventMerger:
    """Merges the ``SubscribeKvEvents`` streams of the nodes ``streams()`` returns (the members now)."""

    def __init__(self, streams: Callable[[], NodeStreams], retry_s: float = 1.0) -> None:
        self._streams = streams
        self._retry_s = retry_s

    async def subscribe(self, request: common_pb2.SubscribeKvEventsRequest | None = None
                        ) -> AsyncIterator[common_pb2.KvEventBatch]:
        request = request or common_pb2.SubscribeKvEventsRequest()
        q = KvEventQueue(request.max_queued_batches or DEFAULT_MAX_QUEUED_BATCHES)
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


class KvIndexSync:
    """Keeps a ``KvIndex`` exact from every member's ``SubscribeKvEvents``: one stream per node, resumed from the
    view's next sequence (the node replays, or sends a snapshot) whenever the index finds a gap, a restart,
    dropped events or drift, and whenever the stream ends (after ``retry_s``). A node that leaves the
    membership loses its entries at once; so does one that restarts (another incarnation)."""

    def __init__(self, index: KvIndex, streams: Callable[[], NodeStreams], metrics: GatewayMetrics | None = None,
                 retry_s: float = 0.25, members_s: float = 1.0, max_queued_batches: int = 0) -> None:
        self.index = index
        self._streams = streams
        self._metrics = metrics
        self._retry_s = retry_s
        self._members_s = members_s
        self._max_queued = max_queued_batches
        self._task: asyncio.Task[None] | None = None
        self.num_resyncs: dict[str, int] = {}  # by Resync value, over every node

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kv-index-sync")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        tasks: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                streams = self._streams()
                for target in [t for t in tasks if t not in streams]:
                    await _cancel(tasks.pop(target))
                    self._forget(target)
                for target in streams:
                    if target not in tasks or tasks[target].done():
                        tasks[target] = asyncio.create_task(self._follow(target), name=f"kv-index-{target}")
                await asyncio.sleep(self._members_s)
        finally:
            for target, task in tasks.items():
                await _cancel(task)
                self._forget(target)

    def _forget(self, target: str) -> None:
        self.index.forget(target)
        if self._metrics is not None:
            self._metrics.kv_index_forgot(target)

    async def _follow(self, target: str) -> None:
        while True:
            rpc = self._streams().get(target)  # asked again each time: the node's channel may have been replaced
            if rpc is None:  # it left; _run forgets it
                return
            call = rpc(self.index.resume_request(target, self._max_queued))
            resync: Resync | None = None  # None: the stream never delivered (the node is down or starting)
            try:
                async for batch in call:
                    resync = Resync.DISCONNECT
                    found = self.index.apply(target, batch)
                    view = self.index.view(target)
                    if self._metrics is not None:
                        self._metrics.kv_index_checked(target, len(view.hashes), view.drift)
                    if found is not None:
                        resync = found
                        break
            except grpc.aio.AioRpcError as exc:
                log.debug("KV index of %s: %s %s", target, exc.code().name, exc.details())
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # a node that publishes no events: ask rarely
                    await asyncio.sleep(UNIMPLEMENTED_RETRY_S)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():  # this follower is being stopped
                    raise
                log.debug("KV index of %s: the call was cancelled (its channel closed)", target)
            finally:
                call.cancel()
            if resync is not None:
                self.num_resyncs[resync.value] = self.num_resyncs.get(resync.value, 0) + 1
                if self._metrics is not None:
                    self._metrics.kv_index_resynced(target, resync.value)
                if resync in (Resync.RESTART, Resync.DROPPED, Resync.DRIFT):
                    log.info("KV index of %s: resync (%s)", target, resync.value)
            # A gap or a restart heals at once; a drift that kept coming back must not spin on snapshots.
            if resync is None or resync in (Resync.DISCONNECT, Resync.DRIFT):
                await asyncio.sleep(self._retry_s)


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task

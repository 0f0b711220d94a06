"""The gateway's connections to its nodes, and the loop that polls their load into the router.

Membership: the static targets (``--prefill`` / ``--decode``) are fixed members, polled forever and never
dropped; registered nodes (``gateway.membership``) join with ``add`` and leave with ``remove`` (a
deregistration or a drain) or, when they stop answering for ``drop_after_s``, by the poller.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

import grpc

from common.serving.channel import open_channel
from gateway.router import NodeLoad, Router
from tandem.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

log = logging.getLogger(__name__)


def load_from_proto(stats: common_pb2.NodeStats) -> NodeLoad:
    return NodeLoad(node_id=stats.node_id, num_blocks=stats.num_blocks, free_blocks=stats.free_blocks,
                    num_running=stats.num_running, num_waiting=stats.num_waiting, block_size=stats.block_size,
                    prefix_cache_queries=stats.prefix_cache_queries, prefix_cache_hits=stats.prefix_cache_hits,
                    offload_hits=stats.offload_hits, offload_blocks=stats.offload_blocks,
                    shared_tier=stats.kv_shared_tier)


DEFAULT_BLOCK_SIZE = 16  # NodeSettings' default: what the pool assumes until a node reports its own

# Stats polls in a row that a node with a live connection may leave unanswered (each within
# min(stats_interval_s, 2 s)) before it is taken out of routing as hung.
SLOW_POLLS_UNTIL_DOWN = 3
# The first poll (``start``) waits this long for each node's connection and answer: a node that has just begun
# listening on a loaded machine can take longer than a stats interval to finish the HTTP/2 handshake, and a
# first poll that gave up then marked it unreachable until the next one, so the first requests were refused
# ("no reachable prefill node": seen once in the full suite on a 2-core Zen 3, session 36). A node that is down
# at start costs the gateway's start this long.
FIRST_POLL_TIMEOUT_S = 5.0


class NodePool:
    """One channel per node (gRPC multiplexes every request over it) and the stats poller."""

    def __init__(self, router: Router, stats_interval_s: float,
                 interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
                 credentials: grpc.ChannelCredentials | None = None, drop_after_s: float = 10.0,
                 close_grace_s: float = 600.0) -> None:
        self._router = router
        self._interval = stats_interval_s
        self._drop_after_s = drop_after_s
        self._close_grace_s = close_grace_s  # a removed node's in-flight calls get this long (request_timeout_s)
        self._block_size: int | None = None  # the first block size a node reports (Stats)
        # ``interceptors``: trace-context propagation when tracing is on (common.telemetry.propagation) and
        # the cluster token; ``credentials``: TLS to the nodes (common.serving.security).
        self._interceptors, self._credentials = list(interceptors), credentials
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._prefill: dict[str, prefill_pb2_grpc.PrefillStub] = {}
        self._decode: dict[str, decode_pb2_grpc.DecodeStub] = {}
        self.fixed = frozenset((*router.prefill, *router.decode))  # the static targets: never dropped
        for t in router.prefill:
            self._connect("prefill", t)
        for t in router.decode:
            self._connect("decode", t)
        self._poller: asyncio.Task[None] | None = None
        self._warned: set[str] = set()
        self._slow_polls: dict[str, int] = {}  # polls in a row a connected node left unanswered
        self._down_since: dict[str, float] = {}  # registered nodes whose polls fail: since when
        self._closing: set[asyncio.Task[None]] = set()  # channels of removed nodes, closing after their calls

    def _connect(self, role: str, target: str) -> None:
        channel = self._channels[target] = open_channel(target, interceptors=self._interceptors,
                                                        credentials=self._credentials)
        if role == "prefill":
            self._prefill[target] = prefill_pb2_grpc.PrefillStub(channel)
        else:
            self._decode[target] = decode_pb2_grpc.DecodeStub(channel)

    def add(self, role: str, target: str, node_id: str = "") -> None:
        """A registered node joins: a channel to it, and routing once a poll answers (until then it is
        routed as the static nodes are before their first poll: optimistically)."""
        self._router.add(role, target, node_id)
        self._connect(role, target)

    def remove(self, target: str) -> None:
        """A registered node leaves routing now. Its channel closes once the calls on it ended (each within
        its request's deadline), so a deregistered node's streams finish; a dead node's fail as they would."""
        assert target not in self.fixed, f"{target} is a static target"
        if self._router.remove(target) is None:
            return
        self._prefill.pop(target, None)
        self._decode.pop(target, None)
        self._slow_polls.pop(target, None)
        self._down_since.pop(target, None)
        channel = self._channels.pop(target)
        task = asyncio.create_task(channel.close(self._close_grace_s), name=f"close-{target}")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def stats(self, target: str, timeout_s: float) -> common_pb2.NodeStats:
        """The node's Stats now (a drain watches it empty)."""
        stub = self._prefill.get(target) or self._decode[target]
        return await stub.Stats(common_pb2.StatsRequest(), timeout=timeout_s)

    @property
    def block_size(self) -> int:
        """The nodes' KV block size, as the first node to answer reported it (prefix-affinity hashing and
        ModelInfo use it; the gateway has no setting for it). ``DEFAULT_BLOCK_SIZE`` until a node answers."""
        return self._block_size or DEFAULT_BLOCK_SIZE

    def prefill(self, target: str) -> prefill_pb2_grpc.PrefillStub:
        return self._prefill[target]

    def decode(self, target: str) -> decode_pb2_grpc.DecodeStub:
        return self._decode[target]

    def kv_event_streams(self) -> dict[str, grpc.aio.UnaryStreamMultiCallable]:
        """Each member's ``SubscribeKvEvents`` (gateway.kv_event_merger follows the members as they change)."""
        streams = {t: stub.SubscribeKvEvents for t, stub in self._prefill.items()}
        streams.update({t: stub.SubscribeKvEvents for t, stub in self._decode.items()})
        return streams

    def is_connected(self, target: str) -> bool:
        """Whether the channel holds a live connection. A call that failed UNAVAILABLE on a channel
        that is not READY never reached the node (or the node died): the node is down, not the request."""
        channel = self._channels.get(target)  # None: the node left (deregistered, drained or dropped)
        return channel is not None and channel.get_state(try_to_connect=False) == grpc.ChannelConnectivity.READY

    async def start(self) -> None:
        """Poll once (so the first requests are routed on real load), then keep polling in the background."""
        await self.poll_once(first_contact=True)
        self._poller = asyncio.create_task(self._poll_forever(), name="gateway-stats-poller")

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        await asyncio.gather(*(channel.close() for channel in self._channels.values()))
        for task in list(self._closing):
            task.cancel()
        await asyncio.gather(*self._closing, return_exceptions=True)

    async def poll_once(self, first_contact: bool = False) -> None:
        """Ask every node for its Stats at once; a node that does not answer is marked unreachable.
        ``first_contact``: wait up to FIRST_POLL_TIMEOUT_S for each connection to come up and answer."""
        timeout_s = FIRST_POLL_TIMEOUT_S if first_contact else min(self._interval, 2.0)
        await asyncio.gather(*(self._poll(t, self._prefill[t].Stats, timeout_s, first_contact) for t in self._prefill),
                             *(self._poll(t, self._decode[t].Stats, timeout_s, first_contact) for t in self._decode))

    async def _poll(self, target: str, stats_rpc: grpc.aio.UnaryUnaryMultiCallable, timeout_s: float,
                    wait_for_ready: bool) -> None:
        try:
            stats = await stats_rpc(common_pb2.StatsRequest(), timeout=timeout_s, wait_for_ready=wait_for_ready)
        except grpc.aio.AioRpcError as exc:
            # A node whose connection is up but whose answer came late is busy (its CPUs taken by its own
            # steps, or by a neighbour), not down: routing it nothing would refuse load it can serve. Only
            # SLOW_POLLS_UNTIL_DOWN unanswered polls in a row on a live connection (a hung process) count.
            if (node := self._router.find(target)) is None:
                return  # it left while the poll was out
            slow = self._slow_polls[target] = self._slow_polls.get(target, 0) + 1
            if (exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and self.is_connected(target)
                    and slow < SLOW_POLLS_UNTIL_DOWN):
                log.info("node %s answered no Stats within %.3g s (%d in a row): busy, still routed", target,
                         timeout_s, slow)
                return
            if node.reachable:
                log.warning("node %s unreachable: %s %s", target, exc.code().name, exc.details())
            self._router.mark_unreachable(target)
            if target not in self.fixed:
                down_since = self._down_since.setdefault(target, time.monotonic())
                if time.monotonic() - down_since >= self._drop_after_s:
                    log.warning("node %s (%s) dropped: no answer for %.3g s", node.node_id, target,
                                time.monotonic() - down_since)
                    self.remove(target)
            return
        if (node := self._router.find(target)) is None:
            return
        self._slow_polls.pop(target, None)
        self._down_since.pop(target, None)
        if stats.block_size and self._block_size is None:
            self._block_size = stats.block_size
            log.info("nodes' KV block size: %d tokens (reported by %s)", stats.block_size, target)
        elif stats.block_size and stats.block_size != self._block_size and target not in self._warned:
            # Prefix affinity hashes blocks of block_size tokens; a mismatch only weakens affinity.
            self._warned.add(target)
            log.warning("node %s uses block_size %d, the other nodes %d: prefix affinity will miss on it",
                        target, stats.block_size, self._block_size)
        if not node.reachable:
            log.info("node %s reachable again", target)
        self._router.update(target, load_from_proto(stats))

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.poll_once()
            except Exception:  # never let one odd answer stop routing updates
                log.exception("stats poll failed")

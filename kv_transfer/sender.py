"""Prefill side of KV transfer: pushes KV blocks into a decode node's reserved blocks as they are produced.

Per decode node, made on first use and reused: one gRPC channel, one ``Connect`` stream and one 2-rank pair
group. After any failure the pair is dropped and the next ``open`` pairs again under a new epoch.

Each pair (``SenderPair``, sender_pair.py) keeps the order of its transfers' pushes, completions and aborts.
Chunks already announced are always sent, even after an abort, because the receiver will post (scratch)
recvs for them; a transfer's ``wait`` therefore reports only once its announced sends ended. Handle state
lives on the event loop; the engine thread reaches it only through ``call_soon_threadsafe``.

Transport (kv_transfer/transport.py): the handshake offers shared memory first when ``transport`` allows
it; a decode node on the same host answers with its KV memory and no pair group is formed. When that
memory cannot be mapped here (another container's /dev/shm), ``auto`` pairs again over sockets.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import TYPE_CHECKING

import grpc

from common.kv.shared_segment import SharedMemoryUnavailable
from kv_transfer.errors import TransferFailed
from kv_transfer.layout import PROTOCOL_VERSION
from kv_transfer.pair_group import PairGroupConfig
from kv_transfer.sender_pair import SenderPair, describe
from kv_transfer.shared_kv_writer import SharedKVWriter
from kv_transfer.transfer_handle import TransferHandle, TransferStats
from kv_transfer.transport import SHM, SOCKET, host_id, offered_transports
from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

    from common.kv.kv_cache import KVCache
    from tandem.v1 import prefill_pb2

log = logging.getLogger(__name__)

KVMessage = kv_transfer_pb2.KVMessage

__all__ = ["KVSender", "TransferHandle", "TransferStats"]


class KVSender:
    """The prefill node's end: one pair per decode node, made on first ``open`` and reused."""

    def __init__(
        self,
        kv_cache: KVCache,
        layout: kv_transfer_pb2.KVLayout,
        node_id: str,
        group_timeout_s: float = 30.0,
        host: str | None = None,
        transport: str = "auto",
        open_channel: Callable[[str], grpc.aio.Channel] | None = None,
        host_identity: str = "",
    ) -> None:
        """``host``: local address the data plane listens on; None = the one that routes to the decode node.
        ``transport``: auto (shared memory with a decode node on this host, sockets otherwise) | shm | socket.
        ``open_channel``: dials a decode node's KVTransfer service (the cluster's TLS credentials and token,
        ``common.serving.security.ChannelFactory``); None = a plaintext channel. ``host_identity``: this node's
        host for the transport choice ("": the machine's, ``transport.host_id``).
        """
        self._open_channel = open_channel or grpc.aio.insecure_channel
        self.transport = transport
        self._offered = offered_transports(transport)
        self._host_id = host_identity or host_id()
        self.kv_cache = kv_cache
        self.layout = layout
        self.node_id = node_id
        self.group_timeout_s = group_timeout_s
        self.host = host
        self.bytes_per_block = kv_cache.spec.elements_per_block * kv_cache.data.element_size()
        self._pairs: dict[str, SenderPair] = {}
        self._connect_locks: dict[str, asyncio.Lock] = {}
        self._all_pairs: list[SenderPair] = []
        self._background_tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    async def open(
        self,
        transfer_id: str,
        destination: prefill_pb2.KVDestination,
        trace_context: dict[str, str] | None = None,
    ) -> TransferHandle:
        """A handle for one request's transfer into ``destination`` (pairs with that decode node if needed).

        Raises TransferFailed when the decode node is unreachable or refuses the pair (the reason names the
        layout field that differs).
        """
        if self._closed:
            raise TransferFailed(transfer_id, f"prefill node {self.node_id} is shutting down")
        pair = await self._pair_for(destination.kv_endpoint)
        if transfer_id in pair.handles:
            raise ValueError(f"KV transfer {transfer_id!r} is already open")
        handle = TransferHandle(pair, transfer_id, dict(trace_context or {}))
        pair.handles[transfer_id] = handle
        return handle

    async def close(self) -> None:
        """Fail open transfers (after their announced sends) and drop every pair."""
        self._closed = True
        pairs = list(self._all_pairs)  # live pairs; broken ones already left, their threads exit by themselves
        for pair in pairs:
            pair.shut(f"prefill node {self.node_id} is shutting down")
        for pair in pairs:
            await asyncio.to_thread(pair.join, self.group_timeout_s + 5)
            await pair.wait_stopped()
        if self._background_tasks:
            await asyncio.gather(*self._background_tasks, return_exceptions=True)

    # ------------------------------------------------------------------ pairing

    async def _pair_for(self, endpoint: str) -> SenderPair:
        pair = self._pairs.get(endpoint)
        if pair is not None and pair.error is None:
            return pair
        async with self._connect_locks.setdefault(endpoint, asyncio.Lock()):
            pair = self._pairs.get(endpoint)
            if pair is None or pair.error is not None:
                pair = await self._connect(endpoint)
                self._pairs[endpoint] = pair
            return pair

    async def _connect(self, endpoint: str, transports: list[str] | None = None) -> SenderPair:
        transports = transports or self._offered
        channel = self._open_channel(endpoint)
        call = kv_transfer_pb2_grpc.KVTransferStub(channel).Connect()
        pair: SenderPair | None = None
        unmappable: SharedMemoryUnavailable | None = None
        try:
            async with asyncio.timeout(self.group_timeout_s):
                handshake = kv_transfer_pb2.Handshake(protocol_version=PROTOCOL_VERSION, sender_id=self.node_id,
                                                      layout=self.layout, device_type=self.kv_cache.data.device.type,
                                                      host_id=self._host_id, transports=transports)
                await call.write(KVMessage(handshake=handshake))
                msg = await call.read()
                if msg is grpc.aio.EOF or msg.WhichOneof("kind") != "handshake_reply":
                    raise TransferFailed(None, f"decode node at {endpoint} sent no handshake reply")
                reply = msg.handshake_reply
                if not reply.accepted:
                    raise TransferFailed(None, f"decode node {reply.receiver_id or endpoint} refused to pair: "
                                               f"{reply.error}")
                timeout_s = reply.timeout_seconds or self.group_timeout_s
                if reply.transport == SHM:
                    # Mapping populates every page of the decode node's KV: off the event loop.
                    writer = await asyncio.to_thread(SharedKVWriter.open, reply.shared_kv, self.kv_cache)
                    pair = SenderPair(self, endpoint, channel, call, reply.receiver_id, reply.group_prefix,
                                      timeout_s, writer)
                else:
                    pair = SenderPair(self, endpoint, channel, call, reply.receiver_id, reply.group_prefix,
                                      timeout_s)
                    store_host = reply.store_host or _host_of(endpoint)
                    bind_host = self.host if self.host is not None else _local_address_towards(store_host)
                    ready = pair.group.start(PairGroupConfig(store_host, reply.store_port, reply.group_prefix,
                                                             reply.sender_rank, timeout_s, bind_host))
                    await asyncio.wrap_future(ready)
        except BaseException as exc:
            if pair is not None:
                pair.group.close("pairing failed")
            call.cancel()
            await channel.close()
            if isinstance(exc, SharedMemoryUnavailable):
                unmappable = exc
            elif isinstance(exc, TransferFailed):
                raise
            elif isinstance(exc, TimeoutError):
                raise TransferFailed(None, f"pairing with decode node at {endpoint} timed out after "
                                           f"{self.group_timeout_s:g}s") from None
            elif isinstance(exc, grpc.aio.AioRpcError):
                raise TransferFailed(None, f"cannot reach decode node at {endpoint}: {describe(exc)}") from None
            else:
                raise
        if unmappable is not None:  # the decode node is on this host, but its memory is not ours to map
            if SOCKET not in transports:
                raise TransferFailed(None, f"kv_transport=shm: cannot map the KV of decode node at {endpoint}: "
                                           f"{unmappable}")
            log.warning("KV pair with decode node at %s: shared memory unusable (%s); pairing over sockets",
                        endpoint, unmappable)
            return await self._connect(endpoint, [SOCKET])
        assert pair is not None
        pair.start_io()
        self._all_pairs.append(pair)
        log.info("KV pair %s with decode node %s at %s formed over %s", reply.group_prefix, reply.receiver_id,
                 endpoint, pair.transport)
        return pair

    def forget(self, pair: SenderPair) -> None:
        """The pair was dropped (it calls this from ``shut``): the next ``open`` to its endpoint pairs again."""
        if self._pairs.get(pair.endpoint) is pair:
            del self._pairs[pair.endpoint]
        if pair in self._all_pairs:
            self._all_pairs.remove(pair)

    def background(self, coro: Coroutine[object, object, None]) -> None:
        """Run ``coro`` to its end without awaiting it here (``close`` awaits what is left)."""
        task = asyncio.ensure_future(coro)
        self._background_tasks.add(task)
        task.add_done_callback(self._background_tasks.discard)


def _host_of(endpoint: str) -> str:
    host = endpoint.rsplit(":", 1)[0]
    return host.removeprefix("ipv4:").removeprefix("ipv6:").strip("[]")


def _local_address_towards(host: str) -> str:
    """The local address that routes to ``host`` (no packet is sent); loopback for loopback."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return ""

"""The soak's KV-event check: a prefix index (gateway.kv_index) following every node, and its drift at the end.

``KvDriftWatch`` runs a ``KvIndexSync`` on its own thread and event loop against the nodes' own
``SubscribeKvEvents`` (the same code the gateway runs). ``cut`` closes its channels mid-run (a subscriber
whose connection dropped: it resumes by replay, or by snapshot when the node restarted); ``report`` compares,
once the load has stopped, each node's view with the node's own snapshot: the drift in blocks (0: exact, the
goal) and how long the view took to become exact.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from common.kv.kv_events import BlockDigest
from gateway.kv_event_merger import KvIndexSync
from gateway.kv_index import KvIndex
from tandem.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc


class KvDriftWatch:
    """Follows ``nodes`` (name -> (role, address)) from a thread of its own."""

    def __init__(self, nodes: dict[str, tuple[str, str]], retry_s: float = 0.25) -> None:
        self._nodes = nodes
        self._retry_s = retry_s
        self.index = KvIndex()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._sync: KvIndexSync | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="kv-drift", daemon=True)

    def start(self) -> KvDriftWatch:
        self._thread.start()
        self._ready.wait(10.0)
        return self

    def cut(self) -> None:
        """Drop every connection (the streams end mid-run); the index reconnects and resumes."""
        self._call(self._reopen)

    def report(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """Per node: its cached blocks, the view's drift from them, and the seconds until the view was exact."""
        return self._call(lambda: self._report(timeout_s))

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10.0)

    def _call(self, coro: Callable[[], Any]) -> Any:
        assert self._loop is not None, "not started"
        return asyncio.run_coroutine_threadsafe(coro(), self._loop).result(60.0)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        await self._reopen()
        self._sync = KvIndexSync(self.index, self._streams, retry_s=self._retry_s, members_s=0.5)
        self._sync.start()
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await self._sync.stop()
            for channel in self._channels.values():
                await channel.close()

    async def _reopen(self) -> None:
        old, self._channels = self._channels, {address: grpc.aio.insecure_channel(address)
                                               for _, address in self._nodes.values()}
        for channel in old.values():
            await channel.close()

    def _streams(self) -> dict[str, Callable[..., grpc.aio.UnaryStreamCall]]:
        out: dict[str, Callable[..., grpc.aio.UnaryStreamCall]] = {}
        for role, address in self._nodes.values():
            stub = prefill_pb2_grpc.PrefillStub if role == "prefill" else decode_pb2_grpc.DecodeStub
            out[address] = stub(self._channels[address]).SubscribeKvEvents
        return out

    async def _report(self, timeout_s: float) -> dict[str, Any]:
        nodes: dict[str, Any] = {}
        for name, (_, address) in self._nodes.items():
            start = time.monotonic()
            truth = await self._snapshot(address)
            node_digest = BlockDigest(truth.digest.sum, truth.digest.count)
            while True:
                view = self.index.view(address)
                exact = view.sequence == truth.sequence and view.incarnation == truth.incarnation \
                    and view.hashes == set(truth.snapshot.block_hashes)
                if exact or time.monotonic() - start > timeout_s:
                    break
                await asyncio.sleep(0.02)
            nodes[name] = {"blocks": node_digest.count, "view_blocks": len(view.hashes),
                           "drift_blocks": view.digest.drift(node_digest), "exact": exact,
                           "seconds_to_exact": round(time.monotonic() - start, 3) if exact else None}
        resyncs = dict(self._sync.num_resyncs) if self._sync is not None else {}
        return {"nodes": nodes, "drift_blocks": sum(n["drift_blocks"] for n in nodes.values()),
                "exact": all(n["exact"] for n in nodes.values()), "resyncs": resyncs}

    async def _snapshot(self, address: str) -> common_pb2.KvEventBatch:
        role = next(r for r, a in self._nodes.values() if a == address)
        stub = prefill_pb2_grpc.PrefillStub if role == "prefill" else decode_pb2_grpc.DecodeStub
        call = stub(self._channels[address]).SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(snapshot=True))
        try:
            async for batch in call:
                return batch
        finally:
            call.cancel()
        raise RuntimeError(f"{address}: no snapshot")

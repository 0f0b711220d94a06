"""The gateway's live membership: the ``tandem.v1.Membership`` service nodes register with, and drain.

A node that is ready registers (``NodeInfo``: address, role, model, layout, KV endpoint, capacity) and
sends the same registration again every few seconds (common/serving/registrar.py), so a gateway that
restarted learns about it again. It leaves by deregistering (its graceful shutdown), by failing (the stats
poller drops a registered node that answers nothing for ``node_drop_after_s``), or by a drain: no new
requests, wait until the node reports no running or waiting request and no used KV block, then deregister.
A drained incarnation of a node stays out (its registrar stops); the node restarted may register again.

The static targets (``--prefill`` / ``--decode``) are fixed members: a registration of one of their addresses
is acknowledged as ``fixed``, and they cannot be deregistered or drained through this service.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from common.serving.channel import format_address
from gateway.node_pool import NodePool
from gateway.router import Router
from tandem.v1 import membership_pb2, membership_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = membership_pb2.DESCRIPTOR.services_by_name["Membership"].full_name
ROLES = ("prefill", "decode")
DEFAULT_DRAIN_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Member:
    """A registered node, as it described itself."""

    node_id: str
    role: str
    target: str
    incarnation: str
    info: membership_pb2.NodeInfo

    @classmethod
    def from_proto(cls, info: membership_pb2.NodeInfo) -> Member:
        """The registration, checked: a caller mistake raises ValueError naming the field."""
        if not info.node_id:
            raise ValueError("node_id is required")
        if info.role not in ROLES:
            raise ValueError(f"role must be prefill or decode, got {info.role!r} (node {info.node_id})")
        host, sep, port = info.address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(f"address: {info.address!r} is not host:port (node {info.node_id})")
        if info.role == "decode" and not info.kv_endpoint:
            raise ValueError(f"kv_endpoint is required for a decode node (node {info.node_id})")
        return cls(info.node_id, info.role, format_address(host.strip("[]"), int(port)), info.incarnation, info)


class MembershipServicer(membership_pb2_grpc.MembershipServicer):
    """Registrations, deregistrations and drains, applied to the ``NodePool`` (and through it the router)."""

    def __init__(self, pool: NodePool, router: Router, poll_interval_s: float, model: str = "") -> None:
        self._pool = pool
        self._model = model  # the gateway's model directory's name: a node naming another one is logged
        self._router = router
        self._poll_interval_s = poll_interval_s
        self._registered: dict[str, Member] = {}  # node_id -> its registration
        self._drained: set[tuple[str, str]] = set()  # (node_id, incarnation) drained: not let back in
        self._lock = asyncio.Lock()  # one change to the membership at a time

    def members(self) -> dict[str, str]:
        """node_id -> target of every registered node still in routing (the poller drops dead ones)."""
        return {m.node_id: m.target for m in self._registered.values() if self._router.find(m.target) is not None}

    def _lookup(self, node_id: str) -> Member | None:
        member = self._registered.get(node_id)
        if member is not None and self._router.find(member.target) is None:  # dropped by the poller
            del self._registered[node_id]
            return None
        return member

    async def Register(self, request: membership_pb2.NodeInfo,
                       context: grpc.aio.ServicerContext) -> membership_pb2.RegisterResponse:
        try:
            member = Member.from_proto(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if member.target in self._pool.fixed:
            return membership_pb2.RegisterResponse(fixed=True)
        if (member.node_id, member.incarnation) in self._drained:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"node {member.node_id} was drained; restart it to register again")
        async with self._lock:
            known = self._lookup(member.node_id)
            if known is not None and known.target == member.target and known.role == member.role:
                self._registered[member.node_id] = member  # a heartbeat (perhaps a new incarnation: same place)
                return membership_pb2.RegisterResponse()
            if known is not None:  # the node restarted elsewhere (another port or role): the old place is gone
                log.info("node %s moved from %s to %s", member.node_id, known.target, member.target)
                self._leave(known)
            if (other := self._router.find(member.target)) is not None:
                holder = next((m.node_id for m in self._registered.values() if m.target == member.target), None)
                if holder is None:  # unreachable: a registration cannot take a static target's place
                    await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"address {member.target} is taken by "
                                        f"node {other.node_id}")
                assert holder is not None
                log.info("node %s replaces node %s at %s", member.node_id, holder, member.target)
                self._leave(self._registered[holder])
            self._registered[member.node_id] = member
            self._pool.add(member.role, member.target, member.node_id)
        info = member.info
        if self._model and info.model and info.model != self._model:
            # Warned, not refused: one model may sit in directories of different names on different hosts.
            log.warning("node %s serves model %s, the gateway's tokenizer is %s's", member.node_id, info.model,
                        self._model)
        log.info("node %s joined: %s at %s (model %s, %dx%d ranks, %d blocks of %d tokens%s)", member.node_id,
                 member.role, member.target, info.model or "?", info.tensor_parallel_size or 1,
                 info.pipeline_parallel_size or 1, info.num_blocks, info.block_size,
                 f", KV at {info.kv_endpoint}" if info.kv_endpoint else "")
        return membership_pb2.RegisterResponse()

    async def Deregister(self, request: membership_pb2.DeregisterRequest,
                         context: grpc.aio.ServicerContext) -> membership_pb2.DeregisterResponse:
        async with self._lock:
            member = await self._member(request.node_id, context)
            self._leave(member)
        log.info("node %s left (deregistered): %s", member.node_id, member.target)
        return membership_pb2.DeregisterResponse()

    async def Drain(self, request: membership_pb2.DrainRequest,
                    context: grpc.aio.ServicerContext) -> membership_pb2.DrainResponse:
        async with self._lock:
            member = await self._member(request.node_id, context)
            node = self._router.node(member.target)
            if node.draining:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"node {member.node_id} is already draining")
            node.draining = True
        timeout_s = request.timeout_seconds or DEFAULT_DRAIN_TIMEOUT_S
        if (remaining := context.time_remaining()) is not None:
            timeout_s = min(timeout_s, remaining - 0.5)  # answer before the caller's deadline does
        started = time.monotonic()
        log.info("draining node %s (%s), at most %.3g s", member.node_id, member.target, timeout_s)
        try:
            left = await self._wait_empty(member, timeout_s)
        except BaseException:
            node.draining = False  # the caller went away: the node serves again
            raise
        if left:
            node.draining = False
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"node {member.node_id} did not drain within {timeout_s:.3g} s ({left}); it is "
                                "routed again")
        async with self._lock:
            # The heartbeats went on meanwhile: the registration now held is the latest (same node, same place).
            if (latest := self._lookup(member.node_id)) is not None and latest.target == member.target:
                self._leave(latest)
                self._drained.add((latest.node_id, latest.incarnation))
        seconds = time.monotonic() - started
        log.info("node %s drained in %.3g s and left: %s", member.node_id, seconds, member.target)
        return membership_pb2.DrainResponse(address=member.target, seconds=seconds)

    async def _member(self, node_id: str, context: grpc.aio.ServicerContext) -> Member:
        member = self._lookup(node_id)
        if member is not None:
            return member
        fixed = [t for t in self._pool.fixed if (n := self._router.find(t)) is not None and n.node_id == node_id]
        if fixed:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"node {node_id} ({fixed[0]}) is a static target (--prefill / --decode): a fixed "
                                "member, it leaves when the gateway restarts without it")
        known = ", ".join(sorted(self.members())) or "none"
        await context.abort(grpc.StatusCode.NOT_FOUND, f"node {node_id!r} is not registered with this gateway "
                            f"(registered: {known})")
        raise AssertionError("abort raises")

    async def _wait_empty(self, member: Member, timeout_s: float) -> str:
        """Wait until the node runs and holds nothing; "" then, else what it still had at the timeout."""
        deadline = time.monotonic() + timeout_s
        node = self._router.node(member.target)
        left = "no answer yet"
        while True:
            if self._router.find(member.target) is not node:
                return ""  # it left meanwhile (deregistered, or dropped as dead): nothing is routed to it
            if node.inflight:
                left = f"{node.inflight} request(s) of this gateway in flight"
            else:
                try:
                    stats = await self._pool.stats(member.target, min(2.0, max(deadline - time.monotonic(), 0.1)))
                except grpc.aio.AioRpcError as exc:
                    left = f"Stats: {exc.code().name} {exc.details()}"
                else:
                    if not (stats.num_running or stats.num_waiting or stats.used_blocks):
                        return ""
                    left = (f"{stats.num_running} running, {stats.num_waiting} waiting, {stats.used_blocks} KV "
                            "blocks in use")
            if time.monotonic() >= deadline:
                return left
            await asyncio.sleep(min(self._poll_interval_s, 0.5, max(deadline - time.monotonic(), 0.0)))

    def _leave(self, member: Member) -> None:
        self._registered.pop(member.node_id, None)
        self._pool.remove(member.target)

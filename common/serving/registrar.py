"""A node's side of the gateway's live membership (gateway/membership.py): register once serving, again every
``interval_s`` (a heartbeat the gateway ignores while it knows the node, and that a restarted gateway learns
from), deregister on graceful shutdown.

The gateway health-checks registered nodes by polling their Stats, so a node that dies needs no goodbye. A
drained node (FAILED_PRECONDITION) stops registering: its incarnation stays out until it restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import grpc

from common.serving.server import RunningServer
from tandem.v1 import membership_pb2, membership_pb2_grpc

log = logging.getLogger(__name__)

# Refusals that a retry with the same registration cannot change: said once, then retried quietly (the
# gateway's operator may fix its side; a drained node stops instead).
_REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.UNAUTHENTICATED,
             grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED)


class GatewayRegistrar:
    """Keeps one node registered with the gateway at ``gateway`` (its internal port)."""

    def __init__(self, gateway: str, info: membership_pb2.NodeInfo, interval_s: float,
                 open_channel: Callable[[str], grpc.aio.Channel]) -> None:
        self._gateway = gateway
        self._info = info
        self._interval_s = interval_s
        self._channel = open_channel(gateway)
        self._stub = membership_pb2_grpc.MembershipStub(self._channel)
        self._task: asyncio.Task[None] | None = None
        self.registered = asyncio.Event()  # set while the last Register succeeded
        self.drained = False

    def start(self) -> None:
        assert self._task is None, "started twice"
        self._task = asyncio.create_task(self._run(), name=f"register-{self._info.node_id}")

    async def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the heartbeat and deregister (unless drained, or never registered); errors are logged only:
        a gateway that is gone drops the node when its polls fail."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            if self.registered.is_set() and not self.drained:
                await self._stub.Deregister(membership_pb2.DeregisterRequest(node_id=self._info.node_id),
                                            timeout=timeout_s)
                log.info("node %s deregistered from gateway %s", self._info.node_id, self._gateway)
        except grpc.aio.AioRpcError as exc:
            log.info("node %s: deregistering from gateway %s failed: %s %s", self._info.node_id, self._gateway,
                     exc.code().name, exc.details())
        finally:
            self.registered.clear()
            await self._channel.close()

    async def _run(self) -> None:
        said = ""  # the last failure logged at warning level: a gateway that stays away is said once
        while True:
            try:
                reply = await self._stub.Register(self._info, timeout=min(self._interval_s, 5.0) + 1.0)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    log.info("node %s stops registering with gateway %s: %s", self._info.node_id, self._gateway,
                             exc.details())
                    self.drained = True
                    self.registered.clear()
                    return
                failure = f"{exc.code().name}: {exc.details()}"
                if failure != said:
                    level = logging.ERROR if exc.code() in _REFUSALS else logging.WARNING
                    log.log(level, "node %s cannot register with gateway %s (%s); retrying every %.3g s",
                            self._info.node_id, self._gateway, failure, self._interval_s)
                    said = failure
                self.registered.clear()
            else:
                if not self.registered.is_set():
                    log.info("node %s registered with gateway %s%s", self._info.node_id, self._gateway,
                             " (a static target there)" if reply.fixed else "")
                said = ""
                self.registered.set()
            await asyncio.sleep(self._interval_s)


def register_node(running: RunningServer, info: membership_pb2.NodeInfo, gateway: str, interval_s: float,
                  open_channel: Callable[[str], grpc.aio.Channel]) -> GatewayRegistrar:
    """Start registering a node that serves at ``running`` (a ``RunningServer``) and deregister when it begins
    to stop (before its in-flight calls drain: the gateway sends it nothing new meanwhile)."""
    registrar = GatewayRegistrar(gateway, info, interval_s, open_channel)
    registrar.start()
    running.add_stopping_hook(registrar.stop)
    return registrar

"""The gateway's side of one ``Prefill.PrefillStream`` call: its writes (the request, then the KV destination, then
the half-close), its first answer, and the status the prefill node ended it with (gateway/coordinator.py drives it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any, TypeVar, cast

import grpc

from common.serving.errors import ServiceError
from tandem.v1 import prefill_pb2

T = TypeVar("T")

_CORE_PLACEHOLDER = "Internal error from Core"  # grpc.aio's status for a call whose write failed (see FirstStatus)
_STATUS_WAIT_S = 1.0


class FirstStatus:
    """The status a call ended with as first set (``add_done_callback`` runs at the first one only), read then.

    A write racing the node's own failure fails in grpc's core, and grpc.aio then sets the call's status to
    INTERNAL "Internal error from Core" (``_AioCall.set_internal_error``). If the node's status came first, that
    placeholder replaces it for good; if it comes after, it replaces the placeholder. Every read of the call
    raises whichever is set: a node that failed with UNAVAILABLE (no migration without it) or INVALID_ARGUMENT
    read as INTERNAL about one time in five (tests/gateway/test_gateway_service.py::
    test_prefill_errors_map_to_statuses_without_retry). This keeps the first; ``_node_status`` the other case."""

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""
        call.add_done_callback(self._ended)

    def _ended(self, call: grpc.aio.Call) -> None:
        # The call's status is set now: its coroutines return it without suspending, so they run here, on the
        # callback, before a placeholder can replace it.
        self.code = _now(call.code())
        self.details = _now(call.details()) or ""

    @property
    def from_node(self) -> bool:
        return self.code is not None and not (self.code == grpc.StatusCode.INTERNAL
                                              and self.details == _CORE_PLACEHOLDER)


def _now(coroutine: Coroutine[Any, Any, T]) -> T | None:
    """A coroutine's result if it returns without suspending, else None (closed)."""
    try:
        coroutine.send(None)
    except StopIteration as stop:
        return cast(T, stop.value)
    coroutine.close()
    return None


async def write(call: grpc.aio.StreamStreamCall, answer: asyncio.Future[prefill_pb2.PrefillResponse],
                 message: prefill_pb2.PrefillMessage | None, first: FirstStatus) -> None:
    """Write ``message`` to the prefill call (None: close its sending side); a call that ended meanwhile raises
    the status the node sent (grpc's "RPC already finished", or a placeholder status: ``FirstStatus``)."""
    try:
        await (call.write(message) if message is not None else call.done_writing())
    except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
        if (failure := await _node_status(call, first)) is not None:
            raise failure from None
        await answer
        raise ServiceError("the prefill node answered before its KV destination was sent") from None


async def _node_status(call: grpc.aio.StreamStreamCall, first: FirstStatus) -> grpc.aio.AioRpcError | None:
    """The ended call's status as the node sent it, past grpc's placeholder for a failed write (None: OK):
    the first status set if it was the node's, else the one that replaces the placeholder (up to a second)."""
    if first.from_node:
        code, details = cast(grpc.StatusCode, first.code), first.details
    else:
        give_up = time.monotonic() + _STATUS_WAIT_S
        while True:
            code, details = await call.code(), await call.details()
            if (code != grpc.StatusCode.INTERNAL or details != _CORE_PLACEHOLDER
                    or time.monotonic() >= give_up):
                break
            await asyncio.sleep(0.005)
    if code == grpc.StatusCode.OK:
        return None
    return grpc.aio.AioRpcError(code, await call.initial_metadata(), await call.trailing_metadata(), details)


async def first_answer(call: grpc.aio.StreamStreamCall, first: FirstStatus) -> prefill_pb2.PrefillResponse:
    """The prefill call's first answer, the first token (``kv_pending``); a call that failed raises its status
    (the node's, not grpc's placeholder for a write that failed meanwhile: ``FirstStatus``)."""
    try:
        response = await call.read()
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.INTERNAL and exc.details() == _CORE_PLACEHOLDER:
            raise (await _node_status(call, first) or exc) from None
        raise
    if response is grpc.aio.EOF:
        raise ServiceError(f"the prefill node ended its call without an answer ({(await call.code()).name})")
    if not response.kv_pending:
        raise ServiceError("the prefill node's first answer did not come before its KV transfer ended")
    return response

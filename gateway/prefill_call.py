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

_CORE_PLACEHOLDER = "Internal error from Core"  # grpc.aio's status for a call whose write failed (see PrefillCall)
_STATUS_WAIT_S = 1.0


class PrefillCall:
    """One ``Prefill.PrefillStream`` call as the gateway drives it, reading the status the node ended it with.

    A write racing the node's own failure fails in grpc's core, and grpc.aio then sets the call's status to
    INTERNAL "Internal error from Core" (``_AioCall.set_internal_error``). If the node's status came first, that
    placeholder replaces it for good; if it comes after, it replaces the placeholder. Every read of the call
    raises whichever is set: a node that failed with UNAVAILABLE (no migration without it) or INVALID_ARGUMENT
    read as INTERNAL about one time in five (tests/gateway/test_gateway_service.py::
    test_prefill_errors_map_to_statuses_without_retry). So the status first set is kept as it is set
    (``add_done_callback`` runs at the first one only), and a placeholder is waited past (``_node_status``)."""

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self.call = call
        self._code: grpc.StatusCode | None = None
        self._details = ""
        call.add_done_callback(self._ended)

    def _ended(self, call: grpc.aio.Call) -> None:
        # The call's status is set now: its coroutines return it without suspending, so they run here, on the
        # callback, before a placeholder can replace it.
        self._code = _now(call.code())
        self._details = _now(call.details()) or ""

    async def write(self, answer: asyncio.Future[prefill_pb2.PrefillResponse],
                    message: prefill_pb2.PrefillMessage | None) -> None:
        """Write ``message`` (None: close the sending side); a call that ended meanwhile raises the status the
        node sent (past grpc's "RPC already finished" or its placeholder); one that ended OK, ``answer``'s."""
        try:
            await (self.call.write(message) if message is not None else self.call.done_writing())
        except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
            if (failure := await self._node_status()) is not None:
                raise failure from None
            await answer
            raise ServiceError("the prefill node answered before its KV destination was sent") from None

    async def first_answer(self) -> prefill_pb2.PrefillResponse:
        """The first answer, the first token (``kv_pending``); a call that failed raises the node's status."""
        try:
            response = await self.call.read()
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INTERNAL and exc.details() == _CORE_PLACEHOLDER:
                raise (await self._node_status() or exc) from None
            raise
        if response is grpc.aio.EOF:
            raise ServiceError(f"the prefill node ended its call without an answer ({(await self.call.code()).name})")
        if not response.kv_pending:
            raise ServiceError("the prefill node's first answer did not come before its KV transfer ended")
        return response

    async def _node_status(self) -> grpc.aio.AioRpcError | None:
        """The ended call's status as the node sent it (None: OK): the first status set if it was the node's,
        else the one that replaces the placeholder (waited for up to a second)."""
        code, details = self._code, self._details
        give_up = time.monotonic() + _STATUS_WAIT_S
        while code is None or (code == grpc.StatusCode.INTERNAL and details == _CORE_PLACEHOLDER):
            code, details = await self.call.code(), await self.call.details()
            if code != grpc.StatusCode.INTERNAL or details != _CORE_PLACEHOLDER or time.monotonic() >= give_up:
                break
            await asyncio.sleep(0.005)
        if code == grpc.StatusCode.OK:
            return None
        return grpc.aio.AioRpcError(code, await self.call.initial_metadata(), await self.call.trailing_metadata(),
                                    details)


def _now(coroutine: Coroutine[Any, Any, T]) -> T | None:
    """A coroutine's result if it returns without suspending, else None (closed)."""
    try:
        coroutine.send(None)
    except StopIteration as stop:
        return cast(T, stop.value)
    coroutine.close()
    return None

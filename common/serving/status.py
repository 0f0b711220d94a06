"""One server interceptor per service that turns exceptions into gRPC statuses.

Servicers raise; they never build statuses themselves. ``InvalidRequestError`` becomes INVALID_ARGUMENT,
``EngineDeadError`` UNAVAILABLE (the node is going down),
a ``ServiceError`` its own ``code``, a service's own exception types whatever ``extra`` says, and anything
else INTERNAL with a generic message (the traceback goes to the log, never to the client).
``grpc.aio.AbortError`` (a handler that aborted on purpose) and ``asyncio.CancelledError`` (the client went
away) pass through untouched. A unary request whose bytes do not parse (corrupt wire format, a string
field that is not UTF-8) is INVALID_ARGUMENT too: gRPC itself would answer UNKNOWN.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc

from common.errors import EngineDeadError, InvalidRequestError, QueueFullError
from common.serving.errors import ServiceError

log = logging.getLogger(__name__)

# What a handler raises on purpose to end the RPC with a status it already chose.
_PASS_THROUGH: tuple[type[BaseException], ...] = (grpc.aio.AbortError,)

_Handle = Callable[[BaseException, Any], Awaitable[None]]


class _Undecodable:
    """What a unary request that failed to parse becomes, so that the handler's wrapper can answer it."""

    def __init__(self, error: Exception) -> None:
        self.error = InvalidRequestError("request", f"cannot be parsed: {error}")


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError and friends: the caller's bytes, not our bug
            return _Undecodable(exc)

    return parse


class StatusInterceptor(grpc.aio.ServerInterceptor):
    """Map exceptions raised by a service's handlers to gRPC statuses carrying the exception's message.

    ``extra`` maps a service's own exception types (e.g. a failed KV transfer) to status codes; it is
    consulted along the exception's MRO, so the most specific registered class wins.
    """

    def __init__(self, extra: Mapping[type[Exception], grpc.StatusCode] | None = None) -> None:
        self._table: dict[type[Exception], grpc.StatusCode] = {InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
                                                               QueueFullError: grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                               EngineDeadError: grpc.StatusCode.UNAVAILABLE}
        self._table.update(extra or {})

    def status_for(self, exc: BaseException) -> tuple[grpc.StatusCode, str]:
        """The status code and details the client receives for ``exc``."""
        for cls in type(exc).__mro__:
            code = self._table.get(cls)
            if code is not None:
                return code, str(exc)
        if isinstance(exc, ServiceError):
            return exc.code, str(exc)
        return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the server log"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: let gRPC answer UNIMPLEMENTED
            return handler
        method = handler_call_details.method

        async def handle(exc: BaseException, context: Any) -> None:
            await self._abort(exc, context, method)

        return wrap_handler(handler, handle)

    async def _abort(self, exc: BaseException, context: Any, method: str) -> None:
        code, details = self.status_for(exc)
        if code == grpc.StatusCode.INTERNAL and not isinstance(exc, ServiceError):
            log.error("%s failed", method, exc_info=exc)
        else:
            log.info("%s -> %s: %s", method, code.name, details)
        await context.abort(code, details)  # raises AbortError


def wrap_handler(handler: grpc.RpcMethodHandler, handle: _Handle) -> grpc.RpcMethodHandler:
    """Rebuild ``handler`` with every async behaviour wrapped so that its exceptions go to ``handle``.

    Sync behaviours (run by gRPC in a thread pool) are left as they are: Tandem's services are async.
    """
    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    unary_kwargs = {**kwargs, "request_deserializer": _tolerant(handler.request_deserializer)}
    if handler.unary_unary is not None and inspect.iscoroutinefunction(handler.unary_unary):
        return grpc.unary_unary_rpc_method_handler(_wrap_unary(handler.unary_unary, handle), **unary_kwargs)
    if handler.unary_unary is not None:
        return handler
    if handler.unary_stream is not None and (inspect.isasyncgenfunction(handler.unary_stream)
                                             or inspect.iscoroutinefunction(handler.unary_stream)):
        return grpc.unary_stream_rpc_method_handler(_wrap_stream(handler.unary_stream, handle), **unary_kwargs)
    if handler.unary_stream is not None:
        return handler
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_wrap_unary(handler.stream_unary, handle), **kwargs)
    return grpc.stream_stream_rpc_method_handler(_wrap_stream(handler.stream_stream, handle), **kwargs)


def _wrap_unary(behavior: Callable[..., Any], handle: _Handle) -> Callable[..., Any]:
    """A handler that returns one response (or streams with ``context.write`` and returns None)."""
    if not inspect.iscoroutinefunction(behavior):
        return behavior

    async def call(request: Any, context: Any) -> Any:
        try:
            if isinstance(request, _Undecodable):
                raise request.error
            return await behavior(request, context)
        except _PASS_THROUGH:
            raise
        except Exception as exc:
            await handle(exc, context)

    return call


def _wrap_stream(behavior: Callable[..., Any], handle: _Handle) -> Callable[..., Any]:
    """A streaming handler: an async generator, or a coroutine that writes with ``context.write``."""
    # gRPC picks the calling convention from the function's kind, so the wrapper must keep it.
    if not inspect.isasyncgenfunction(behavior):
        return _wrap_unary(behavior, handle)

    async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
        try:
            if isinstance(request, _Undecodable):
                raise request.error
            # aclosing: when gRPC closes us (client cancelled), the handler's own finally blocks run now.
            async with contextlib.aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response
        except _PASS_THROUGH:
            raise
        except Exception as exc:
            await handle(exc, context)

    return stream

"""W3C trace context over gRPC metadata (grpc.aio interceptors) and over KV-transfer control messages.

The server interceptor makes the caller's context current for the handler, so a servicer's span becomes
a child of the caller's span; the client interceptor writes the current context into each call's
metadata. Neither creates spans: the services name their own (see ``spans``). Both are installed only
when tracing is on (``server_interceptors`` / ``client_interceptors`` return nothing otherwise), so an
untraced process pays nothing per call.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context

from common.telemetry.tracing import tracing_enabled


def context_headers(span: trace.Span | None = None) -> dict[str, str]:
    """The W3C headers (traceparent, tracestate, baggage) of ``span``, or of the current context."""
    carrier: dict[str, str] = {}
    ctx = trace.set_span_in_context(span) if span is not None else None
    propagate.inject(carrier, context=ctx)
    return carrier


def context_from_headers(headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> Context | None:
    """The context carried by ``headers`` (metadata pairs or a dict); None when they carry none."""
    fields = propagate.get_global_textmap().fields
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    carrier = {k.lower(): v for k, v in pairs if k.lower() in fields}
    if "traceparent" not in carrier:
        return None
    ctx = propagate.extract(carrier)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """What ``start_server`` puts first on every server: context extraction when tracing is on."""
    return [TraceContextServerInterceptor()] if tracing_enabled() else []


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """For channels between services: context injection when tracing is on."""
    return trace_context_client_interceptors() if tracing_enabled() else []


class TraceContextServerInterceptor(grpc.aio.ServerInterceptor):
    """Run each handler with the caller's trace context (from its metadata) as the current context."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        ctx = context_from_headers(handler_call_details.invocation_metadata or ())  # type: ignore[attr-defined]
        if ctx is None:
            return handler
        return _with_context(handler, ctx)


def _with_context(handler: grpc.RpcMethodHandler, ctx: Context) -> grpc.RpcMethodHandler:
    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(_in_context(handler.unary_unary, ctx), **kwargs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_in_context(handler.unary_stream, ctx), **kwargs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_in_context(handler.stream_unary, ctx), **kwargs)
    return grpc.stream_stream_rpc_method_handler(_in_context(handler.stream_stream, ctx), **kwargs)


def _in_context(behavior: Callable[..., Any], ctx: Context) -> Callable[..., Any]:
    # gRPC picks the calling convention from the function's kind, so the wrapper keeps it. Every RPC runs
    # in its own task, so attach and detach happen in the same contextvars context.
    if inspect.isasyncgenfunction(behavior):
        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            token = otel_context.attach(ctx)
            try:
                # aclosing: when gRPC closes us (client cancelled), the handler's finally blocks run now.
                async with contextlib.aclosing(behavior(request, context)) as responses:
                    async for response in responses:
                        yield response
            finally:
                otel_context.detach(token)

        return stream
    if inspect.iscoroutinefunction(behavior):
        async def call(request: Any, context: Any) -> Any:
            token = otel_context.attach(ctx)
            try:
                return await behavior(request, context)
            finally:
                otel_context.detach(token)

        return call
    return behavior  # sync handlers run in gRPC's thread pool; Tandem has none


def _inject(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    headers = context_headers()
    if not headers:  # no valid current span: nothing to carry
        return details
    metadata = grpc.aio.Metadata(*tuple(details.metadata or ()))
    for key, value in headers.items():
        metadata[key] = value
    return details._replace(metadata=metadata)  # type: ignore[attr-defined, no-any-return]


# grpc.aio files each channel interceptor under exactly one call kind (the first base class it matches),
# so propagation takes one interceptor per kind.


class UnaryUnaryTraceContext(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails,
                                    request: Any) -> Any:
        return await continuation(_inject(client_call_details), request)


class UnaryStreamTraceContext(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails,
                                     request: Any) -> Any:
        return await continuation(_inject(client_call_details), request)


class StreamUnaryTraceContext(grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails,
                                     request_iterator: Any) -> Any:
        return await continuation(_inject(client_call_details), request_iterator)


class StreamStreamTraceContext(grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails,
                                      request_iterator: Any) -> Any:
        return await continuation(_inject(client_call_details), request_iterator)


def trace_context_client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """Add the current context's traceparent/tracestate to the metadata of every kind of call."""
    return [UnaryUnaryTraceContext(), UnaryStreamTraceContext(), StreamUnaryTraceContext(),
            StreamStreamTraceContext()]

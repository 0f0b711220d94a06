"""The status interceptor: exceptions -> statuses, on every handler kind, over a real grpc.aio server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from scripted_nodes import run_async

from common.errors import InvalidRequestError
from common.sampling.params import SamplingParamsError
from common.serving.channel import open_channel
from common.serving.errors import (
    DeadlineExceededError,
    NotFoundError,
    ResourceExhaustedError,
    ServiceError,
    UnavailableError,
)
from common.serving.server import start_server
from common.serving.status import StatusInterceptor


class TransferFailed(RuntimeError):
    """Stands in for a service's own exception type."""


@pytest.mark.parametrize(("exc", "code", "details"), [
    (InvalidRequestError("top_p", "must be in (0, 1]"), grpc.StatusCode.INVALID_ARGUMENT, "top_p: must be in (0, 1]"),
    (SamplingParamsError("seed", "too big"), grpc.StatusCode.INVALID_ARGUMENT, "seed: too big"),
    (ResourceExhaustedError("max_inflight=4"), grpc.StatusCode.RESOURCE_EXHAUSTED, "max_inflight=4"),
    (UnavailableError("node down"), grpc.StatusCode.UNAVAILABLE, "node down"),
    (DeadlineExceededError("late"), grpc.StatusCode.DEADLINE_EXCEEDED, "late"),
    (NotFoundError("no transfer t1"), grpc.StatusCode.NOT_FOUND, "no transfer t1"),
    (ServiceError("node said so", grpc.StatusCode.OUT_OF_RANGE), grpc.StatusCode.OUT_OF_RANGE, "node said so"),
    (TransferFailed("peer gone"), grpc.StatusCode.UNAVAILABLE, "peer gone"),
    (KeyError("secret-internal-detail"), grpc.StatusCode.INTERNAL, "internal error (KeyError); see the server log"),
])
def test_status_for(exc: Exception, code: grpc.StatusCode, details: str) -> None:
    interceptor = StatusInterceptor(extra={TransferFailed: grpc.StatusCode.UNAVAILABLE})
    assert interceptor.status_for(exc) == (code, details)


def test_extra_mapping_wins_over_the_builtin_one_for_subclasses() -> None:
    class QuotaError(UnavailableError):
        pass

    interceptor = StatusInterceptor(extra={QuotaError: grpc.StatusCode.RESOURCE_EXHAUSTED})
    assert interceptor.status_for(QuotaError("quota"))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert interceptor.status_for(UnavailableError("down"))[0] == grpc.StatusCode.UNAVAILABLE


# A tiny raw-bytes service: the request names the exception to raise.
_ERRORS: dict[bytes, Exception] = {
    b"invalid": InvalidRequestError("max_tokens", "must be >= 1, got 0"),
    b"busy": ResourceExhaustedError("limit max_inflight=1"),
    b"boom": ZeroDivisionError("traceback material"),
}


async def unary(request: bytes, context: Any) -> bytes:
    if request in _ERRORS:
        raise _ERRORS[request]
    if request == b"abort":
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "aborted on purpose")
    return b"ok:" + request


async def stream_gen(request: bytes, context: Any) -> AsyncIterator[bytes]:
    yield b"first"
    if request in _ERRORS:
        raise _ERRORS[request]
    yield b"second"


async def stream_writer(request: bytes, context: Any) -> None:
    await context.write(b"first")
    if request in _ERRORS:
        raise _ERRORS[request]
    await context.write(b"second")


async def bidi(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
    async for request in requests:
        if request in _ERRORS:
            raise _ERRORS[request]
        yield request


def _add(server: grpc.aio.Server) -> None:
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Errors", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "StreamGen": grpc.unary_stream_rpc_method_handler(stream_gen),
        "StreamWriter": grpc.unary_stream_rpc_method_handler(stream_writer),
        "Bidi": grpc.stream_stream_rpc_method_handler(bidi),
    }),))


def test_every_handler_kind_maps_exceptions_on_the_wire() -> None:
    async def scenario() -> None:
        server = await start_server([_add], ["test.Errors"], "127.0.0.1", 0)
        try:
            async with open_channel(server.address) as channel:
                call_unary = channel.unary_unary("/test.Errors/Unary")
                assert await call_unary(b"fine") == b"ok:fine"
                for request, code, details in [
                    (b"invalid", grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: must be >= 1, got 0"),
                    (b"busy", grpc.StatusCode.RESOURCE_EXHAUSTED, "limit max_inflight=1"),
                    (b"boom", grpc.StatusCode.INTERNAL, "internal error (ZeroDivisionError); see the server log"),
                    (b"abort", grpc.StatusCode.PERMISSION_DENIED, "aborted on purpose"),  # AbortError untouched
                ]:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call_unary(request)
                    assert (err.value.code(), err.value.details()) == (code, details)
                    assert "Traceback" not in (err.value.debug_error_string() or "")

                for method in ("StreamGen", "StreamWriter"):
                    call = channel.unary_stream(f"/test.Errors/{method}")(b"invalid")
                    assert await call.read() == b"first"  # messages before the failure arrive
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call.read()
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert [m async for m in channel.unary_stream(f"/test.Errors/{method}")(b"ok")] == [
                        b"first", b"second"]

                bidi_call = channel.stream_stream("/test.Errors/Bidi")()
                await bidi_call.write(b"echo")
                assert await bidi_call.read() == b"echo"
                await bidi_call.write(b"busy")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await bidi_call.read()
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            await server.stop(0)

    run_async(scenario())


def test_client_cancel_reaches_the_handler_as_cancelled_error() -> None:
    seen: list[str] = []
    started = asyncio.Event()

    async def slow(request: bytes, context: Any) -> AsyncIterator[bytes]:
        try:
            started.set()
            yield b"x"
            await asyncio.sleep(30)
            yield b"never"
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        finally:
            seen.append("finally")

    def add(server: grpc.aio.Server) -> None:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "test.Slow", {"Run": grpc.unary_stream_rpc_method_handler(slow)}),))

    async def scenario() -> None:
        server = await start_server([add], ["test.Slow"], "127.0.0.1", 0)
        try:
            async with open_channel(server.address) as channel:
                call = channel.unary_stream("/test.Slow/Run")(b"")
                assert await call.read() == b"x"
                call.cancel()
                for _ in range(100):
                    if "finally" in seen:
                        break
                    await asyncio.sleep(0.01)
            assert seen == ["cancelled", "finally"]  # not turned into an error status, not swallowed
        finally:
            await server.stop(0)

    run_async(scenario())


def test_a_request_that_does_not_parse_is_invalid_argument() -> None:
    """Corrupt wire bytes or a string field that is not UTF-8: INVALID_ARGUMENT naming the request (gRPC's own
    answer would be UNKNOWN with a protobuf exception's name); the service keeps serving."""
    from tandem.v1 import generate_pb2

    async def echo(request: generate_pb2.GenerateRequest, context: Any) -> bytes:
        return request.text.encode()

    async def echo_stream(request: generate_pb2.GenerateRequest, context: Any) -> AsyncIterator[bytes]:
        yield request.text.encode()

    def add(server: grpc.aio.Server) -> None:
        parse = generate_pb2.GenerateRequest.FromString
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Parse", {
            "Unary": grpc.unary_unary_rpc_method_handler(echo, request_deserializer=parse),
            "Stream": grpc.unary_stream_rpc_method_handler(echo_stream, request_deserializer=parse),
        }),))

    async def scenario() -> None:
        server = await start_server([add], ["test.Parse"], "127.0.0.1", 0)
        try:
            async with open_channel(server.address) as channel:
                unary_call = channel.unary_unary("/test.Parse/Unary")
                for bad in (b"\x12\x03\xff\xfe\xfd", b"\xff\xff\xff\xff"):  # text not UTF-8; corrupt wire format
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await unary_call(bad)
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert (err.value.details() or "").startswith("request: cannot be parsed: ")
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await channel.unary_stream("/test.Parse/Stream")(bad).read()
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                good = generate_pb2.GenerateRequest(text="hé").SerializeToString()
                assert await unary_call(good) == "hé".encode()
                assert [m async for m in channel.unary_stream("/test.Parse/Stream")(good)] == ["hé".encode()]
        finally:
            await server.stop(0)

    run_async(scenario())

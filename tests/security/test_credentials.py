"""TLS, mutual TLS and bearer tokens on real gRPC servers on 127.0.0.1 (common/serving/security.py).

A test service has one method of each call kind (the four kinds grpc.aio files interceptors under); each
echoes the request bytes, so every case checks that the call got through, or the status that refused it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.config.settings import SecuritySettings
from common.serving.channel import open_channel
from common.serving.security import (
    ChannelFactory,
    TokenAuthInterceptor,
    channel_credentials,
    internal_auth,
    server_credentials,
    token_interceptors,
)
from common.serving.server import RunningServer, start_server
from common.serving.status import StatusInterceptor
from tests.security.certs import Pki

SERVICE = "test.Echo"


def _add_echo(server: grpc.aio.Server) -> None:
    async def unary_unary(request: bytes, context: Any) -> bytes:
        return request

    async def unary_stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
        yield request
        yield request

    async def stream_unary(requests: AsyncIterator[bytes], context: Any) -> bytes:
        return b"".join([r async for r in requests])

    async def stream_stream(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for r in requests:
            yield r

    handlers = {
        "UnaryUnary": grpc.unary_unary_rpc_method_handler(unary_unary),
        "UnaryStream": grpc.unary_stream_rpc_method_handler(unary_stream),
        "StreamUnary": grpc.stream_unary_rpc_method_handler(stream_unary),
        "StreamStream": grpc.stream_stream_rpc_method_handler(stream_stream),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


async def _requests() -> AsyncIterator[bytes]:
    yield b"a"
    yield b"b"


async def call_every_kind(channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...] = ()) -> list[bytes]:
    """One call of each kind; the replies, in order."""
    out = [await channel.unary_unary(f"/{SERVICE}/UnaryUnary")(b"x", metadata=metadata, timeout=10)]
    out += [r async for r in channel.unary_stream(f"/{SERVICE}/UnaryStream")(b"y", metadata=metadata, timeout=10)]
    out.append(await channel.stream_unary(f"/{SERVICE}/StreamUnary")(_requests(), metadata=metadata, timeout=10))
    call = channel.stream_stream(f"/{SERVICE}/StreamStream")(_requests(), metadata=metadata, timeout=10)
    out += [r async for r in call]
    return out


EVERY_KIND = [b"x", b"y", b"y", b"ab", b"a", b"b"]


async def serve(security: SecuritySettings, internal: bool = True, token: str = "") -> RunningServer:
    interceptors: list[grpc.aio.ServerInterceptor] = (
        [TokenAuthInterceptor(token, [SERVICE], "cluster credential")] if token else [])
    return await start_server([_add_echo], [SERVICE], "127.0.0.1", 0,
                              interceptors=[*interceptors, StatusInterceptor()],
                              credentials=server_credentials(security, internal))


async def health(channel: grpc.aio.Channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return int(reply.status)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_tls_server_and_client(pki: Pki) -> None:
    async def scenario() -> None:
        server = await serve(SecuritySettings(pki.server.cert, pki.server.key), internal=False)
        try:
            async with open_channel(server.address, credentials=channel_credentials(
                    SecuritySettings(tls_ca=pki.ca))) as channel:
                assert await call_every_kind(channel) == EVERY_KIND
            async with open_channel(server.address) as plaintext:  # a plaintext client: no handshake, no call
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call_every_kind(plaintext)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            # A client that trusts another CA refuses the server.
            rogue_ca = pki.rogue.cert.parent / "rogue-ca.pem"
            async with open_channel(server.address, credentials=channel_credentials(
                    SecuritySettings(tls_ca=rogue_ca))) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call_every_kind(channel)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(0)

    run(scenario())


def test_mutual_tls_requires_a_client_certificate_the_ca_signed(pki: Pki) -> None:
    async def scenario() -> None:
        server = await serve(SecuritySettings(pki.server.cert, pki.server.key, pki.ca), internal=True)
        member = SecuritySettings(pki.client.cert, pki.client.key, pki.ca)
        intruder = SecuritySettings(pki.rogue.cert, pki.rogue.key, pki.ca)
        anonymous = SecuritySettings(tls_ca=pki.ca)  # verifies the server, presents no certificate
        try:
            async with ChannelFactory(member)(server.address) as channel:
                assert await call_every_kind(channel) == EVERY_KIND
                assert await health(channel) == health_pb2.HealthCheckResponse.SERVING
            for stranger in (intruder, anonymous):
                async with ChannelFactory(stranger)(server.address) as channel:
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await call_every_kind(channel)
                    # Refused in the handshake: the caller never reaches a handler.
                    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(0)

    run(scenario())


def test_token_guards_its_service_for_every_call_kind_and_leaves_health_open() -> None:
    async def scenario() -> None:
        server = await serve(SecuritySettings(), token="s3cret")
        try:
            async with open_channel(server.address, interceptors=token_interceptors("s3cret")) as channel:
                assert await call_every_kind(channel) == EVERY_KIND
            async with open_channel(server.address) as channel:
                assert await health(channel) == health_pb2.HealthCheckResponse.SERVING
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call_every_kind(channel)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "missing the cluster credential" in (info.value.details() or "")
            for kind in ("UnaryUnary", "UnaryStream", "StreamUnary", "StreamStream"):
                async with open_channel(server.address, interceptors=token_interceptors("guess")) as channel:
                    code, details = await _status(channel, kind)
                    assert code == grpc.StatusCode.UNAUTHENTICATED, kind
                    assert "is wrong" in details
        finally:
            await server.stop(0)

    run(scenario())


async def _status(channel: grpc.aio.Channel, kind: str) -> tuple[grpc.StatusCode, str]:
    """The status one call of ``kind`` ends with. Streaming requests send none: the server refuses before it
    reads any (a client still writing when the refusal lands sees its write fail instead of the status)."""
    method = f"/{SERVICE}/{kind}"
    call: Any
    if kind == "UnaryUnary":
        call = channel.unary_unary(method)(b"x", timeout=10)
    elif kind == "UnaryStream":
        call = channel.unary_stream(method)(b"x", timeout=10)
    elif kind == "StreamUnary":
        call = channel.stream_unary(method)(timeout=10)
    else:
        call = channel.stream_stream(method)(timeout=10)
    return await call.code(), await call.details() or ""


def test_token_and_mutual_tls_together(pki: Pki) -> None:
    """The cluster token on top of mutual TLS: a member's certificate without the token is UNAUTHENTICATED."""
    async def scenario() -> None:
        node = SecuritySettings(pki.server.cert, pki.server.key, pki.ca, internal_token="t0k")
        interceptors = [*internal_auth(node, [SERVICE]), StatusInterceptor()]
        server = await start_server([_add_echo], [SERVICE], "127.0.0.1", 0, interceptors=interceptors,
                                    credentials=server_credentials(node, internal=True))
        try:
            async with ChannelFactory(SecuritySettings(pki.client.cert, pki.client.key, pki.ca, "t0k"))(
                    server.address) as channel:
                assert await call_every_kind(channel) == EVERY_KIND
            async with ChannelFactory(SecuritySettings(pki.client.cert, pki.client.key, pki.ca))(
                    server.address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call_every_kind(channel)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            await server.stop(0)

    run(scenario())


def test_settings_name_the_field_that_is_wrong(tmp_path: Any, pki: Pki) -> None:
    from common.config.settings import load_settings

    with pytest.raises(ValueError, match=r"--tls-cert .* and --tls-key .* go together"):
        SecuritySettings(tls_cert=pki.server.cert)
    with pytest.raises(ValueError, match=r"--tls-ca \(TANDEM_TLS_CA\):.*is not a file"):
        load_settings(SecuritySettings, environ={"TANDEM_TLS_CA": str(tmp_path / "missing.pem")})
    with pytest.raises(ValueError, match=r"--tls-ca .* needs --tls-cert and --tls-key"):
        server_credentials(SecuritySettings(tls_ca=pki.ca), internal=True)
    loaded = load_settings(SecuritySettings, environ={"TANDEM_TLS_CERT": str(pki.server.cert),
                                                      "TANDEM_TLS_KEY": str(pki.server.key),
                                                      "TANDEM_INTERNAL_TOKEN": "x"})
    assert loaded.tls and not loaded.mutual_tls and loaded.internal_token == "x"
    assert channel_credentials(SecuritySettings()) is None

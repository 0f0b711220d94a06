"""TLS credentials and bearer tokens for Tandem's gRPC servers and channels (docs/security.md).

Two credentials, each off unless configured:

- **TLS** (``SecuritySettings.tls_cert`` / ``tls_key`` / ``tls_ca``): every server serves TLS with the
  process's certificate; every channel verifies the server against ``tls_ca`` and presents the same
  certificate as its client certificate. Internal servers (``internal=True``) given a CA require a client
  certificate it signed: mutual TLS, refused in the handshake (the caller sees UNAVAILABLE, no RPC runs).
- **Bearer tokens** in the ``authorization`` metadata: the public API's ``--api-key`` and the cluster's
  ``internal_token``. ``TokenAuthInterceptor`` refuses a call to a guarded service without the right token
  with UNAUTHENTICATED, before its handler runs; health checking and reflection stay open.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc

from common.config.settings import SecuritySettings
from common.serving.channel import open_channel

AUTHORIZATION = "authorization"  # gRPC metadata keys are lower case
BEARER = "Bearer "


def server_credentials(security: SecuritySettings, internal: bool) -> grpc.ServerCredentials | None:
    """TLS server credentials, or None for plaintext. An internal server given a CA requires client
    certificates signed by it (mutual TLS); the public gateway accepts any TLS client."""
    if security.tls_cert is None or security.tls_key is None:
        if security.tls_ca is not None and internal:
            raise ValueError("--tls-ca (TANDEM_TLS_CA) on a server needs --tls-cert and --tls-key too")
        return None
    ca = security.tls_ca.read_bytes() if security.tls_ca is not None else None
    return grpc.ssl_server_credentials([(security.tls_key.read_bytes(), security.tls_cert.read_bytes())],
                                       root_certificates=ca, require_client_auth=internal and ca is not None)


def channel_credentials(security: SecuritySettings) -> grpc.ChannelCredentials | None:
    """TLS channel credentials (verify the server with ``tls_ca``, or the system's roots without it; present
    the process's certificate when it has one), or None for a plaintext channel."""
    if security.tls_ca is None and security.tls_cert is None:
        return None
    ca = security.tls_ca.read_bytes() if security.tls_ca is not None else None
    key = security.tls_key.read_bytes() if security.tls_key is not None else None
    cert = security.tls_cert.read_bytes() if security.tls_cert is not None else None
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``token`` (none for an empty token)."""
    return ((AUTHORIZATION, BEARER + token),) if token else ()


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuse calls to ``services`` (full names, ``tandem.v1.Prefill``) whose ``authorization`` metadata is
    not ``Bearer <token>``, with UNAUTHENTICATED. Other services (health, reflection) pass untouched.

    ``what`` names the credential in the refusal (``"API key"``), so that a client knows which one it lacks.
    """

    def __init__(self, token: str, services: Iterable[str], what: str) -> None:
        assert token, "an empty token would let every caller in"
        self._expected = (BEARER + token).encode()
        self._prefixes = tuple(f"/{name}/" for name in services)
        self._what = what

    def authorized(self, metadata: Iterable[tuple[str, Any]] | None) -> bool:
        for key, value in metadata or ():
            if key.lower() == AUTHORIZATION:
                given = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(given, self._expected)  # constant time: no timing oracle
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        if handler is None or not method.startswith(self._prefixes):
            return handler
        if self.authorized(handler_call_details.invocation_metadata):  # type: ignore[attr-defined]
            return handler
        given = any(k.lower() == AUTHORIZATION for k, _ in handler_call_details.invocation_metadata or ())  # type: ignore[attr-defined]
        details = (f"{method}: the {self._what} is wrong" if given else
                   f"{method}: missing the {self._what} (metadata 'authorization: Bearer <token>')")
        return _refusal(handler, details)


def _refusal(handler: grpc.RpcMethodHandler, details: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that answers UNAUTHENTICATED without reading the request."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, details)

    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse, **kwargs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, **kwargs)
    return grpc.stream_stream_rpc_method_handler(refuse, **kwargs)


def _with_token(details: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*tuple(details.metadata or ()))
    metadata[AUTHORIZATION] = BEARER + token
    return details._replace(metadata=metadata)  # type: ignore[attr-defined, no-any-return]


# grpc.aio files each channel interceptor under exactly one call kind (the first base class it matches),
# so the token takes one interceptor per kind, as trace propagation does.


class _UnaryUnaryToken(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_unary(self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails,
                                    request: Any) -> Any:
        return await continuation(_with_token(client_call_details, self._token), request)


class _UnaryStreamToken(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_unary_stream(self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails,
                                     request: Any) -> Any:
        return await continuation(_with_token(client_call_details, self._token), request)


class _StreamUnaryToken(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_stream_unary(self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails,
                                     request_iterator: Any) -> Any:
        return await continuation(_with_token(client_call_details, self._token), request_iterator)


class _StreamStreamToken(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_stream_stream(self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails,
                                      request_iterator: Any) -> Any:
        return await continuation(_with_token(client_call_details, self._token), request_iterator)


def token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors that send ``token`` as ``authorization: Bearer <token>`` on every call (none for
    an empty token). Metadata, not call credentials: gRPC sends those on TLS channels only, and a loopback
    cluster may run a token without TLS."""
    if not token:
        return []
    return [_UnaryUnaryToken(token), _UnaryStreamToken(token), _StreamUnaryToken(token), _StreamStreamToken(token)]


def internal_auth(security: SecuritySettings, services: Iterable[str]) -> list[grpc.aio.ServerInterceptor]:
    """The interceptor that guards a node's internal services with the cluster token (none without one)."""
    if not security.internal_token:
        return []
    return [TokenAuthInterceptor(security.internal_token, services, "cluster credential (TANDEM_INTERNAL_TOKEN)")]


class ChannelFactory:
    """Opens the channels a process dials its peers with: the cluster's TLS credentials and token on each."""

    def __init__(self, security: SecuritySettings, interceptors: Iterable[grpc.aio.ClientInterceptor] = ()) -> None:
        self.credentials = channel_credentials(security)
        self.interceptors = [*interceptors, *token_interceptors(security.internal_token)]

    def __call__(self, target: str) -> grpc.aio.Channel:
        return open_channel(target, interceptors=self.interceptors, credentials=self.credentials)

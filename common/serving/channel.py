"""Client channels between Tandem's services, with options that suit a small loopback/LAN cluster."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

# gRPC's default reconnect backoff grows to 120 s: a node that restarts would look down for minutes.
# Keepalive pings find a peer that vanished without closing its socket (a partition, a hung host);
# servers (see server.py) accept pings this often.
CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
)


def format_address(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 literal."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def open_channel(target: str, options: Sequence[tuple[str, Any]] = (),
                 interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
                 credentials: grpc.ChannelCredentials | None = None) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to ``target`` (host:port) with Tandem's defaults (overridable): TLS with
    ``credentials`` (``common.serving.security.channel_credentials``), plaintext without."""
    merged = dict(CHANNEL_OPTIONS)
    merged.update(options)
    if credentials is not None:
        return grpc.aio.secure_channel(target, credentials, options=list(merged.items()),
                                       interceptors=list(interceptors) or None)
    return grpc.aio.insecure_channel(target, options=list(merged.items()), interceptors=list(interceptors) or None)

"""Servers accept the keepalive pings Tandem's own channels send (gRPC's keepalive guide, "ping strikes")."""

from __future__ import annotations

from common.serving.channel import CHANNEL_OPTIONS
from common.serving.server import SERVER_OPTIONS


def test_servers_accept_the_clients_keepalive_rate() -> None:
    client, server = dict(CHANNEL_OPTIONS), dict(SERVER_OPTIONS)
    # A client that pings more often than the server's minimum gets GOAWAY(ENHANCE_YOUR_CALM) after 2 strikes,
    # failing every call on the connection; the server's default minimum (5 minutes) is far above 30 s.
    assert server["grpc.http2.min_recv_ping_interval_without_data_ms"] < client["grpc.keepalive_time_ms"]
    assert not any(name.startswith("grpc.http2.min_ping_interval") for name in server)  # a sender's option

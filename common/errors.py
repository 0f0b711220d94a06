"""Errors the engines raise to callers: their mistakes (INVALID_ARGUMENT), a full queue (RESOURCE_EXHAUSTED)
and a dead engine (UNAVAILABLE: the node stops and its supervisor restarts it; another node can serve).

Services map both in one interceptor (``common.serving.status``); the engines import no gRPC.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request field is out of bounds; ``field`` names it and the message states the limit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class QueueFullError(RuntimeError):
    """The admission queue is at its limit; the message names the limit. Load beyond it is refused."""


class AddressInUseError(OSError):
    """A server cannot listen on its address: the port is taken, or the host is not a local address. A
    process that starts a server exits with ``EXIT_ADDRESS_IN_USE`` on it, so that its launcher can tell
    a lost race for a port from any other failure (and, where it chose the port, choose another)."""


EXIT_ADDRESS_IN_USE = 98  # EADDRINUSE's number, as an exit status


class EngineDeadError(RuntimeError):
    """The engine thread crashed (a parallel node's rank died, a bug); every pending request fails with this."""

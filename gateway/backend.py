"""What the public servicer needs from whatever produces the tokens: one ``generate`` per request.

Two backends implement it: the gateway's ``Coordinator`` (a decode node and a prefill node per request)
and ``tandem_cli.colocated_server.ColocatedCoordinator`` (a colocated engine in the same process). The
servicer owns admission, validation, the deadline and telemetry; a backend owns only where tokens come from.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gateway.output import OutputChunk
    from gateway.request import GatewayRequest


class GenerateBackend(Protocol):
    """Runs validated Generate requests; shared by all requests."""

    @property
    def block_size(self) -> int:
        """The KV block size its engines use (reported by the nodes, never configured on the gateway)."""
        ...

    def generate(self, req: GatewayRequest, arrival: float, deadline: float,
                 ) -> AsyncGenerator[OutputChunk, None]:
        """Yield ``req``'s output chunks: the first as soon as there is a first token (even when its text is
        held back: the time to first token), the last with finish reason, usage and timings.

        ``arrival`` and ``deadline`` are ``time.monotonic()`` values. Closing the generator early (the client
        went away, the deadline passed) aborts whatever still runs for the request. Raises
        ``ServiceError`` subclasses (or ``InvalidRequestError``) for failures the client is told about.
        """
        ...

"""The one error KV transfer raises to the services; the gateway maps it to UNAVAILABLE (retryable)."""

from __future__ import annotations


class TransferFailed(Exception):
    """A KV transfer (or the pair connection it needed) failed: peer died, abort, timeout, refused handshake.

    ``transfer_id`` is None when no single transfer is concerned (e.g. the handshake was refused).
    When this is raised from ``wait`` / ``abandon`` no data op for the transfer is in flight anymore.
    """

    def __init__(self, transfer_id: str | None, reason: str) -> None:
        prefix = f"KV transfer {transfer_id}: " if transfer_id else "KV transfer: "
        super().__init__(prefix + reason)
        self.transfer_id = transfer_id
        self.reason = reason

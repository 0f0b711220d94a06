"""Errors that are the caller's fault. Services map them to INVALID_ARGUMENT in one interceptor."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request field is out of bounds; ``field`` names it and the message states the limit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field

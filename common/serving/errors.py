"""Errors that services raise to answer an RPC with a specific gRPC status.

Raise these anywhere below a servicer; the status interceptor turns them into the status named by
``code`` with the exception's message as details. Caller mistakes keep using
``common.errors.InvalidRequestError`` (INVALID_ARGUMENT), which the interceptor maps too.
"""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    """An expected failure with a gRPC status; ``code`` defaults to the class's and may be set per instance.

    A per-instance code exists for relays (the gateway) that pass a node's status on to their caller.
    """

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class ResourceExhaustedError(ServiceError):
    """Over a limit (in-flight requests, queue length, KV blocks); the message names the limit."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(ServiceError):
    """A node or a connection is down, or the service is shutting down; the caller may retry."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(ServiceError):
    """A stage ran past its timeout or the request's deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFoundError(ServiceError):
    """The named thing (a transfer, a request id) does not exist here."""

    code = grpc.StatusCode.NOT_FOUND

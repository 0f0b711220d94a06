"""A request's decode leg at the gateway: the decode node's call, its reservation (or a local prefill), and the
task that reads its stream into a queue for the coordinator (gateway/coordinator.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TypeAlias

import grpc

from common.serving.errors import ServiceError
from gateway.router import NodeState
from tandem.v1 import decode_pb2


class StreamEnd:
    """Queued after the decode stream's last message."""


# ServiceError: the request's prefill failed after its first token (its KV transfer), queued by the coordinator.
QueueItem: TypeAlias = decode_pb2.DecodeResponse | StreamEnd | grpc.aio.AioRpcError | ServiceError
Reader: TypeAlias = asyncio.Task[grpc.aio.AioRpcError | None]  # the decode stream's reader: the error that ended it


@dataclass
class DecodeLeg:
    node: NodeState
    call: grpc.aio.UnaryStreamCall
    reservation: decode_pb2.Reservation | None  # None: the decode node prefills the prompt itself
    # A local prefill's first delta: prompt tokens cached on the decode node, time queued there.
    cached_tokens: int = 0
    queue_seconds: float = 0.0
    first_token_time: float | None = None
    backlog_tokens: int = 0  # a local prefill's tokens in the node's prefill backlog until its first token

    def settle_backlog(self) -> None:
        """The local prefill produced its first token (or ended): its tokens leave the node's backlog."""
        self.node.end_prefill(self.backlog_tokens)
        self.backlog_tokens = 0

    def release(self, reader: Reader, running: bool = True) -> None:
        """End the leg: its stream's reader and call while they still run, its backlog, the node's count."""
        if running:
            reader.cancel()
            self.call.cancel()
        self.settle_backlog()
        self.node.end()

    @property
    def node_id(self) -> str:
        return (self.reservation.node_id if self.reservation is not None else "") or self.node.node_id

async def read_decode_stream(call: grpc.aio.UnaryStreamCall, queue: asyncio.Queue[QueueItem],
                              ) -> grpc.aio.AioRpcError | None:
    """Move the decode stream's messages into ``queue``; return (and queue) the error that ended it, if any.

    Our own ``call.cancel()`` ends a read with ``asyncio.CancelledError``, never an ``AioRpcError``: a CANCELLED
    status read here came from the node (its shutdown grace ran out, say) and is its failure. (grpc's
    ``call.cancelled()`` cannot tell them apart: it is true for a CANCELLED status from either side.)"""
    try:
        while (msg := await call.read()) is not grpc.aio.EOF:
            queue.put_nowait(msg)
    except grpc.aio.AioRpcError as exc:
        queue.put_nowait(exc)
        return exc
    except asyncio.CancelledError:
        if cancelling():
            raise  # this reader was cancelled (our own cancels cancel the reader before the call)
        lost = cancelled_under_us()
        queue.put_nowait(lost)
        return lost
    queue.put_nowait(StreamEnd())
    return None


def cancelling() -> bool:
    """Whether the running task is being cancelled: a CancelledError it catches is its own (its client went,
    its deadline passed), not a gRPC call's that was cancelled under it."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def cancelled_under_us() -> grpc.aio.AioRpcError:
    """What a call ended by a local cancel that is not ours (its channel closed) stands for: the node's failure,
    never the client's cancel (a request is cancelled only by its client or its deadline)."""
    return grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                "the call was cancelled on the gateway's side (its channel closed)")


def start_reading(decode: DecodeLeg, request_id: str) -> tuple[asyncio.Queue[QueueItem], Reader]:
    queue: asyncio.Queue[QueueItem] = asyncio.Queue()
    return queue, asyncio.create_task(read_decode_stream(decode.call, queue), name=f"decode-{request_id}")

"""What the decode side knows of one transfer: its state while expected, and its result once landed.

Data types only, shared by the transfer table, the pairs and the receiver; this module imports no other
part of ``kv_transfer``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from tandem.v1 import common_pb2, kv_transfer_pb2


class PairLink(Protocol):
    """The connection that feeds a transfer, as the transfer table sees it (a ``ReceiverPair``)."""

    def post_abort(self, transfer_id: str, reason: str, trace_context: dict[str, str]) -> None:
        """Queue a TransferAbort to the sender. Thread-safe."""
        ...


@dataclass(frozen=True)
class TransferResult:
    """What a finished transfer brought: the prefill's first token and what moved."""

    first_token: int
    first_logprob: common_pb2.TokenLogprob | None
    prefill_cached_tokens: int
    bytes: int  # KV bytes that landed in this node's blocks
    seconds: float  # first chunk announced -> everything landed (0 when nothing had to move)
    trace_context: dict[str, str]


@dataclass(eq=False)
class ExpectedTransfer:
    """One expected transfer. Every field is guarded by its ``TransferTable``'s lock."""

    transfer_id: str
    allowed: frozenset[int]  # reserved blocks past the cached prefix: the only ones a chunk may write
    expected_at: float
    pair: PairLink | None = None  # bound by its first message: only that connection may feed it
    num_chunks: int = 0  # announced
    num_landed: int = 0
    bytes: int = 0
    inflight: int = 0  # chunk recvs into our blocks in flight right now
    first_chunk_at: float | None = None
    complete_seen: bool = False  # TransferComplete read from the stream (not yet necessarily landed)
    complete: kv_transfer_pb2.TransferComplete | None = None  # set once it landed
    error: str | None = None
    resolved: bool = False  # outcome final and nothing in flight: wait() may report
    resolved_at: float = 0.0
    waiters: list[asyncio.Future[None]] = field(default_factory=list)
    trace_context: dict[str, str] = field(default_factory=dict)

    def add_waiter(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        fut = loop.create_future()
        if self.resolved:
            fut.set_result(None)
        else:
            self.waiters.append(fut)
        return fut

    def result(self) -> TransferResult:
        """The result of a transfer that resolved without error."""
        complete = self.complete
        assert complete is not None and self.num_landed == self.num_chunks
        started = self.first_chunk_at or self.resolved_at
        return TransferResult(
            first_token=complete.first_token,
            first_logprob=complete.first_logprob if complete.HasField("first_logprob") else None,
            prefill_cached_tokens=complete.prefill_cached_tokens,
            bytes=self.bytes,
            seconds=self.resolved_at - started,
            trace_context=dict(self.trace_context),
        )

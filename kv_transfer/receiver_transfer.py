"""What the decode side knows of one transfer: its state while expected, and its result once landed."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.v1 import common_pb2, kv_transfer_pb2

if TYPE_CHECKING:
    from kv_transfer.receiver_pair import ReceiverPair


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
    """One expected transfer. Every field is guarded by ``KVReceiver._lock``."""

    transfer_id: str
    allowed: frozenset[int]  # reserved blocks past the cached prefix: the only ones a chunk may write
    expected_at: float
    pair: ReceiverPair | None = None  # bound by its first message: only that connection may feed it
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

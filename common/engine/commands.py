"""Typed messages from servicers to the engine thread (frozen dataclasses, dispatched in one place).

A servicer never reads the scheduler's containers and never sends code to the engine thread: it sends
one of these to ``AsyncEngine.call`` / ``AsyncEngine.submit`` and gets the command's typed reply back.
``EngineCore.handle`` is the one place that dispatches them. Each command names its reply type as the
generic parameter of ``EngineCommand``, so ``await engine.call(ReserveKV(...))`` is typed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from common.kv.kv_events import KVSnapshot

if TYPE_CHECKING:
    from common.kv.kv_events import KVEventBatch
    from common.sampling.params import SamplingParams

R = TypeVar("R")


class EngineCommand(Generic[R]):
    """Base of every command; ``R`` is what the engine thread answers."""


@dataclass(frozen=True, slots=True)
class ChunkTiming:
    """One prefill chunk of a traced request: the engine step that computed it (wall-clock ns, for spans)."""

    start_ns: int  # the step began (scheduling included)
    end_ns: int  # the step's forward finished: the chunk's KV is in the cache
    start_token: int
    num_tokens: int
    step_tokens: int  # tokens of every request batched in that step


class KVEventSink(Protocol):
    """Receives each drained batch of prefix-cache events on the engine thread; ``publish`` must not block.
    ``last_sequence``: the sequence number ``publish`` gave the last batch (read on the engine thread only)."""

    last_sequence: int

    def publish(self, batch: KVEventBatch) -> None: ...


class KVPushTarget(Protocol):
    """Where a prefill node's written blocks go (kv_transfer's TransferHandle); neither call blocks."""

    def push(self, src_block_ids: list[int], dst_block_ids: list[int]) -> None: ...

    def when_finished(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from any thread) once the transfer ended and no send reads the blocks."""


@dataclass(frozen=True)
class KVDestination:
    """Where a prefill node sends one request's KV: the decode-side block ids of the prompt's blocks from
    ``first_block`` on (those before it lie outside every sliding window at the decode node's first query: it
    holds none for them), and the first ``skip_blocks`` prompt blocks (``>= first_block``) are not sent (cached
    there, or outside the window)."""

    target: KVPushTarget
    block_ids: tuple[int, ...]
    skip_blocks: int
    first_block: int = 0

    def __post_init__(self) -> None:
        assert 0 <= self.first_block <= self.skip_blocks, f"first_block {self.first_block} > {self.skip_blocks}"


@dataclass(frozen=True)
class AddRequest(EngineCommand[None]):
    """Queue a request whose KV is computed on this node. Raises ``InvalidRequestError`` on bad input.

    On a prefill node ``destination`` says where its KV goes (pushed chunk by chunk as it is computed), and
    ``chunk_timings``, when given, receives one ``ChunkTiming`` per computed chunk (for tracing). With
    ``awaits_destination`` (and no ``destination``) the prompt is computed at once and its KV held until an
    ``AttachDestination`` says where it goes (the gateway's reservation comes later); the servicer aborts the
    request if none comes.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    destination: KVDestination | None = None
    chunk_timings: list[ChunkTiming] | None = None
    awaits_destination: bool = False

    def __post_init__(self) -> None:
        assert not (self.awaits_destination and self.destination is not None), "a destination is given or awaited"


@dataclass(frozen=True)
class AttachDestination(EngineCommand[bool]):
    """Prefill node: where the KV of a request added with ``awaits_destination`` goes. Every block already
    computed is pushed at once, later ones as they are. Answers False when the request is no longer on the node
    (aborted); raises ``InvalidRequestError`` naming the field when the destination cannot be served."""

    request_id: str
    destination: KVDestination


@dataclass(frozen=True)
class AbortRequest(EngineCommand[bool]):
    """Drop a request wherever it is and free its blocks. Answers whether it was known."""

    request_id: str


@dataclass(frozen=True)
class ReserveKV(EngineCommand[None]):
    """Decode node: a request whose prompt KV a remote prefill will push by ``transfer_id`` into blocks
    reserved for it, now if they are free and nobody queues before it, else once they are (it waits in the
    admission queue). Its blocks are announced once, on its stream: a ``RequestOutput`` with
    ``reserved_block_ids``; the transfer's end (reported by the connector) starts it. Raises
    ``InvalidRequestError`` on bad input, ``QueueFullError`` when the queue is at ``max_waiting``."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    transfer_id: str
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class PrepareKernels(EngineCommand[bool]):
    """Have oneDNN build its bf16 GEMM kernels for every row bucket a step can reach, and (``decode``) build or
    load the compiled CPU decode kernel, on the engine thread. Answers whether the decode kernel is in use
    (False on a node that does not decode)."""

    decode: bool = True


@dataclass(frozen=True)
class SetKVEventSink(EngineCommand[None]):
    """Record prefix-cache events and hand them to ``sink`` after every step and command (None: stop)."""

    sink: KVEventSink | None
    capacity: int = 4096


@dataclass(frozen=True)
class SnapshotKVBlocks(EngineCommand[KVSnapshot]):
    """Every block hash the prefix cache holds now, with the pool's digest and the sequence of the last event
    batch published before it (pending events are published first, so the snapshot is exact as of it)."""

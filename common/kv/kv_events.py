"""Prefix-cache events for external KV-aware routers (NVIDIA Dynamo's KV router, llm-d's EPP).

The block pool and the KV cache manager record what enters the prefix cache (``BlockStored``: a run of full
blocks committed by one request, with their chained hashes) and what leaves it (``BlockRemoved``: evicted or
uncached blocks; ``AllBlocksCleared``: a prefix-cache reset) into a ``KVEventLog``. The engine thread drains
the log after each step and command; the node's servicer fans the batches out to subscribers.

Recording is off unless a subscriber asked for it (the pool holds no log: no allocation per block). The
log is bounded: when a step records more than ``capacity`` events the oldest are dropped and counted, so
a burst can never grow memory without limit; the count travels with the next batch (``dropped``), which
tells a router its view is stale. Pure Python: no torch.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from common.kv.block_hash import BlockHash

DEFAULT_LOG_CAPACITY = 4096


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks that just became findable in the prefix cache, in prefix order.

    ``parent_block_hash`` is the hash of the block before the first one (None: the run starts the prompt);
    ``token_ids`` are the tokens of exactly these blocks (``len(block_hashes) * block_size`` of them).
    """

    event_id: int
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks no longer findable (evicted to reuse their memory, or uncached before an overwrite)."""

    event_id: int
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was forgotten."""

    event_id: int


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """What one drain of the log returns: events in order, and how many were dropped before them."""

    events: tuple[KVEvent, ...]
    dropped: int
    timestamp: float  # wall clock (s) of the drain


class KVEventLog:
    """A bounded, drop-oldest buffer of prefix-cache events; ``event_id`` counts every event ever recorded."""

    def __init__(self, capacity: int = DEFAULT_LOG_CAPACITY) -> None:
        assert capacity > 0, f"capacity must be positive, got {capacity}"
        self.capacity = capacity
        self._events: deque[KVEvent] = deque()
        self._next_id = 0
        self._dropped = 0

    def __len__(self) -> int:
        return len(self._events)

    def stored(self, block_hashes: list[BlockHash], parent: BlockHash | None, token_ids: tuple[int, ...],
               block_size: int) -> None:
        self._append(BlockStored(self._take_id(), tuple(block_hashes), parent, token_ids, block_size))

    def removed(self, block_hashes: list[BlockHash]) -> None:
        self._append(BlockRemoved(self._take_id(), tuple(block_hashes)))

    def cleared(self) -> None:
        # Everything before a clear is moot for a router that will see the clear.
        self._events.clear()
        self._append(AllBlocksCleared(self._take_id()))

    def drain(self) -> KVEventBatch | None:
        """Everything recorded since the last drain, or None when nothing was (and nothing dropped)."""
        if not self._events and not self._dropped:
            return None
        batch = KVEventBatch(tuple(self._events), self._dropped, time.time())
        self._events.clear()
        self._dropped = 0
        return batch

    def _take_id(self) -> int:
        event_id = self._next_id
        self._next_id += 1
        return event_id

    def _append(self, event: KVEvent) -> None:
        if len(self._events) >= self.capacity:
            self._events.popleft()
            self._dropped += 1
        self._events.append(event)

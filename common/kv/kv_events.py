"""Prefix-cache events for external KV-aware routers (NVIDIA Dynamo's KV router, llm-d's EPP).

The block pool and the KV cache manager record what enters the prefix cache (``BlockStored``: a run of full
blocks committed by one request, with their chained hashes) and what leaves it (``BlockRemoved``: evicted or
uncached blocks; ``AllBlocksCleared``: a prefix-cache reset) into a ``KVEventLog``. The engine thread drains
the log after each step and command; the node's servicer fans the batches out to subscribers.

Recording is off unless a subscriber asked for it (the pool holds no log: no allocation per block). The
log is bounded: when a step records more than ``capacity`` events the oldest are dropped and counted, so
a burst can never grow memory without limit; the count travels with the next batch (``dropped``), which
tells a router its view is stale. Pure Python: no torch.

``BlockDigest`` summarises a set of cached blocks in two integers, order-independently, so a subscriber can
check its view of a node against the node's own pool: the pool keeps it incrementally (one add or subtract
per block entering or leaving the cache) and every batch carries it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from common.kv.block_hash import BlockHash

DEFAULT_LOG_CAPACITY = 4096
DIGEST_MASK = (1 << 64) - 1


def digest_term(block_hash: BlockHash) -> int:
    """A block's part of a digest: its hash's first 8 bytes, little-endian (the hashes are uniform already)."""
    return int.from_bytes(block_hash[:8], "little")


@dataclass(frozen=True, slots=True)
class BlockDigest:
    """Order-independent digest of a set of block hashes: the sum of their terms mod 2^64, and how many."""

    sum: int = 0
    count: int = 0

    @staticmethod
    def of(block_hashes: Iterable[BlockHash]) -> BlockDigest:
        total = count = 0
        for block_hash in block_hashes:
            total += digest_term(block_hash)
            count += 1
        return BlockDigest(total & DIGEST_MASK, count)

    def drift(self, other: BlockDigest) -> int:
        """How many blocks two sets differ by, as far as the digests tell: the count difference, at least 1
        when the digests differ."""
        if self == other:
            return 0
        return max(1, abs(self.count - other.count))


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
    digest: BlockDigest = BlockDigest()  # of the pool's cached blocks once these events are applied


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """Every block the prefix cache holds now (any order) and their digest; ``sequence``: the last event batch
    published before it (the snapshot is exact as of that batch)."""

    block_hashes: tuple[BlockHash, ...]
    digest: BlockDigest
    sequence: int


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

    def drain(self, digest: BlockDigest = BlockDigest()) -> KVEventBatch | None:
        """Everything recorded since the last drain, or None when nothing was (and nothing dropped);
        ``digest``: the pool's, stamped on the batch."""
        if not self._events and not self._dropped:
            return None
        batch = KVEventBatch(tuple(self._events), self._dropped, time.time(), digest)
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

"""The physical KV blocks of one engine: ref counts, an LRU free queue and the prefix-cache hash map.

Modelled on vLLM v1's ``BlockPool`` and ``FreeKVCacheBlockQueue``. A block is in exactly one of two states:

* referenced (``ref_cnt > 0``): owned by one or more request block tables, never evicted;
* free (``ref_cnt == 0``): in the free queue. A free block may still carry a block hash, in which case it
  is a cached block that a later request can revive with ``touch``; it is evicted (its hash dropped) only
  when ``get_new_blocks`` pops it from the head of the queue to reuse its memory.

The free queue is ordered by eviction priority, head first. Freed blocks join the tail, so the head holds
the least recently used ones. Pure Python: no torch, the tensors live in the engines.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from common.kv.block_hash import BlockHash
from common.kv.kv_events import DIGEST_MASK, BlockDigest, KVEventLog, digest_term


@dataclass(slots=True)
class KVBlock:
    """Bookkeeping for one physical block; the KV tensors for ``block_id`` live in the engine."""

    block_id: int
    ref_cnt: int = 0
    # Set only once the block is full and its KV has been written; None for blocks not in the hash map.
    block_hash: BlockHash | None = None


class BlockPool:
    """Allocates, ref-counts and caches the ``num_blocks`` KV blocks (ids ``0 .. num_blocks - 1``)."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0, f"num_blocks must be positive, got {num_blocks}"
        assert block_size > 0, f"block_size must be positive, got {block_size}"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        # OrderedDict as a doubly linked list: O(1) pop from the head, append to the tail and removal from
        # the middle (a cache hit on a free cached block). Values are unused.
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self._digest_sum = 0  # BlockDigest of _cached's keys, kept as blocks enter and leave it
        # Prefix-cache events for external routers; None (the default) records nothing and allocates nothing.
        self.events: KVEventLog | None = None
        # Called with (block id, hash) for each cached block about to be reused, while its KV is still there:
        # the offload tier keeps it (common/kv/offload.py). None: evicted blocks are simply forgotten.
        self.on_evict: Callable[[int, BlockHash], None] | None = None
        # Called with (block id, hash) for each cached block whose last reference has just gone (it joins the free
        # queue with its KV intact): a write-behind tier starts copying it. None: nothing is told.
        self.on_free: Callable[[int, BlockHash], None] | None = None
        # The most blocks referenced at once since the pool was made (the ``peak_used_blocks`` stat).
        self.peak_used_blocks = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``get_new_blocks`` can hand out, including evictable cached ones."""
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one request."""
        return self.num_blocks - len(self._free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by hash, referenced or not."""
        return len(self._cached)

    @property
    def digest(self) -> BlockDigest:
        """The digest of every cached block's hash (what a KV-event subscriber's view of this pool should be)."""
        return BlockDigest(self._digest_sum, len(self._cached))

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash findable in the prefix cache (a subscriber's snapshot), in no particular order."""
        return list(self._cached)

    def ref_count(self, block_id: int) -> int:
        """Number of block-table references to ``block_id``; 0 means it is in the free queue."""
        return self._blocks[block_id].ref_cnt

    def get_block_hash(self, block_id: int) -> BlockHash | None:
        """The hash ``block_id`` is cached under, or None if it is not in the hash map."""
        return self._blocks[block_id].block_hash

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """Return the block cached under ``block_hash``, or None on a miss. Does not change ref counts."""
        return self._cached.get(block_hash)

    # ------------------------------------------------------------------ mutations

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Pop ``num_blocks`` blocks from the head of the free queue with ref count 1, evicting their hashes."""
        assert 0 <= num_blocks <= len(self._free_queue), (
            f"asked for {num_blocks} blocks with {len(self._free_queue)} free"
        )
        block_ids: list[int] = []
        evicted: list[BlockHash] | None = [] if self.events is not None else None
        for _ in range(num_blocks):
            block_id, _unused = self._free_queue.popitem(last=False)
            block = self._blocks[block_id]
            assert block.ref_cnt == 0, f"free block {block_id} has ref count {block.ref_cnt}"
            if block.block_hash is not None:
                # Eviction: the memory is about to be overwritten, so the hash must stop pointing at it.
                if self.on_evict is not None:
                    self.on_evict(block_id, block.block_hash)
                if evicted is not None:
                    evicted.append(block.block_hash)
                del self._cached[block.block_hash]
                self._digest_sum = (self._digest_sum - digest_term(block.block_hash)) & DIGEST_MASK
                block.block_hash = None
            block.ref_cnt = 1
            block_ids.append(block_id)
        if evicted and self.events is not None:
            self.events.removed(evicted)
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block; a free (cached) block leaves the free queue, so it can't be evicted."""
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.ref_cnt == 0:
                del self._free_queue[block_id]
            block.ref_cnt += 1
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, appending those that reach zero to the tail of the free queue.

        Pass blocks in the order they should be evicted (first = evicted first): a request frees its table
        in reverse, so the tail of a prompt is evicted before its more widely shared head.
        """
        for block_id in block_ids:
            block = self._blocks[block_id]
            assert block.ref_cnt > 0, f"double free of block {block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue[block_id] = None
                if self.on_free is not None and block.block_hash is not None:
                    self.on_free(block_id, block.block_hash)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a full, written block under ``block_hash``; return whether it was registered.

        If another block is already cached under the same hash the existing mapping wins (it may be shared
        by other requests already) and ``block_id`` stays uncached: one hash names at most one block.
        """
        block = self._blocks[block_id]
        assert block.ref_cnt > 0, f"caching unreferenced block {block_id}"
        assert block.block_hash is None, f"block {block_id} is already cached"
        if not self.enable_prefix_caching or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block_id
        self._digest_sum = (self._digest_sum + digest_term(block_hash)) & DIGEST_MASK
        return True

    def uncache_block(self, block_id: int) -> None:
        """Remove ``block_id`` from the hash map (its contents are about to change); no-op if not cached."""
        block = self._blocks[block_id]
        if block.block_hash is not None:
            if self.on_evict is not None:  # as an eviction: the tier keeps (or finishes copying) the KV first
                self.on_evict(block_id, block.block_hash)
            if self.events is not None:
                self.events.removed([block.block_hash])
            del self._cached[block.block_hash]
            self._digest_sum = (self._digest_sum - digest_term(block.block_hash)) & DIGEST_MASK
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (e.g. after a weight update). Refused (False) while any block is in use."""
        if self.num_used_blocks > 0:
            return False
        for block in self._blocks:
            block.block_hash = None
        self._cached.clear()
        self._digest_sum = 0
        if self.events is not None:
            self.events.cleared()
        return True

    # ------------------------------------------------------------------ invariants

    def check_integrity(self) -> None:
        """Assert the pool's invariants; tests call this after every operation."""
        assert len(self._free_queue) + sum(b.ref_cnt > 0 for b in self._blocks) == self.num_blocks
        for block in self._blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref count {block.ref_cnt}"
            in_queue = block.block_id in self._free_queue
            assert in_queue == (block.ref_cnt == 0), (
                f"block {block.block_id}: ref count {block.ref_cnt} but in free queue = {in_queue}"
            )
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) == block.block_id, (
                    f"block {block.block_id} carries a hash the map doesn't point back to it"
                )
        for block_hash, block_id in self._cached.items():
            assert self._blocks[block_id].block_hash == block_hash, f"hash map points at block {block_id}"
        assert self.digest == BlockDigest.of(self._cached), "the incremental digest drifted from the hash map"
        if not self.enable_prefix_caching:
            assert not self._cached, "prefix caching is disabled but blocks are cached"

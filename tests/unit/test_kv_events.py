"""Exact prefix-cache event sequences from KVCacheManager: stored on commit, removed on eviction, cleared."""

from __future__ import annotations

import asyncio

from common.kv.block_hash import hash_block, hash_prompt_blocks
from common.kv.kv_cache_manager import KVCacheManager
from common.kv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog
from common.serving.kv_event_queue import KvEventQueue
from tandem.v1 import common_pb2

BS = 4
A = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]  # 2 full blocks + 2 tokens
B = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35]  # 4 full blocks
HA = hash_prompt_blocks(A, BS)
HB = hash_prompt_blocks(B, BS)


def make(num_blocks: int = 4, capacity: int = 64) -> KVCacheManager:
    kv = KVCacheManager(num_blocks, block_size=BS)
    kv.enable_events(capacity)
    return kv


def events(kv: KVCacheManager) -> list[object]:
    batch = kv.drain_events()
    return [] if batch is None else list(batch.events)


def test_commit_stores_the_full_blocks_with_chained_hashes() -> None:
    kv = make()
    kv.allocate("a", A)
    assert events(kv) == []  # allocation alone caches nothing: the KV is not written yet
    kv.commit("a", A)
    assert events(kv) == [BlockStored(0, (HA[0], HA[1]), None, tuple(A[:8]), BS)]
    # Two decode tokens fill block 2: one more stored event, chained to the last committed block.
    kv.append_slots("a", 2)
    kv.commit("a", [*A, 50, 51])
    assert events(kv) == [BlockStored(1, (hash_block(HA[1], [18, 19, 50, 51]),), HA[1], (18, 19, 50, 51), BS)]
    kv.commit("a", [*A, 50, 51])  # nothing new
    assert kv.drain_events() is None
    kv.check_integrity()


def test_eviction_removes_hashes_in_eviction_order() -> None:
    kv = make()
    kv.allocate("a", A)
    kv.commit("a", A)
    kv.free("a")  # blocks 2, 1, 0 join the free queue tail-first: [3, 2, 1, 0]
    assert [type(e) for e in events(kv)] == [BlockStored]
    kv.allocate("b", B)  # takes all four blocks: evicts block 1 (HA[1]) then block 0 (HA[0])
    assert events(kv) == [BlockRemoved(1, (HA[1], HA[0]))]
    kv.commit("b", B)
    assert events(kv) == [BlockStored(2, tuple(HB), None, tuple(B), BS)]
    kv.check_integrity()


def test_a_prefix_hit_stores_only_the_new_blocks() -> None:
    kv = make(num_blocks=8)
    kv.allocate("a", A)
    kv.commit("a", A)
    kv.drain_events()
    prompt = [*A[:8], 60, 61, 62, 63, 64]
    assert kv.allocate("b", prompt).num_cached_tokens == 8
    kv.commit("b", prompt)
    assert events(kv) == [BlockStored(1, (hash_block(HA[1], [60, 61, 62, 63]),), HA[1], (60, 61, 62, 63), BS)]


def test_a_duplicate_block_cached_first_elsewhere_is_not_stored_again() -> None:
    kv = make(num_blocks=8)
    kv.allocate("a", A)
    kv.allocate("b", A)  # no hit yet: a's KV is not committed
    kv.commit("a", A)
    kv.drain_events()
    kv.commit("b", A)  # same hashes, other blocks: the existing mapping wins, routers already know them
    assert kv.drain_events() is None
    kv.check_integrity()


def test_truncate_uncaches_the_new_partial_block() -> None:
    kv = make(num_blocks=8)
    kv.allocate("a", A[:8])
    kv.commit("a", A[:8])
    kv.drain_events()
    kv.truncate("a", 6)  # block 1 becomes partial again and will be overwritten
    assert events(kv) == [BlockRemoved(1, (HA[1],))]
    kv.check_integrity()


def test_reset_clears_and_drops_what_it_supersedes() -> None:
    kv = make()
    kv.allocate("a", A)
    kv.commit("a", A)
    kv.free("a")
    assert kv.pool.reset_prefix_cache()
    assert events(kv) == [AllBlocksCleared(1)]


def test_overflow_drops_the_oldest_and_counts_them() -> None:
    log = KVEventLog(capacity=2)
    for i in range(5):
        log.removed([bytes([i]) * 16])
    batch = log.drain()
    assert batch is not None
    assert batch.dropped == 3
    assert [e.event_id for e in batch.events] == [3, 4]
    assert log.drain() is None


def test_disabled_records_nothing() -> None:
    kv = KVCacheManager(4, block_size=BS)
    assert kv.pool.events is None
    kv.allocate("a", A)
    kv.commit("a", A)
    assert kv.drain_events() is None
    kv.enable_events()
    kv.disable_events()
    kv.free("a")
    kv.allocate("b", B)
    assert kv.drain_events() is None


def test_a_slow_subscriber_loses_the_oldest_batches_counted_in_dropped() -> None:
    async def main() -> None:
        q = KvEventQueue(max_batches=2)
        for i in range(5):  # put never waits, whatever the reader does
            batch = common_pb2.KvEventBatch(node_id="n", dropped=1 if i == 0 else 0)
            batch.events.add(event_id=2 * i).removed.block_hashes.append(b"a" * 16)
            batch.events.add(event_id=2 * i + 1).removed.block_hashes.append(b"b" * 16)
            q.put(batch)
        first = await q.get()
        # Batches 0, 1 and 2 went: 6 events, plus the 1 that batch 0 had already lost upstream.
        assert ([e.event_id for e in first.events], first.dropped) == ([6, 7], 7)
        second = await q.get()
        assert ([e.event_id for e in second.events], second.dropped) == ([8, 9], 0)
        assert len(q) == 0

    asyncio.run(asyncio.wait_for(main(), 5))


def test_the_publisher_replays_from_its_bounded_contiguous_history() -> None:
    """Sequences, the history a resume can be served from, and when a snapshot is needed instead."""
    from common.engine.kv_event_publisher import KVEventPublisher
    from common.kv.kv_events import BlockDigest, KVEventBatch

    publisher = KVEventPublisher(None, "decode-0", "decode", history_batches=3)  # type: ignore[arg-type]
    inc = publisher.incarnation

    def fan_out(sequence: int, dropped: int = 0) -> None:
        batch = KVEventBatch((BlockStored(sequence, (HA[0],), None, tuple(A[:BS]), BS),), dropped, 0.0,
                             BlockDigest.of(HA[:1]))
        publisher._fan_out(batch, sequence)

    def resume(seq: int, incarnation: str = inc, snapshot: bool = False) -> list[int] | None:
        out = publisher.replay(common_pb2.SubscribeKvEventsRequest(incarnation=incarnation, from_sequence=seq,
                                                                   snapshot=snapshot))
        return None if out is None else [b.sequence for b in out]

    assert resume(1) is None  # nothing published yet: a snapshot
    for seq in range(1, 6):
        fan_out(seq)
    assert resume(3) == [3, 4, 5]
    assert resume(5) == [5]
    assert resume(6) == []  # up to date: live batches only
    assert resume(2) is None  # older than the history (3 batches): a snapshot
    assert resume(7) is None  # ahead of the node: a snapshot
    assert resume(4, incarnation="other") is None  # another process: a snapshot
    assert resume(4, snapshot=True) is None
    fan_out(6, dropped=2)  # the engine's log lost events in batch 6: no replay may cross it
    assert resume(5) is None and resume(6) is None
    assert resume(7) == []
    fan_out(7)
    assert resume(7) == [7]

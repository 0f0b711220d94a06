"""The gateway's prefix index (gateway/kv_index.py) and the node's digest: gap detection, replay and snapshot
requests, restarts, dropped events and drift, with exact expectations. Pure logic: batches built by hand."""

from __future__ import annotations

from collections.abc import Sequence

from common.kv.block_hash import hash_prompt_blocks
from common.kv.block_pool import BlockPool
from common.kv.kv_events import BlockDigest, digest_term
from gateway.kv_index import KvIndex, Resync
from tandem.v1 import common_pb2

H = hash_prompt_blocks(list(range(40)), 4)  # 10 chained hashes
T = "10.0.0.1:7000"


def digest(hashes: list[bytes]) -> common_pb2.KvDigest:
    d = BlockDigest.of(hashes)
    return common_pb2.KvDigest(sum=d.sum, count=d.count)


def batch(seq: int, stored: Sequence[bytes] = (), removed: Sequence[bytes] = (), *, inc: str = "a", dropped: int = 0,
          cleared: bool = False, after: list[bytes] | None = None) -> common_pb2.KvEventBatch:
    """A node's batch; ``after``: the node's cached set once it is applied (for its digest)."""
    msg = common_pb2.KvEventBatch(node_id="decode-0", incarnation=inc, sequence=seq, dropped=dropped)
    if cleared:
        msg.events.add().cleared.SetInParent()
    if stored:
        msg.events.add().stored.block_hashes.extend(stored)
    if removed:
        msg.events.add().removed.block_hashes.extend(removed)
    if after is not None:
        msg.digest.CopyFrom(digest(after))
    return msg


def snapshot(seq: int, hashes: list[bytes], inc: str = "a") -> common_pb2.KvEventBatch:
    msg = common_pb2.KvEventBatch(node_id="decode-0", incarnation=inc, sequence=seq, digest=digest(hashes))
    msg.snapshot.block_hashes.extend(hashes)
    return msg


def test_digest_is_order_independent_and_counts() -> None:
    assert BlockDigest.of(H[:3]) == BlockDigest.of([H[2], H[0], H[1]])
    assert BlockDigest.of(H[:3]).count == 3
    assert BlockDigest.of(H[:3]).sum == sum(digest_term(h) for h in H[:3]) % 2**64
    assert BlockDigest.of([]) == BlockDigest()
    assert BlockDigest.of(H[:3]).drift(BlockDigest.of(H[:3])) == 0
    assert BlockDigest.of(H[:3]).drift(BlockDigest.of(H[:5])) == 2
    assert BlockDigest.of(H[:3]).drift(BlockDigest.of([H[0], H[1], H[3]])) == 1  # same count, other blocks


def test_the_pool_keeps_its_digest_as_blocks_are_cached_evicted_and_reset() -> None:
    pool = BlockPool(num_blocks=3, block_size=4)
    ids = pool.get_new_blocks(3)
    for block_id, h in zip(ids, H[:3], strict=True):
        assert pool.cache_block(block_id, h)
    assert pool.digest == BlockDigest.of(H[:3])
    assert sorted(pool.cached_hashes()) == sorted(H[:3])
    pool.uncache_block(ids[1])
    assert pool.digest == BlockDigest.of([H[0], H[2]])
    pool.free_blocks(ids)
    pool.get_new_blocks(1)  # evicts the least recently freed cached block: ids[0]
    assert pool.digest == BlockDigest.of([H[2]])
    pool.check_integrity()
    pool.free_blocks([ids[0]])
    assert pool.reset_prefix_cache()
    assert pool.digest == BlockDigest()


def test_a_fresh_view_asks_for_a_snapshot_then_resumes_after_it() -> None:
    index = KvIndex()
    assert index.resume_request(T) == common_pb2.SubscribeKvEventsRequest(snapshot=True)
    assert index.apply(T, snapshot(5, H[:2])) is None
    assert index.hashes(T) == set(H[:2])
    assert index.resume_request(T, 8) == common_pb2.SubscribeKvEventsRequest(max_queued_batches=8, incarnation="a",
                                                                             from_sequence=6)
    assert index.apply(T, batch(6, [H[2]], [H[0]], after=H[1:3])) is None
    assert index.hashes(T) == {H[1], H[2]}
    assert index.drift(T) == 0
    assert index.matched_blocks(H[:4]) == {}  # H[0] is gone: no leading block
    assert index.apply(T, batch(7, [H[0]], after=H[:3])) is None
    assert index.matched_blocks(H[:4]) == {T: 3}


def test_a_skipped_sequence_asks_for_a_replay_from_the_first_missing_one() -> None:
    index = KvIndex()
    index.apply(T, snapshot(3, H[:1]))
    assert index.apply(T, batch(4, [H[1]], after=H[:2])) is None
    assert index.apply(T, batch(6, [H[3]], after=H[:4])) is Resync.GAP
    assert index.hashes(T) == set(H[:2])  # the batch after the gap is not applied
    assert index.resume_request(T) == common_pb2.SubscribeKvEventsRequest(incarnation="a", from_sequence=5)
    # The replay, then a live batch the replay already covered (ignored), then the next one.
    assert index.apply(T, batch(5, [H[2]], after=H[:3])) is None
    assert index.apply(T, batch(6, [H[3]], after=H[:4])) is None
    assert index.apply(T, batch(6, [H[3]], after=H[:4])) is None
    assert index.apply(T, batch(7, [], [H[3]], after=H[:3])) is None
    assert index.hashes(T) == set(H[:3])
    assert index.drift(T) == 0


def test_a_new_incarnation_drops_the_nodes_entries_and_asks_for_a_snapshot() -> None:
    index = KvIndex()
    index.apply(T, snapshot(9, H[:4]))
    assert index.apply(T, batch(1, [H[5]], inc="b", after=[H[5]])) is Resync.RESTART
    assert index.hashes(T) == set()  # nothing of the old process routes
    assert index.matched_blocks(H) == {}
    assert index.resume_request(T) == common_pb2.SubscribeKvEventsRequest(snapshot=True)
    assert index.apply(T, snapshot(1, [H[5]], inc="b")) is None
    assert index.hashes(T) == {H[5]}
    assert index.apply(T, batch(2, [H[6]], inc="b", after=H[5:7])) is None


def test_events_dropped_by_the_node_ask_for_a_snapshot() -> None:
    index = KvIndex()
    index.apply(T, snapshot(1, []))
    assert index.apply(T, batch(2, [H[1]], dropped=3, after=H[:2])) is Resync.DROPPED
    assert index.resume_request(T) == common_pb2.SubscribeKvEventsRequest(snapshot=True)
    assert index.apply(T, batch(3, [H[2]], after=H[:3])) is None  # live batches before the snapshot: ignored
    assert index.hashes(T) == set()
    assert index.apply(T, snapshot(3, H[:3])) is None
    assert index.hashes(T) == set(H[:3])


def test_drift_is_reported_and_healed_by_a_snapshot() -> None:
    index = KvIndex()
    index.apply(T, snapshot(1, H[:2]))
    # The node says it holds 4 blocks; the events only announced one more: drift of 1 block.
    assert index.apply(T, batch(2, [H[2]], after=H[:4])) is Resync.DRIFT
    assert index.drift(T) == 1
    assert index.resume_request(T).snapshot
    assert index.apply(T, snapshot(2, H[:4])) is None
    assert index.drift(T) == 0
    assert index.hashes(T) == set(H[:4])


def test_a_clear_empties_the_view_and_forget_removes_the_node() -> None:
    index = KvIndex()
    index.apply(T, snapshot(1, H[:3]))
    assert index.apply(T, batch(2, [H[7]], cleared=True, after=[H[7]])) is None
    assert index.hashes(T) == {H[7]}
    index.forget(T)
    assert T not in index
    assert index.hashes(T) == set()
    assert index.targets() == []

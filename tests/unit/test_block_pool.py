"""Exact expectations for the chained block hash and the block pool (which ids, in which order)."""

from __future__ import annotations

import pytest

from common.kv.block_hash import DIGEST_SIZE, hash_block, hash_prompt_blocks
from common.kv.block_pool import BlockPool

H1 = hash_block(None, [1, 2, 3, 4])
H2 = hash_block(None, [5, 6, 7, 8])


# ---------------------------------------------------------------------- block hash


def test_hash_is_pinned_across_runs() -> None:
    # Golden digests: the gateway and every engine must agree on these bytes, in any process or Python run.
    assert hash_block(None, [1, 2, 3, 4]).hex() == "0f2d7d44ddd75600b2666fa2afceb44a"
    assert hash_block(None, [1, 2, 3, 4], b"tenant").hex() == "08fc273b1b78da04ec674c72ecf5dbda"
    assert len(H1) == DIGEST_SIZE


def test_hash_depends_on_parent_tokens_and_salt() -> None:
    assert hash_block(H1, [5, 6, 7, 8]) != H2
    assert hash_block(None, [1, 2, 3, 5]) != H1
    assert hash_block(None, [1, 2, 3, 4], b"") != H1
    assert hash_block(None, [1, 2, 3, 4], b"a") != hash_block(None, [1, 2, 3, 4], b"b")
    # Token ids are int64, not bytes: 256 must not alias (1, 0).
    assert hash_block(None, [256]) != hash_block(None, [1, 0])
    assert hash_block(None, (1, 2, 3, 4)) == H1


def test_hash_rejects_token_ids_outside_int64() -> None:
    with pytest.raises(OverflowError):
        hash_block(None, [2**63])


def test_hash_prompt_blocks_chains_full_blocks_only() -> None:
    tokens = list(range(10))
    first = hash_block(None, [0, 1, 2, 3], b"s")
    second = hash_block(first, [4, 5, 6, 7], b"s")
    assert hash_prompt_blocks(tokens, 4, b"s") == [first, second]
    assert hash_prompt_blocks(tokens[:8], 4, b"s") == [first, second]
    assert hash_prompt_blocks(tokens[:3], 4) == []
    assert hash_prompt_blocks([], 4) == []


# ---------------------------------------------------------------------- block pool


def test_fresh_pool_hands_out_ids_in_order() -> None:
    pool = BlockPool(num_blocks=6, block_size=4)
    assert pool.get_new_blocks(3) == [0, 1, 2]
    assert pool.get_new_blocks(0) == []
    assert pool.get_new_blocks(1) == [3]
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.usage) == (2, 4, 4 / 6)
    assert [pool.ref_count(b) for b in range(6)] == [1, 1, 1, 1, 0, 0]
    pool.check_integrity()


def test_freed_blocks_join_the_tail_in_the_order_given() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    assert pool.get_new_blocks(2) == [0, 1]
    pool.free_blocks([1, 0])
    pool.check_integrity()
    assert pool.get_new_blocks(4) == [2, 3, 1, 0]


def test_shared_block_is_freed_only_by_its_last_reference() -> None:
    pool = BlockPool(num_blocks=2, block_size=4)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    pool.free_blocks([block])
    assert (pool.ref_count(block), pool.num_free_blocks) == (1, 1)
    pool.free_blocks([block])
    assert (pool.ref_count(block), pool.num_free_blocks) == (0, 2)
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([block])


def test_cached_free_block_is_found_revived_and_not_evicted() -> None:
    pool = BlockPool(num_blocks=3, block_size=4)
    assert pool.get_new_blocks(1) == [0]
    assert pool.cache_block(0, H1)
    pool.free_blocks([0])
    # Free but still cached: findable until something evicts it.
    assert pool.get_cached_block(H1) == 0
    pool.touch([0])
    assert (pool.ref_count(0), pool.num_free_blocks) == (1, 2)
    assert pool.get_new_blocks(2) == [1, 2]
    assert pool.get_cached_block(H1) == 0
    pool.check_integrity()


def test_allocation_evicts_the_least_recently_freed_cached_block() -> None:
    pool = BlockPool(num_blocks=3, block_size=4)
    assert pool.get_new_blocks(3) == [0, 1, 2]
    pool.cache_block(0, H1)
    pool.cache_block(1, H2)
    pool.free_blocks([1, 0, 2])
    assert pool.get_new_blocks(1) == [1]
    assert (pool.get_cached_block(H2), pool.get_block_hash(1)) == (None, None)
    assert pool.get_cached_block(H1) == 0
    assert pool.get_new_blocks(1) == [0]
    assert pool.get_cached_block(H1) is None
    assert pool.num_cached_blocks == 0
    pool.check_integrity()


def test_referenced_cached_blocks_are_never_evicted() -> None:
    pool = BlockPool(num_blocks=3, block_size=4)
    assert pool.get_new_blocks(1) == [0]
    pool.cache_block(0, H1)
    assert pool.get_new_blocks(2) == [1, 2]
    assert pool.num_free_blocks == 0
    with pytest.raises(AssertionError):
        pool.get_new_blocks(1)
    assert pool.get_cached_block(H1) == 0


def test_duplicate_hash_keeps_the_existing_block() -> None:
    pool = BlockPool(num_blocks=2, block_size=4)
    assert pool.get_new_blocks(2) == [0, 1]
    assert pool.cache_block(0, H1)
    assert not pool.cache_block(1, H1)
    assert (pool.get_cached_block(H1), pool.get_block_hash(1)) == (0, None)
    pool.uncache_block(0)
    pool.uncache_block(0)
    assert pool.get_cached_block(H1) is None
    pool.check_integrity()


def test_disabled_prefix_caching_caches_nothing() -> None:
    pool = BlockPool(num_blocks=2, block_size=4, enable_prefix_caching=False)
    assert pool.get_new_blocks(1) == [0]
    assert not pool.cache_block(0, H1)
    assert pool.get_cached_block(H1) is None
    pool.check_integrity()


def test_reset_prefix_cache_only_when_idle() -> None:
    pool = BlockPool(num_blocks=2, block_size=4)
    pool.get_new_blocks(1)
    pool.cache_block(0, H1)
    assert not pool.reset_prefix_cache()
    pool.free_blocks([0])
    assert pool.reset_prefix_cache()
    assert (pool.get_cached_block(H1), pool.num_free_blocks) == (None, 2)
    pool.check_integrity()

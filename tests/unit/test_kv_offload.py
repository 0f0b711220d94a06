"""The KV offload tier (common/kv/offload.py) with exact expectations: its LRU index, evicted blocks saved with
their KV while it is still there, restored on a prefix hit past the pool's, block by block equal; and through
the offline engine, greedy output unchanged with blocks coming back from host memory and from a file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from common.kv.block_hash import hash_prompt_blocks
from common.kv.kv_cache import KVCache, KVCacheSpec
from common.kv.kv_cache_manager import KVCacheManager
from common.kv.offload import OffloadIndex, OffloadStore, OffloadTier

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype_name="float32")


def test_index_is_an_lru_over_its_slots() -> None:
    index = OffloadIndex(2)
    a, b, c = (bytes([i]) * 8 for i in range(3))
    assert (index.reserve(a), index.reserve(b)) == (0, 1)
    assert index.reserve(a) == 0 and index.saves == 2  # held: the same slot, no second save
    assert index.slot_of(a) == 0  # a is now the most recently used
    assert index.reserve(c) == 1 and b not in index and index.evictions == 1  # b was the least recent
    assert index.slot_of(b) is None and index.hits == 1
    index.pinned = frozenset({a, c})  # a restore of a and c in progress: nothing may displace them
    assert index.reserve(b) is None and index.dropped == 1 and a in index and c in index
    index.pinned = frozenset({c})
    assert index.reserve(b) == 0 and a not in index  # a, now unpinned, was the least recent
    index.check_integrity()


def _write(cache: KVCache, manager: KVCacheManager, request_id: str, tokens: list[int]) -> list[int]:
    """Allocate ``tokens``, fill their blocks with a value per token (as a forward would), commit, return blocks."""
    alloc = manager.allocate(request_id, tokens)
    assert alloc is not None
    for i in range(alloc.num_cached_tokens, len(tokens)):
        block, slot = alloc.block_ids[i // SPEC.block_size], i % SPEC.block_size
        cache.data[block, :, :, slot] = float(tokens[i])
    manager.commit(request_id, tokens)
    return alloc.block_ids


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_evicted_blocks_come_back_from_the_tier(kind: str, tmp_path: Path) -> None:
    cache = KVCache(SPEC, num_blocks=4)
    manager = KVCacheManager(4, SPEC.block_size)
    tier = OffloadTier(OffloadStore(cache, 8, tmp_path / "tier.bin" if kind == "disk" else None), OffloadIndex(8))
    manager.set_offload(tier)
    a = list(range(100, 113))  # 3 full blocks + 1 token
    blocks_a = _write(cache, manager, "a", a)
    kv_a = cache.data[blocks_a[:3]].clone()
    manager.free("a")
    b = list(range(200, 213))
    _write(cache, manager, "b", b)  # every block of the pool: a's three cached ones evicted into the tier
    assert len(tier.index) == 3 and all(tier.holds(h) for h in hash_prompt_blocks(a, 4))
    manager.free("b")
    again = manager.allocate("a2", a)
    assert again is not None and again.num_cached_tokens == 12 and manager.offload_hits == 12
    assert torch.equal(cache.data[again.block_ids[:3]], kv_a)  # the same KV, block by block
    manager.check_integrity()
    tier.index.check_integrity()
    if kind == "disk":
        assert (tmp_path / "tier.bin").stat().st_size == 8 * tier.store.bytes_per_slot
        tier.close()
        assert not (tmp_path / "tier.bin").exists()


def test_a_restored_chain_continues_in_the_pool_and_stops_at_a_miss(tmp_path: Path) -> None:
    cache = KVCache(SPEC, num_blocks=6)
    manager = KVCacheManager(6, SPEC.block_size)
    tier = OffloadTier(OffloadStore(cache, 2, None), OffloadIndex(2))  # room for two blocks only
    manager.set_offload(tier)
    a = list(range(100, 117))  # 4 full blocks + 1 token
    _write(cache, manager, "a", a)
    manager.free("a")
    _write(cache, manager, "b", list(range(300, 317)))  # 5 blocks: evicts a's 4 cached, the tier keeps the last 2
    manager.free("b")
    # a freed its table tail first, so b evicted a's blocks 3, 2, 1 in that order; the tier kept the last two
    hashes = hash_prompt_blocks(a, 4)
    assert [tier.holds(h) for h in hashes] == [False, True, True, False]
    assert manager.pool.get_cached_block(hashes[0]) is not None  # block 0 is still in the pool
    again = manager.allocate("a2", a)  # the pool's block 0, the tier's 1 and 2, then a miss: block 3 recomputed
    assert again is not None and again.num_cached_tokens == 12 and manager.offload_hits == 8
    manager.check_integrity()


def test_restored_blocks_are_announced_as_stored_events(tmp_path: Path) -> None:
    """A router's view (the events applied in order) equals the pool's cached set and digest after a restore."""
    from common.kv.kv_events import BlockDigest, BlockRemoved, BlockStored

    cache = KVCache(SPEC, num_blocks=6)
    manager = KVCacheManager(6, SPEC.block_size)
    manager.set_offload(OffloadTier(OffloadStore(cache, 2, None), OffloadIndex(2)))
    manager.enable_events()
    a = list(range(100, 117))
    _write(cache, manager, "a", a)
    manager.free("a")
    _write(cache, manager, "b", list(range(300, 317)))
    manager.free("b")
    manager.drain_events()
    view = set(manager.pool.cached_hashes())
    hashes = hash_prompt_blocks(a, 4)
    assert manager.allocate("a2", a) is not None  # the tier's blocks 1 and 2 come back after the pool's block 0
    batch = manager.drain_events()
    assert batch is not None
    restored = [e for e in batch.events if isinstance(e, BlockStored)]
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in restored] == [
        ((hashes[1], hashes[2]), hashes[0], tuple(a[4:12]))]
    for event in batch.events:
        if isinstance(event, BlockStored):
            view.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            view.difference_update(event.block_hashes)
    assert view == set(manager.pool.cached_hashes())
    assert BlockDigest.of(view) == manager.pool.digest == batch.digest


def test_offload_needs_prefix_caching() -> None:
    from common.config.engine_config import CacheConfig

    with pytest.raises(ValueError, match=r"kv_offload needs prefix caching"):
        CacheConfig(kv_offload="cpu", enable_prefix_caching=False)
    with pytest.raises(ValueError, match=r"kv_offload must be none, cpu or disk, got 'tape'"):
        CacheConfig(kv_offload="tape")


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_offline_greedy_output_unchanged_with_blocks_from_the_tier(tiny_model_factory: Callable[..., Path],
                                                                   kind: str, tmp_path: Path) -> None:
    """A pool of 8 blocks: the second set of prompts evicts the first's, which the third pass restores."""
    from common.config.engine_config import CacheConfig
    from common.engine.llm import LLM
    from common.sampling.params import SamplingParams
    from tests.model.test_families import _with_tokenizer

    model_dir = _with_tokenizer(tiny_model_factory("llama", seed=2))
    gen = torch.Generator().manual_seed(4)
    first = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (40, 37)]
    second = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (41, 38, 35)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run(offload: str) -> tuple[list[list[int]], int]:
        cache = CacheConfig(block_size=16, num_blocks=8, kv_offload=offload, kv_offload_gb=0.01,
                            kv_offload_dir=str(tmp_path))
        with LLM(model_dir, dtype="float32", device="cpu", cache=cache) as llm:
            outputs = []
            for batch in (first, second, first):
                outputs += [c.token_ids for c in llm.generate(batch, params)]
            llm.engine.kv.check_integrity()
            return outputs, llm.engine.kv.offload_hits

    plain, no_hits = run("none")
    offloaded, hits = run(kind)
    assert offloaded == plain and no_hits == 0
    assert hits >= 32  # full blocks of the first prompts came back from the tier
    assert not list(tmp_path.glob("kv-offload-*"))  # the disk tier's file went with the engine

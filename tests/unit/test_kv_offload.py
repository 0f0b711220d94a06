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
from common.kv.kv_cache_manager import NULL_BLOCK, KVCacheManager
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
    if kind == "disk":  # the file was unlinked once mapped: nothing to leave behind, even if the process is killed
        assert not (tmp_path / "tier.bin").exists()
        maps = Path("/proc/self/maps").read_text()
        assert f"{tmp_path / 'tier.bin'} (deleted)" in maps
        tier.close()


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
    with pytest.raises(ValueError, match=r"kv_offload must be none, cpu, disk or shared, got 'tape'"):
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
            stats = llm.engine.stats()  # what the node's Stats and tandem:kv_offload_* report
            assert stats.offload_hits == llm.engine.kv.offload_hits
            assert (stats.offload_blocks > 0) == (offload != "none")
            return outputs, llm.engine.kv.offload_hits

    plain, no_hits = run("none")
    offloaded, hits = run(kind)
    assert offloaded == plain and no_hits == 0
    assert hits >= 32  # full blocks of the first prompts came back from the tier
    assert not list(tmp_path.glob("kv-offload-*"))  # the disk tier's file went with the engine


class GateCopier:
    """A copier whose copies land only when the test says (``land``) or when the tier waits for one: shows what
    the tier does while a copy is still running."""

    def __init__(self) -> None:
        self.queued: list[list[object]] = []  # [dst, src snapshot at landing time: none until landed, landed?]

    def submit(self, dst: torch.Tensor, src: torch.Tensor) -> object:
        handle = [dst, src, False]
        self.queued.append(handle)
        return handle

    def done(self, handle: object) -> bool:
        return bool(handle[2])  # type: ignore[index]

    def wait(self, handle: object) -> None:
        for queued in self.queued:  # in order, as a thread or a stream would
            self._land(queued)
            if queued is handle:
                return

    def land(self) -> None:
        for queued in self.queued:
            self._land(queued)

    def close(self) -> None:
        self.land()

    @staticmethod
    def _land(handle: list[object]) -> None:
        if not handle[2]:
            handle[0].copy_(handle[1])  # type: ignore[attr-defined]
            handle[2] = True


def _gated() -> tuple[KVCache, KVCacheManager, GateCopier, OffloadTier]:
    """A pool of 4 blocks over a write-behind tier of 8 slots whose copies land when the test says."""
    cache = KVCache(SPEC, num_blocks=4)
    manager = KVCacheManager(4, SPEC.block_size)
    copier = GateCopier()
    tier = OffloadTier(OffloadStore(cache, 8, None), OffloadIndex(8), copier)
    manager.set_offload(tier)
    return cache, manager, copier, tier


def test_write_behind_offers_freed_blocks_and_an_eviction_waits_for_their_copy() -> None:
    cache, manager, copier, tier = _gated()
    a = list(range(100, 113))  # 3 full blocks + 1 token
    blocks_a = _write(cache, manager, "a", a)
    kv_a = cache.data[blocks_a[:3]].clone()
    assert tier.num_pending == 0 and not copier.queued  # nothing offered while referenced
    manager.free("a")
    hashes = hash_prompt_blocks(a, 4)
    assert all(tier.holds(h) for h in hashes) and tier.num_pending == 3  # offered at once, copies not landed
    assert tier.index.saves == 3
    # b takes every block of the pool: a's three are evicted; each eviction waits for that block's copy to land
    # before the block is handed out (b's writes below would otherwise reach the tier)
    _write(cache, manager, "b", list(range(200, 213)))
    assert tier.waits == 3 and tier.num_pending == 0 and tier.index.saves == 3  # no second, synchronous copy
    manager.free("b")
    again = manager.allocate("a2", a)
    assert again is not None and again.num_cached_tokens == 12 and manager.offload_hits == 12
    assert torch.equal(cache.data[again.block_ids[:3]], kv_a)
    manager.check_integrity()
    tier.index.check_integrity()


def test_write_behind_copies_that_landed_cost_the_eviction_nothing() -> None:
    cache, manager, copier, tier = _gated()
    a = list(range(100, 113))
    blocks_a = _write(cache, manager, "a", a)
    kv_a = cache.data[blocks_a[:3]].clone()
    manager.free("a")
    copier.land()  # the background copies finished while the blocks sat in the free queue
    _write(cache, manager, "b", list(range(200, 213)))
    assert tier.waits == 0 and tier.index.saves == 3
    manager.free("b")
    again = manager.allocate("a2", a)
    assert again is not None and torch.equal(cache.data[again.block_ids[:3]], kv_a)


def test_a_load_waits_for_the_copies_writing_its_slot() -> None:
    """One slot: block 0's KV offered under h1 (its copy pending), then block 1's under h2 displaces it in the index
    (a second pending copy into the same slot); restoring h2 must read block 1's KV, so the load lands both copies,
    in order, first."""
    cache = KVCache(SPEC, num_blocks=3)
    cache.data[0], cache.data[1] = 1.0, 2.0
    copier = GateCopier()
    tier = OffloadTier(OffloadStore(cache, 1, None), OffloadIndex(1), copier)
    h1, h2 = b"1" * 8, b"2" * 8
    tier.offer(0, h1)
    tier.offer(1, h2)
    assert not tier.holds(h1) and tier.holds(h2) and tier.num_pending == 2
    tier.load(h2, 2)
    assert torch.equal(cache.data[2], cache.data[1]) and tier.waits == 1 and tier.num_pending == 0
    tier.offer(0, h1)  # landed at once this time: a load then waits for nothing
    copier.land()
    tier.load(h1, 2)
    assert torch.equal(cache.data[2], cache.data[0]) and tier.waits == 1


def test_write_behind_on_a_thread_matches_the_synchronous_tier() -> None:
    """A seeded run of admissions and frees over a small pool, the real background thread against the synchronous
    tier: the same blocks restored with the same KV at every step."""
    import random

    from common.kv.offload import ThreadCopier

    def run(copier: ThreadCopier | None) -> list[tuple[int, torch.Tensor]]:
        cache = KVCache(SPEC, num_blocks=12)
        manager = KVCacheManager(12, SPEC.block_size)
        tier = OffloadTier(OffloadStore(cache, 16, None), OffloadIndex(16), copier)
        manager.set_offload(tier)
        rng = random.Random(7)
        prompts = [[rng.randrange(3, 50) for _ in range(rng.randrange(5, 18))] for _ in range(6)]
        seen = []
        for step in range(60):
            prompt = prompts[rng.randrange(len(prompts))]
            alloc = manager.allocate(f"r{step}", prompt)
            assert alloc is not None
            seen.append((alloc.num_cached_tokens, cache.data[alloc.block_ids[: alloc.num_cached_tokens // 4]].clone()))
            for i in range(alloc.num_cached_tokens, len(prompt)):
                cache.data[alloc.block_ids[i // 4], :, :, i % 4] = float(prompt[i])
            manager.commit(f"r{step}", prompt)
            manager.free(f"r{step}")
            manager.check_integrity()
        tier.close()
        return seen

    threaded, synchronous = run(ThreadCopier()), run(None)
    assert [n for n, _ in threaded] == [n for n, _ in synchronous]
    assert any(n > 0 for n, _ in threaded)
    for (_, kv_t), (_, kv_s) in zip(threaded, synchronous, strict=True):
        assert torch.equal(kv_t, kv_s)


def test_a_remote_prompt_restores_only_the_blocks_inside_the_window(tmp_path: Path) -> None:
    """A decode node reserving a prompt whose KV comes from elsewhere: hits outside the window at its first query
    are neither taken from the pool nor restored from the tier; their hashes still chain to the live ones."""
    cache = KVCache(SPEC, num_blocks=6)
    manager = KVCacheManager(6, SPEC.block_size)
    tier = OffloadTier(OffloadStore(cache, 2, None), OffloadIndex(2))
    manager.set_offload(tier)
    a = list(range(100, 117))  # 4 full blocks + 1 token
    blocks_a = _write(cache, manager, "a", a)
    kv_block2 = cache.data[blocks_a[2]].clone()
    manager.free("a")
    _write(cache, manager, "b", list(range(300, 317)))  # as above: the pool keeps a's block 0, the tier 1 and 2
    manager.free("b")
    manager.window = 8  # a query at 17 reads 10..17: blocks 0 (0..3) and 1 (4..7) are dead
    again = manager.allocate("a2", a, first_query_pos=len(a))
    assert again is not None and again.num_cached_tokens == 12 and manager.offload_hits == 4
    assert again.block_ids[:2] == [NULL_BLOCK, NULL_BLOCK] and NULL_BLOCK not in again.block_ids[2:]
    assert manager.num_used_blocks == 3  # the restored block 2, then 3 and 4: the pool's block 0 was not taken
    assert torch.equal(cache.data[again.block_ids[2]], kv_block2)  # the tier's block 2, restored
    manager.check_integrity()
    manager.commit("a2", a)
    manager.free("a2")
    assert manager.num_free_blocks == 6
    manager.check_integrity()


def _tiered(slots: int = 8) -> tuple[KVCache, KVCacheManager, OffloadTier]:
    cache = KVCache(SPEC, num_blocks=6)
    manager = KVCacheManager(6, SPEC.block_size)
    tier = OffloadTier(OffloadStore(cache, slots, None), OffloadIndex(slots))
    manager.set_offload(tier)
    return cache, manager, tier


def test_a_finished_requests_partly_filled_block_is_restored_for_the_prompt_that_goes_on_from_it() -> None:
    cache, manager, tier = _tiered()
    history = list(range(100, 115))  # 3 full blocks of 4 and 3 tokens in the fourth, all with KV written
    blocks = _write(cache, manager, "turn1", history)
    tail_kv = cache.data[blocks[3]].clone()
    manager.free("turn1", history)  # the tail goes to the tier now: its block is not cached and may be reused
    assert len(tier.index) == 1
    cache.data[blocks[3]] = -1.0  # reused and written over
    turn2 = history + [7, 8, 9]
    alloc = manager.allocate("turn2", turn2)
    assert alloc is not None and alloc.num_cached_tokens == 15  # computed from exactly where the history ends
    assert (manager.prefix_cache_hits, manager.offload_hits, manager.tail_hits) == (15, 3, 3)
    assert torch.equal(cache.data[alloc.block_ids[3], :, :, :3], tail_kv[:, :, :3])  # the tail's three slots
    assert alloc.block_ids[3] not in blocks[:3]  # a new block, private to turn2 (it writes slot 3 next)
    manager.check_integrity()


def test_a_tail_is_found_only_by_a_prompt_that_goes_on_from_all_of_its_tokens() -> None:
    _, manager, _ = _tiered()
    history = list(range(100, 115))
    _write(manager.offload.store.kv_cache, manager, "turn1", history)  # type: ignore[union-attr]
    manager.free("turn1", history)
    for i, prompt in enumerate((history[:14] + [1, 2],  # differs inside the tail: its full blocks only
                                history,  # the same tokens: the last one is left to compute (it needs logits)
                                history[:12] + [5])):  # shorter than the tail
        alloc = manager.allocate(f"r{i}", prompt)
        assert alloc is not None and alloc.num_cached_tokens == 12
        manager.free(f"r{i}")
    assert manager.tail_hits == 0
    salted = manager.allocate("salted", history + [1], salt=b"tenant")  # another salt shares nothing
    assert salted is not None and salted.num_cached_tokens == 0
    manager.free("salted")
    whole = manager.allocate("decode", history + [1], tail=False)  # a decode node: its KV arrives in whole blocks
    assert whole is not None and whole.num_cached_tokens == 12
    manager.check_integrity()


def test_tails_need_a_tier_and_no_sliding_window() -> None:
    manager = KVCacheManager(6, SPEC.block_size)
    assert not manager.keeps_tails
    cache, manager, tier = _tiered()
    assert manager.keeps_tails
    manager.window = 8
    assert not manager.keeps_tails
    history = list(range(100, 115))
    _write(cache, manager, "turn1", history)
    manager.free("turn1", history)
    assert len(tier.index) == 0


def test_a_conversations_next_turn_restores_its_tail_with_output_unchanged(tiny_model_factory: Callable[..., Path]
                                                                            ) -> None:
    """Offline, host-memory tier: turn 2's prompt is turn 1's prompt, its answer and a new message; the prefix
    cache holds the history's full blocks and the tier its last, partly filled one, so only the message is
    computed: the same greedy tokens as without any cache."""
    from common.config.engine_config import CacheConfig
    from common.engine.llm import LLM
    from common.sampling.params import SamplingParams
    from tests.model.test_families import _with_tokenizer

    model_dir = _with_tokenizer(tiny_model_factory("llama", seed=2))
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 128, (40,), generator=gen).tolist()
    message = torch.randint(3, 128, (9,), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def turns(offload: str) -> tuple[list[int], list[int], int]:
        cache = CacheConfig(block_size=16, num_blocks=16, kv_offload=offload, kv_offload_gb=0.01,
                            enable_prefix_caching=offload != "none")
        with LLM(model_dir, dtype="float32", device="cpu", cache=cache) as llm:
            answer = llm.generate([prompt], params)[0].token_ids
            out = llm.generate([prompt + answer + message], params)[0]
            llm.engine.kv.check_integrity()
            return answer, out.token_ids, llm.engine.kv.tail_hits

    plain_answer, plain_out, _ = turns("none")
    answer, out, tail_hits = turns("cpu")
    assert (answer, out) == (plain_answer, plain_out)
    assert tail_hits == 40 + 12 - 1 - 48  # the history's KV (all but the last answer token's) past 3 full blocks

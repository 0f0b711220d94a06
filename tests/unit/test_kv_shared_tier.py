"""The shared KV offload tier (common/kv/shared_tier.py) with exact expectations: one node's freed blocks, written
behind into the shared directory, restored by another node's prefix match block by block equal; a file found by a
reader survives its writer's eviction; each node bounds its own files; layouts and models never mix; and through
two offline engines, the second continues the first's conversation from the first's KV with unchanged output."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from common.kv.block_hash import hash_prompt_blocks
from common.kv.kv_cache import KVCache, KVCacheSpec
from common.kv.kv_cache_manager import KVCacheManager
from common.kv.shared_tier import SharedTier, model_fingerprint, namespace
from common.model import gemv
from tests.unit.test_kv_offload import SPEC, _write  # the same cache layout and forward stand-in

BLOCK_GB = SPEC.num_layers * 2 * SPEC.block_size * SPEC.num_kv_heads * SPEC.head_dim * 4 / 2**30


def _node(directory: Path, blocks: int = 8, tier_blocks: int = 16, key: str = "m", cache_spec: KVCacheSpec = SPEC
          ) -> tuple[KVCache, KVCacheManager, SharedTier]:
    cache = KVCache(cache_spec, num_blocks=blocks)
    manager = KVCacheManager(blocks, cache_spec.block_size)
    tier = SharedTier(cache, directory, tier_blocks * BLOCK_GB * 1.0001, key)
    manager.set_offload(tier)
    return cache, manager, tier


def _drain(tier: object) -> None:
    """Wait (bounded) for the tier's writes behind to land."""
    import time

    assert isinstance(tier, SharedTier)
    for _ in range(2000):
        if tier.num_pending == 0:
            return
        time.sleep(0.005)
    raise AssertionError("the shared tier's writes did not land")


def test_one_nodes_freed_blocks_are_restored_by_another(tmp_path: Path) -> None:
    cache_a, manager_a, tier_a = _node(tmp_path)
    cache_b, manager_b, tier_b = _node(tmp_path)
    assert tier_a.id == tier_b.id
    prompt = list(range(100, 113))  # 3 full blocks + 1 token
    blocks_a = _write(cache_a, manager_a, "a", prompt)
    kv = cache_a.data[blocks_a[:3]].clone()
    manager_a.free("a")  # offered: written behind while the blocks wait in the free queue
    _drain(tier_a)
    assert len(tier_a) == 3 and len(list(tier_a.directory.glob("*.kv"))) == 3
    again = manager_b.allocate("b", prompt)
    assert again is not None and again.num_cached_tokens == 12 and manager_b.offload_hits == 12
    assert torch.equal(cache_b.data[again.block_ids[:3]], kv)  # the same KV, block by block
    assert len(tier_b) == 0 and tier_b.hits == 3  # B read them; A owns them
    longer = prompt[:12] + [7, 8, 9, 10, 11]  # shares the first 3 blocks
    manager_b.free("b")
    hit = manager_b.allocate("c", longer)
    assert hit is not None and hit.num_cached_tokens == 12  # now from B's own pool
    manager_b.check_integrity()
    tier_a.close()
    tier_b.close()


def test_a_found_file_survives_its_writers_eviction(tmp_path: Path) -> None:
    cache_a, manager_a, tier_a = _node(tmp_path, tier_blocks=2)
    cache_b, _, tier_b = _node(tmp_path)
    prompt = list(range(10, 19))  # 2 full blocks + 1
    blocks_a = _write(cache_a, manager_a, "a", prompt)
    kv = cache_a.data[blocks_a[:2]].clone()
    manager_a.free("a")
    _drain(tier_a)
    hashes = hash_prompt_blocks(prompt, SPEC.block_size)
    assert all(tier_b.holds(h) for h in hashes[:2])  # B found them: open now
    other = list(range(50, 59))
    _write(cache_a, manager_a, "x", other)
    manager_a.free("x")
    _drain(tier_a)  # A's bound (2 blocks) removed the first prompt's files
    assert not any(tier_a._path(h).exists() for h in hashes[:2]) and len(tier_a) == 2 and tier_a.evictions == 2
    tier_b.pin(hashes[:2])
    for h, block in zip(hashes[:2], (3, 5), strict=True):
        tier_b.load(h, block)  # read through the descriptor opened when found
    assert torch.equal(cache_b.data[[3, 5]], kv)
    assert not tier_b.holds(hashes[0])  # gone for a new lookup
    tier_a.close()
    tier_b.close()


def test_probes_not_loaded_are_closed_at_the_next_pin(tmp_path: Path) -> None:
    cache_a, manager_a, tier_a = _node(tmp_path)
    _, _, tier_b = _node(tmp_path)
    prompt = list(range(10, 19))
    _write(cache_a, manager_a, "a", prompt)
    manager_a.free("a")
    _drain(tier_a)
    hashes = hash_prompt_blocks(prompt, SPEC.block_size)
    assert tier_b.holds(hashes[0]) and tier_b.holds(hashes[1]) and len(tier_b._open) == 2
    tier_b.pin(hashes[1:2])
    assert list(tier_b._open) == [hashes[1]]
    tier_b.close()
    assert not tier_b._open
    tier_a.close()


def test_an_eviction_without_an_offer_writes_synchronously_and_a_held_hash_is_not_written_twice(tmp_path: Path
                                                                                                ) -> None:
    cache = KVCache(SPEC, num_blocks=4)
    manager = KVCacheManager(4, SPEC.block_size)
    tier = SharedTier(cache, tmp_path, 16 * BLOCK_GB * 1.0001, "m", write_behind=False)
    manager.set_offload(tier)
    a = list(range(100, 113))
    _write(cache, manager, "a", a)
    manager.free("a")
    assert len(tier) == 0  # no offer without write-behind
    _write(cache, manager, "b", list(range(200, 213)))  # evicts a's three cached blocks: saved then
    assert len(tier) == 3 and tier.saves == 3
    manager.free("b")
    _write(cache, manager, "c", list(range(300, 313)))  # evicts b's
    assert tier.saves == 6
    manager.free("c")
    again = manager.allocate("a2", a)
    assert again is not None and again.num_cached_tokens == 12
    tier.close()
    assert not list(tier.directory.glob("*.kv"))  # its own files went with it


def test_other_layouts_and_models_never_share_blocks(tmp_path: Path) -> None:
    base = KVCache(SPEC, num_blocks=2)
    other_dtype = KVCache(KVCacheSpec(2, 2, 4, 4, "bfloat16"), num_blocks=2)
    other_shape = KVCache(KVCacheSpec(2, 2, 8, 4, "float32"), num_blocks=2)
    names = {namespace(base, "m"), namespace(base, "n"), namespace(other_dtype, "m"), namespace(other_shape, "m")}
    assert len(names) == 4
    cache_a, manager_a, tier_a = _node(tmp_path, key="model-a")
    _, manager_b, tier_b = _node(tmp_path, key="model-b")
    prompt = list(range(10, 19))
    _write(cache_a, manager_a, "a", prompt)
    manager_a.free("a")
    _drain(tier_a)
    alloc = manager_b.allocate("b", prompt)
    assert alloc is not None and alloc.num_cached_tokens == 0 and manager_b.offload_hits == 0
    stray = tier_b._path(hash_prompt_blocks(prompt, 4)[0])
    stray.write_bytes(b"short")  # a file of the wrong size under B's namespace is not read
    assert not tier_b.holds(hash_prompt_blocks(prompt, 4)[0])
    tier_a.close()
    tier_b.close()


def test_model_fingerprint_follows_the_weights() -> None:
    torch.manual_seed(0)
    a = torch.nn.Linear(8, 8)
    b = torch.nn.Linear(8, 8)
    assert model_fingerprint(a) == model_fingerprint(a) and model_fingerprint(a) != model_fingerprint(b)
    with torch.device("meta"):
        skeleton = torch.nn.Linear(8, 8)
    assert len(model_fingerprint(skeleton)) == 32  # names, shapes and dtypes only
    if gemv.onednn_available():
        # A node that also holds a weight in oneDNN's layout (measured per process) is the same model.
        before = model_fingerprint(a)
        a.register_buffer("onednn_weight", gemv.onednn_pack(a.weight.detach()), persistent=False)
        assert model_fingerprint(a) == before


def test_shared_needs_a_directory() -> None:
    from common.config.engine_config import CacheConfig

    with pytest.raises(ValueError, match="kv_offload shared needs kv_offload_dir"):
        CacheConfig(kv_offload="shared")
    with pytest.raises(ValueError, match=r"kv_offload must be none, cpu, disk or shared, got 'tape'"):
        CacheConfig(kv_offload="tape")


def test_a_second_engine_continues_the_firsts_conversation_from_its_kv(tiny_model_factory: Callable[..., Path],
                                                                       tmp_path: Path) -> None:
    """Engine A answers a prompt; engine B (another node on the same shared tier) gets the next turn (prompt,
    answer, a new message) and restores every full block of the history A wrote, with B's output unchanged."""
    from common.config.engine_config import CacheConfig
    from common.engine.llm import LLM
    from common.sampling.params import SamplingParams
    from tests.model.test_families import _with_tokenizer

    model_dir = _with_tokenizer(tiny_model_factory("llama", seed=2))
    other_dir = _with_tokenizer(tiny_model_factory("llama", seed=3))
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, 128, (40,), generator=gen).tolist()
    message = torch.randint(3, 128, (21,), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    shared = tmp_path / "shared"

    def cache(offload: str) -> CacheConfig:
        return CacheConfig(block_size=16, num_blocks=16, kv_offload=offload, kv_offload_gb=0.01,
                           kv_offload_dir=str(shared) if offload == "shared" else "")

    with LLM(model_dir, dtype="float32", device="cpu", cache=cache("none")) as plain:
        answer = plain.generate([prompt], params)[0].token_ids
        expected = plain.generate([prompt + answer + message], params)[0].token_ids
    with LLM(model_dir, dtype="float32", device="cpu", cache=cache("shared")) as a:
        assert a.generate([prompt], params)[0].token_ids == answer
        _drain(a.engine.offload)
        # the history's 3 full blocks and its last, partly filled one (tokens 48-50)
        assert a.engine.stats().kv_shared_tier == a.engine.offload.id and a.engine.stats().offload_blocks == 4
        with LLM(other_dir, dtype="float32", device="cpu", cache=cache("shared")) as other:  # another model
            other.generate([prompt + answer + message], params)
            assert other.engine.kv.offload_hits == 0 and other.engine.offload.id != a.engine.offload.id
        with LLM(model_dir, dtype="float32", device="cpu", cache=cache("shared")) as b:
            out = b.generate([prompt + answer + message], params)[0].token_ids
            # 40 + 12 = 52 tokens of history, 51 with KV (all but the last answer token's): 3 full blocks and the
            # tail's 3 tokens; only the message is computed
            assert b.engine.kv.offload_hits == 51 and b.engine.kv.tail_hits == 3 and out == expected
            b.engine.kv.check_integrity()
    assert not list(shared.rglob("*.kv"))  # every node removed the files it wrote


def test_one_nodes_tail_is_restored_by_another(tmp_path: Path) -> None:
    """A decode node lets go of a conversation (prompt and answer): its last, partly filled block goes to the shared
    directory from a snapshot (the block itself is free at once); the prefill node of the next turn restores it."""
    cache_a, manager_a, tier_a = _node(tmp_path)
    cache_b, manager_b, tier_b = _node(tmp_path)
    history = list(range(100, 114))  # 3 full blocks and 2 tokens
    blocks = _write(cache_a, manager_a, "a", history)
    tail_kv = cache_a.data[blocks[3], :, :, :2].clone()
    manager_a.free("a", history)
    cache_a.data[blocks[3]] = -1.0  # written over at once: the tier wrote the snapshot
    _drain(tier_a)
    assert len(tier_a) == 4  # 3 full blocks (offered when freed) and the tail
    again = manager_b.allocate("b", history + [1, 2, 3])
    assert again is not None and again.num_cached_tokens == 14 and manager_b.tail_hits == 2
    assert torch.equal(cache_b.data[again.block_ids[3], :, :, :2], tail_kv)
    manager_b.check_integrity()
    tier_a.close()
    tier_b.close()


def test_a_killed_writers_files_are_removed_by_the_next_node_that_lists_the_writers(tmp_path: Path) -> None:
    """A node killed without closing leaves its directory; its lock went with the process, so the next node on
    the directory finds the lock free and removes the files. A live writer's files are left alone."""
    import subprocess
    import sys

    child = f"""
import os, torch
from pathlib import Path
from common.kv.kv_cache import KVCache, KVCacheSpec
from common.kv.shared_tier import SharedTier
cache = KVCache(KVCacheSpec(2, 2, 4, 4, "float32"), num_blocks=2)
tier = SharedTier(cache, Path({str(tmp_path)!r}), 0.001, "m", write_behind=False)
tier.save(0, bytes(16))
print(tier.writer, flush=True)
os._exit(0)  # killed: no close
"""
    root = Path(__file__).resolve().parents[2]
    dead = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, cwd=root,
                          check=True).stdout.strip()
    _, _, live = _node(tmp_path)  # a live writer on the same directory
    files = [p.relative_to(live.root) for p in live.root.rglob("*.kv")]
    assert dead and not any(str(p).startswith(dead) for p in files)  # reaped when `live` started
    assert live.reaped == 1 and not (live.root / (dead + ".lock")).exists()
    _, _, third = _node(tmp_path)
    assert third.reaped == 0 and live.directory.is_dir()  # the live writer's lock is held: left alone
    third.close()
    live.close()
    assert not list(tmp_path.rglob("*.kv")) and not list(tmp_path.rglob("*.lock"))

"""Exact expectations for KVCacheManager, then a stateful property test against a simulated KV tensor."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from common.kv.kv_cache_manager import NULL_BLOCK, Allocation, BlockCopy, KVCacheManager

BS = 4
A = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]  # 2 full blocks + 2 tokens
B = [20, 21, 22, 23, 24, 25, 26, 27]  # 2 full blocks exactly
C = [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]  # 3 full blocks


def make(num_blocks: int = 10, enable_prefix_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size=BS, enable_prefix_caching=enable_prefix_caching)


def test_fresh_allocate_takes_blocks_in_order() -> None:
    kv = make()
    assert kv.allocate("a", A) == Allocation([0, 1, 2], 0)
    assert kv.allocate("b", B) == Allocation([3, 4], 0)
    assert (kv.block_table("a"), kv.num_tokens("a")) == ([0, 1, 2], 10)
    assert (kv.num_free_blocks, kv.num_used_blocks, kv.usage) == (5, 5, 0.5)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (18, 0)
    kv.check_integrity()


def test_second_request_reuses_the_committed_prefix() -> None:
    kv = make()
    kv.allocate("a", A)
    kv.commit("a", A)
    assert kv.get_computed_blocks(A[:8] + [99, 98, 97]) == ([0, 1], 8)
    assert kv.allocate("b", A[:8] + [99, 98, 97]) == Allocation([0, 1, 3], 8)
    assert [kv.pool.ref_count(b) for b in range(4)] == [2, 2, 1, 1]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (21, 8)
    # A different salt names a different prefix.
    assert kv.allocate("c", A, salt=b"tenant") == Allocation([4, 5, 6], 0)
    kv.check_integrity()


def test_cache_hit_leaves_at_least_one_token_to_compute() -> None:
    kv = make()
    kv.allocate("a", B)
    kv.commit("a", B)
    # All 8 tokens are cached, but the last one must be recomputed for its logits: only block 0 is reused.
    assert kv.allocate("b", B) == Allocation([0, 2], 4)
    assert kv.allocate("c", B + [1]) == Allocation([0, 1, 3], 8)
    kv.check_integrity()


def test_blocks_are_cached_only_when_committed_and_full() -> None:
    kv = make()
    kv.allocate("a", A)
    # Reserved but not written (e.g. waiting for a remote prefill): not findable.
    assert kv.get_computed_blocks(A + [1]) == ([], 0)
    kv.commit("a", A[:7])
    assert [kv.pool.get_block_hash(b) is not None for b in range(3)] == [True, False, False]
    kv.commit("a", A)
    assert [kv.pool.get_block_hash(b) is not None for b in range(3)] == [True, True, False]
    assert kv.append_slots("a", 2) == []
    kv.commit("a", A + [1, 2])
    assert kv.get_computed_blocks(A + [1, 2, 3]) == ([0, 1, 2], 12)
    kv.check_integrity()


def test_identical_blocks_keep_the_first_mapping() -> None:
    kv = make()
    kv.allocate("a", B)
    kv.allocate("b", B)  # nothing committed yet: no hit, fresh blocks [2, 3]
    kv.commit("a", B)
    kv.commit("b", B)
    assert [kv.pool.get_block_hash(b) is not None for b in range(4)] == [True, True, False, False]
    assert kv.get_computed_blocks(B + [1]) == ([0, 1], 8)
    kv.check_integrity()


def test_lru_eviction_takes_the_tail_of_the_earliest_freed_request() -> None:
    kv = make(num_blocks=6)
    assert kv.allocate("a", C) == Allocation([0, 1, 2], 0)
    assert kv.allocate("b", B) == Allocation([3, 4], 0)
    kv.commit("a", C)
    kv.commit("b", B)
    kv.free("a")  # free queue: 5, 2, 1, 0
    kv.free("b")  # free queue: 5, 2, 1, 0, 4, 3
    assert kv.allocate("c", [7] * 12) == Allocation([5, 2, 1], 0)
    assert kv.get_computed_blocks(C) == ([0], 4)
    # Reviving block 0 takes it out of the queue; the rest comes from b's blocks, tail first.
    assert kv.allocate("d", C) == Allocation([0, 4, 3], 4)
    assert kv.get_computed_blocks(B + [1]) == ([], 0)
    kv.check_integrity()


def test_blocks_of_running_requests_are_never_evicted() -> None:
    kv = make(num_blocks=4)
    kv.allocate("a", B)
    kv.commit("a", B)
    assert kv.allocate("b", [1] * 8) == Allocation([2, 3], 0)
    assert kv.allocate("c", [2]) is None
    assert kv.get_computed_blocks(B + [1]) == ([0, 1], 8)


def test_failed_allocate_changes_nothing() -> None:
    kv = make(num_blocks=4)
    kv.allocate("a", B)
    kv.commit("a", B)
    kv.free("a")  # free queue: 2, 3, 1, 0 with 0 and 1 cached
    # 17 tokens = 5 blocks: 2 cached + 3 new. 4 blocks are free, but reviving 0 and 1 leaves only 2.
    assert kv.allocate("b", B + [5] * 9) is None
    assert not kv.has_request("b")
    assert (kv.num_free_blocks, kv.prefix_cache_queries, kv.prefix_cache_hits) == (4, 8, 0)
    assert [kv.pool.ref_count(b) for b in range(4)] == [0, 0, 0, 0]
    kv.check_integrity()
    assert kv.allocate("b", B + [5] * 5) == Allocation([0, 1, 2, 3], 8)
    kv.check_integrity()


def test_append_slots_grows_the_table_block_by_block() -> None:
    kv = make(num_blocks=5)
    assert kv.allocate("a", [1, 2, 3]) == Allocation([0], 0)
    assert kv.append_slots("a", 1) == []
    assert kv.append_slots("a", 1) == [1]
    assert kv.append_slots("a", 9) == [2, 3]
    assert kv.num_tokens("a") == 14
    assert kv.append_slots("a", 7) is None
    assert (kv.block_table("a"), kv.num_tokens("a")) == ([0, 1, 2, 3], 14)
    assert kv.append_slots("a", 2) == []
    assert kv.append_slots("a", 1) == [4]
    assert kv.blocks_needed(17) == 5 and not kv.can_allocate(1)
    kv.check_integrity()


def test_fork_shares_full_blocks_and_copies_the_partial_one() -> None:
    kv = make(num_blocks=5)
    kv.allocate("a", A)
    assert kv.fork("a", "b") == [(2, 3)]
    assert (kv.block_table("b"), kv.num_tokens("b")) == ([0, 1, 3], 10)
    assert [kv.pool.ref_count(b) for b in range(5)] == [2, 2, 1, 1, 0]
    kv.commit("a", A)
    kv.commit("b", A)  # the shared blocks are already cached under the same hashes
    kv.check_integrity()
    assert kv.fork("a", "c") == [(2, 4)]
    assert kv.fork("a", "d") is None
    assert not kv.has_request("d")
    kv.truncate("a", 8)
    assert kv.fork("a", "d") == []
    assert kv.block_table("d") == [0, 1]
    kv.check_integrity()


def test_truncate_frees_the_tail_and_uncaches_a_private_partial_block() -> None:
    kv = make()
    kv.allocate("a", B)
    kv.commit("a", B)
    assert kv.append_slots("a", 6) == [2, 3]
    assert kv.truncate("a", 6) == []
    assert (kv.block_table("a"), kv.num_tokens("a")) == ([0, 1], 6)
    # Block 1 will be overwritten from slot 2 on, so its hash must go.
    assert (kv.pool.get_block_hash(0) is not None, kv.pool.get_block_hash(1)) == (True, None)
    assert kv.get_computed_blocks(B + [1]) == ([0], 4)
    assert kv.truncate("a", 4) == []
    assert kv.block_table("a") == [0]
    kv.check_integrity()


def test_truncate_into_a_shared_block_copies_it() -> None:
    kv = make(num_blocks=4)
    kv.allocate("a", B)
    kv.commit("a", B)
    assert kv.allocate("b", B + [9]) == Allocation([0, 1, 2], 8)
    assert kv.truncate("b", 6) == [(1, 3)]
    assert kv.block_table("b") == [0, 3]
    # a still holds block 1, full and cached.
    assert kv.pool.ref_count(1) == 1 and kv.get_computed_blocks(B + [1]) == ([0, 1], 8)
    kv.check_integrity()


def test_truncate_without_a_free_block_for_the_copy_changes_nothing() -> None:
    kv = make(num_blocks=3)
    kv.allocate("a", B)
    kv.commit("a", B)
    kv.allocate("b", B + [9])
    kv.fork("a", "c")
    assert kv.truncate("c", 6) is None
    assert (kv.block_table("c"), kv.num_tokens("c"), kv.num_free_blocks) == ([0, 1], 8, 0)
    # b's tail block is freed first, so the copy fits.
    assert kv.truncate("b", 6) == [(1, 2)]
    kv.check_integrity()


def test_free_returns_the_pool_to_its_start() -> None:
    kv = make()
    kv.allocate("a", A)
    kv.commit("a", A)
    kv.allocate("b", A)
    kv.fork("b", "c")
    kv.append_slots("c", 7)
    for request_id in ("c", "a", "b"):
        kv.free(request_id)
        kv.check_integrity()
    assert (kv.num_used_blocks, kv.num_free_blocks, kv.usage) == (0, 10, 0.0)
    assert not kv.has_request("a")
    assert kv.pool.reset_prefix_cache()
    assert kv.allocate("d", A) == Allocation([7, 8, 9], 0)  # queue: 7 8 9 6 5 4 2 3 1 0


def test_disabled_prefix_caching_never_hits() -> None:
    kv = make(enable_prefix_caching=False)
    kv.allocate("a", A)
    kv.commit("a", A)
    assert kv.allocate("b", A) == Allocation([3, 4, 5], 0)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)
    kv.check_integrity()


# ---------------------------------------------------------------------- stateful property test

NUM_BLOCKS = 12
TOKENS = st.integers(min_value=0, max_value=1)  # a tiny vocabulary, so prefixes collide often
SALTS = st.sampled_from([None, b"s"])


class KVCacheMachine(RuleBasedStateMachine):
    """Random request lifecycles against a simulated KV tensor: a request's KV must always hold its tokens."""

    enable_prefix_caching = True

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS, self.enable_prefix_caching)
        self.tokens: dict[str, list[int]] = {}
        # The "KV tensor": the token whose KV each slot holds, None if never written.
        self.slots: list[list[int | None]] = [[None] * BS for _ in range(NUM_BLOCKS)]
        self.next_id = 0
        self.history: list[list[int]] = []  # committed token lists, replayed as shared prefixes

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _write(self, request_id: str, start: int) -> None:
        table = self.kv.block_table(request_id)
        for pos in range(start, len(self.tokens[request_id])):
            self.slots[table[pos // BS]][pos % BS] = self.tokens[request_id][pos]

    def _copy(self, copies: list[BlockCopy]) -> None:
        for src, dst in copies:
            self.slots[dst] = list(self.slots[src])

    def _remember(self, committed: list[int]) -> None:
        if len(committed) >= BS:
            self.history.append(list(committed))

    def _pick(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(sorted(self.tokens)))

    @rule(prompt=st.lists(TOKENS, min_size=1, max_size=16), salt=SALTS)
    def allocate(self, prompt: list[int], salt: bytes | None) -> None:
        self._allocate(prompt, salt)

    @precondition(lambda self: self.history)
    @rule(data=st.data(), suffix=st.lists(TOKENS, min_size=1, max_size=6), salt=SALTS)
    def allocate_shared_prefix(self, data: st.DataObject, suffix: list[int], salt: bytes | None) -> None:
        # Random blocks rarely collide beyond the first one, so replay whole blocks of committed requests.
        earlier = data.draw(st.sampled_from(self.history))
        num_blocks = data.draw(st.integers(1, len(earlier) // BS))
        self._allocate(earlier[: num_blocks * BS] + suffix, salt)

    def _allocate(self, prompt: list[int], salt: bytes | None) -> None:
        request_id = self._new_id()
        expected_ids, expected_cached = self.kv.get_computed_blocks(prompt, salt)
        free_before = self.kv.num_free_blocks
        allocation = self.kv.allocate(request_id, prompt, salt)
        if allocation is None:
            assert not self.kv.has_request(request_id) and self.kv.num_free_blocks == free_before
            return
        assert allocation.num_cached_tokens == expected_cached < len(prompt)
        assert allocation.block_ids[: len(expected_ids)] == expected_ids
        for pos in range(expected_cached):  # a cache hit must hold exactly this prompt's KV
            assert self.slots[allocation.block_ids[pos // BS]][pos % BS] == prompt[pos]
        self.tokens[request_id] = list(prompt)
        self._write(request_id, expected_cached)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new_tokens=st.lists(TOKENS, max_size=6))
    def append(self, data: st.DataObject, new_tokens: list[int]) -> None:
        request_id = self._pick(data)
        table = self.kv.block_table(request_id)
        if self.kv.append_slots(request_id, len(new_tokens)) is None:
            assert self.kv.block_table(request_id) == table
            return
        start = len(self.tokens[request_id])
        self.tokens[request_id] += new_tokens
        self._write(request_id, start)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        request_id = self._pick(data)
        num_tokens = len(self.tokens[request_id])
        num_written = data.draw(st.one_of(st.just(num_tokens), st.integers(0, num_tokens)))
        self.kv.commit(request_id, self.tokens[request_id][:num_written])
        self._remember(self.tokens[request_id][:num_written])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent_id, child_id = self._pick(data), self._new_id()
        copies = self.kv.fork(parent_id, child_id)
        if copies is not None:
            self._copy(copies)
            self.tokens[child_id] = list(self.tokens[parent_id])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        request_id = self._pick(data)
        num_tokens = data.draw(st.integers(0, len(self.tokens[request_id])))
        table = self.kv.block_table(request_id)
        copies = self.kv.truncate(request_id, num_tokens)
        if copies is None:
            assert self.kv.block_table(request_id) == table
            return
        self._copy(copies)
        del self.tokens[request_id][num_tokens:]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        request_id = self._pick(data)
        self.kv.free(request_id)
        del self.tokens[request_id]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        # The common ending: everything written is committed, then the request leaves its blocks cached.
        request_id = self._pick(data)
        self.kv.commit(request_id, self.tokens[request_id])
        self._remember(self.tokens.pop(request_id))
        self.kv.free(request_id)

    @invariant()
    def consistent(self) -> None:
        self.kv.check_integrity()
        for request_id, tokens in self.tokens.items():
            assert self.kv.num_tokens(request_id) == len(tokens)
            table = self.kv.block_table(request_id)
            held = [self.slots[table[pos // BS]][pos % BS] for pos in range(len(tokens))]
            assert held == tokens, f"{request_id}: KV was overwritten by another request"

    def teardown(self) -> None:
        for request_id in list(self.tokens):
            self.kv.free(request_id)
        self.kv.check_integrity()
        assert (self.kv.num_used_blocks, self.kv.num_free_blocks) == (0, NUM_BLOCKS)


class KVCacheMachineNoPrefixCaching(KVCacheMachine):
    enable_prefix_caching = False


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestKVCacheMachineNoPrefixCaching = KVCacheMachineNoPrefixCaching.TestCase
TestKVCacheMachineNoPrefixCaching.settings = settings(max_examples=30, stateful_step_count=50, deadline=None)


# ---------------------------------------------------------------- sliding windows: blocks freed early


def test_blocks_before_the_window_are_freed_and_stay_cached() -> None:
    kv = make()
    kv.window = 6  # a query at 12 reads 7..12: block 0 (0..3) is dead, block 1 (4..7) is not
    kv.allocate("a", C)
    assert kv.free_outside_window("a", 12) == []  # nothing committed yet: commit still reads the table
    kv.commit("a", C)
    assert kv.free_outside_window("a", 12) == [0]
    assert kv.block_table("a") == [NULL_BLOCK, 1, 2]
    assert kv.free_outside_window("a", 12) == []  # idempotent
    assert (kv.num_free_blocks, kv.pool.get_block_hash(0) is not None) == (8, True)
    kv.check_integrity()
    # the freed block is still a prefix hit: revived from the free queue
    assert kv.allocate("b", C) == Allocation([0, 1, 3], 8)
    kv.check_integrity()
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 10
    kv.check_integrity()


def test_window_allocation_of_a_first_chunk_skips_hits_before_the_window() -> None:
    """``max_new_tokens``: slots for the cached prefix and the first chunk only (append_slots adds the rest); the
    hits wholly before the first computed query's window are not taken, yet the hash chain goes on through them."""
    kv = make()
    kv.window = 5
    prompt = list(range(100, 122))  # 22 tokens: 5 full blocks, then 2
    kv.allocate("a", prompt)
    kv.commit("a", prompt)
    kv.free("a")  # blocks 0..5 free, 0..4 cached
    # the first query (20) reads 16..20: blocks 0..3 are dead, block 4 a live hit, then 4 tokens: one more block
    allocation = kv.allocate("b", prompt, max_new_tokens=4)
    N = NULL_BLOCK
    assert allocation == Allocation([N, N, N, N, 4, 6], 20) and kv.num_tokens("b") == 22
    assert kv.num_held_blocks("b") == 2 and kv.num_used_blocks == 2
    kv.check_integrity()
    c = list(range(200, 230))  # uncached: slots for 6 tokens (2 blocks), then grown chunk by chunk
    assert kv.allocate("c", c, max_new_tokens=6) == Allocation([7, 8], 0) and kv.num_tokens("c") == 6
    assert kv.append_slots("c", 6) == [9]
    kv.commit("c", c[:12])
    assert kv.free_outside_window("c", 12) == [7, 8]  # a query at 12 reads 8..12
    kv.check_integrity()
    kv.free("b")
    kv.free("c")
    assert kv.num_free_blocks == 10
    kv.check_integrity()


def test_window_bound_is_exact() -> None:
    kv = make()
    kv.window = 5
    kv.allocate("a", C)
    kv.commit("a", C)
    # block 0 holds 0..3: dead once the lowest query q has q - 4 > 3, i.e. q >= 8
    assert kv.free_outside_window("a", 7) == []
    assert kv.free_outside_window("a", 8) == [0]
    assert kv.free_outside_window("a", 11) == []
    assert kv.free_outside_window("a", 12) == [1]
    # a block is never freed past the request's full blocks, whatever the caller says
    assert kv.free_outside_window("a", 100) == [2]
    assert kv.block_table("a") == [NULL_BLOCK] * 3
    kv.check_integrity()
    kv.free("a")
    assert kv.num_free_blocks == 10
    kv.check_integrity()


def test_no_window_or_no_prefix_caching() -> None:
    kv = make()
    kv.allocate("a", C)
    kv.commit("a", C)
    assert kv.free_outside_window("a", 12) == []  # window None: a model with a full-attention layer
    kv = make(enable_prefix_caching=False)
    kv.window = 4
    kv.allocate("a", C)
    assert kv.free_outside_window("a", 12) == [0, 1]  # nothing to commit: written blocks go at once
    kv.check_integrity()
    # a fork shares the live blocks only; the placeholders stay placeholders
    assert kv.fork("a", "b") == []
    assert kv.block_table("b") == [NULL_BLOCK, NULL_BLOCK, 2]
    assert kv.pool.ref_count(2) == 2
    kv.check_integrity()
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 10


def test_an_evicted_freed_block_ends_the_prefix_hit() -> None:
    kv = make()
    kv.window = 6
    kv.allocate("a", C)
    kv.commit("a", C)
    assert kv.free_outside_window("a", 12) == [0]
    # 8 free blocks (3..9, then 0 at the tail): taking them all evicts block 0's hash
    assert kv.allocate("x", list(range(100, 132))) == Allocation([3, 4, 5, 6, 7, 8, 9, 0], 0)
    kv.free("x")
    assert kv.get_computed_blocks(C) == ([], 0)  # block 1 is still cached, but the chain broke at block 0
    kv.check_integrity()


# ---------------------------------------------------------------- a decode node: only the window's blocks reserved


def test_allocate_for_a_remote_prompt_reserves_only_the_window() -> None:
    kv = make()
    kv.window = 5  # the first decode query, at 12, reads 8..12: blocks 0 (0..3) and 1 (4..7) are never read
    assert kv.blocks_outside_window(12) == 2 and kv.blocks_outside_window(11) == 1
    # the dead blocks' 8 tokens count as cached: their KV is needed neither here nor from elsewhere
    assert kv.allocate("a", C + [42], first_query_pos=13) == Allocation([NULL_BLOCK, NULL_BLOCK, 0, 1], 8)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (13, 0)  # but they were no hit
    assert (kv.num_used_blocks, kv.pool.peak_used_blocks) == (2, 2)
    kv.check_integrity()
    # the KV landed: only the window's block is cached; the dead ones have no KV here, their hashes only chain
    kv.commit("a", C + [42])
    assert kv.get_computed_blocks(C + [42]) == ([], 0)
    assert kv.pool.get_block_hash(0) is not None and kv.pool.num_cached_blocks == 1
    assert kv.free_outside_window("a", 13) == []  # nothing more to free, nothing freed twice
    kv.check_integrity()
    kv.free("a")
    assert kv.num_free_blocks == 10
    kv.check_integrity()
    # the same prompt again: the dead blocks need no hit, the chain goes on to the window's cached block
    assert kv.allocate("b", C + [42], first_query_pos=13) == Allocation([NULL_BLOCK, NULL_BLOCK, 0, 2], 12)
    assert kv.prefix_cache_hits == 4
    kv.check_integrity()
    kv.commit("b", C + [42])
    kv.free("b")
    assert kv.num_free_blocks == 10 and kv.pool.num_cached_blocks == 1
    kv.check_integrity()


def test_allocate_for_a_remote_prompt_takes_only_the_live_prefix_hits() -> None:
    kv = make()
    kv.allocate("a", C)
    kv.commit("a", C)
    kv.free("a")  # blocks 0, 1, 2 cached and free
    kv.window = 5
    # the prompt's first three blocks hit; the first two lie outside the window at 13: not taken
    assert kv.allocate("b", C + [42], first_query_pos=13) == Allocation([NULL_BLOCK, NULL_BLOCK, 2, 3], 12)
    assert [kv.pool.ref_count(b) for b in range(4)] == [0, 0, 1, 1] and kv.num_used_blocks == 2
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (25, 12)
    kv.check_integrity()
    kv.commit("b", C + [42])  # the hash chain was kept: nothing is re-hashed or cached twice
    assert kv.get_computed_blocks(C + [42]) == ([0, 1, 2], 12)
    kv.check_integrity()
    kv.free("b")
    assert kv.num_free_blocks == 10
    kv.check_integrity()


def test_allocate_with_a_first_query_but_no_window_reserves_everything() -> None:
    kv = make()
    assert kv.blocks_outside_window(100) == 0
    assert kv.allocate("a", C + [42], first_query_pos=13) == Allocation([0, 1, 2, 3], 0)


def test_free_outside_window_keeps_the_blocks_a_transfer_reads() -> None:
    kv = make()
    kv.window = 4
    kv.allocate("a", C)
    kv.commit("a", C)
    assert kv.free_outside_window("a", 12, keep_from=1) == [0]  # block 1 is dead too, but still being sent
    assert kv.free_outside_window("a", 12, keep_from=0) == []
    assert kv.free_outside_window("a", 12) == [1]
    assert kv.block_table("a") == [NULL_BLOCK, NULL_BLOCK, 2]
    kv.check_integrity()

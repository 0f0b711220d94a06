"""Per-request block tables on top of a ``BlockPool``: the paged-KV API the prefill and decode engines call.

Lifecycle of a request: ``allocate`` (reuse the cached prefix, reserve blocks for the rest of the prompt, or with
a sliding window only for its first chunk: ``append_slots`` adds the next chunks' as ``free_outside_window`` drops
the dead ones) ->
the engine (or a remote prefill) writes KV -> ``commit`` (enter the now-written full blocks in the prefix
cache) -> ``append_slots`` / ``commit`` per decode step, ``truncate`` on speculative rollback, ``fork`` for
parallel sampling -> ``free``.

Invariant that keeps writes safe: the only block of a table that the request may still write into is its
last, partially filled block, and that block is always private (ref count 1) and never in the hash map.
Every other block is full, so it can be shared and cached. ``fork`` and ``truncate`` restore the invariant by
copy-on-write and hand the caller the (src, dst) block copies to perform on the KV tensors.

Expected shortfalls (not enough free blocks) return None and change nothing; caller bugs are asserts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.kv.block_hash import BlockHash, hash_block, tail_key
from common.kv.block_pool import BlockPool
from common.kv.kv_events import DEFAULT_LOG_CAPACITY, KVEventBatch, KVEventLog

if TYPE_CHECKING:
    from common.kv.offload import Tier

NULL_BLOCK = -1
"""A table slot with no block because it is wholly outside every layer's sliding window: freed early
(``free_outside_window``), or never given one (``allocate`` with a ``first_query_pos``: a decode node receiving
only the window's blocks). Attention never reads it (the metadata maps it to block 0, masked by the window);
``commit`` hashes its tokens (the chain goes on) but caches nothing for it."""

BlockCopy = tuple[int, int]
"""(src_block_id, dst_block_id): copy the KV of ``src`` into ``dst`` before the next write to ``dst``."""


@dataclass(frozen=True)
class Allocation:
    """The result of admitting a request: its block table (the whole prompt's, or its first chunk's when allocated
    with ``max_new_tokens``) and how much of the prompt is cached."""

    block_ids: list[int]
    # The first num_cached_tokens prompt tokens already have KV in block_ids (or, allocated with a first_query_pos,
    # lie outside the window: their KV is needed nowhere here); compute the rest.
    num_cached_tokens: int


@dataclass
class _RequestBlocks:
    block_ids: list[int]
    num_tokens: int
    salt: bytes | None
    # Chained hashes of this request's leading full blocks whose KV is known to be written, in order. A
    # block may be missing from the pool's hash map (an identical block was cached first) but its hash is
    # still needed as the parent of the next one.
    block_hashes: list[BlockHash] = field(default_factory=list)


class KVCacheManager:
    """Block tables keyed by request id, with prefix caching by chained hashes of full blocks."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self._requests: dict[str, _RequestBlocks] = {}
        # In tokens, like vLLM's prefix-cache metrics: counted once per admitted request (not on a failed
        # allocate, which is retried), and only while prefix caching is enabled.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.offload: Tier | None = None  # the tier under the pool (set_offload); None: evicted blocks are gone
        self.offload_hits = 0  # prompt tokens restored from it, in tokens like prefix_cache_hits (a part of them)
        self.tail_hits = 0  # of those, tokens of partly filled blocks (``allocate``'s ``tail``)
        # Set when every layer (a draft model's too) has a sliding window: the largest one. Blocks wholly before
        # every window are then freed early (free_outside_window); None: a request keeps all its blocks.
        self.window: int | None = None

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to new allocations (free, including evictable cached blocks)."""
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one request."""
        return self.pool.num_used_blocks

    @property
    def usage(self) -> float:
        """Fraction of KV blocks held by requests (the ``kv_usage`` gauge)."""
        return self.pool.usage

    @property
    def keeps_tails(self) -> bool:
        """Whether ``free`` keeps a request's last, partly filled block (given its tokens): an offload tier, no
        sliding window."""
        return self.offload is not None and self.window is None

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` fresh blocks are free right now (ignores prefix hits)."""
        return num_blocks <= self.pool.num_free_blocks

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` holds a block table."""
        return request_id in self._requests

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table.

        Token ``i`` lives in slot ``i % block_size`` of block ``block_ids[i // block_size]``.
        """
        return list(self._requests[request_id].block_ids)

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request's table holds (its ``NULL_BLOCK`` slots hold none)."""
        return sum(block_id != NULL_BLOCK for block_id in self._requests[request_id].block_ids)

    def num_tokens(self, request_id: str) -> int:
        """Number of token slots the request's table holds."""
        return self._requests[request_id].num_tokens

    def get_computed_blocks(self, token_ids: Sequence[int], salt: bytes | None = None) -> tuple[list[int], int]:
        """Return the longest cached prefix of full blocks of a prompt and its length in tokens.

        Capped so at least one prompt token is left to compute: the engine needs the last token's logits.
        A pure query: no ref counts or counters change.
        """
        assert len(token_ids) > 0, "empty prompt"
        if not self.enable_prefix_caching:
            return [], 0
        block_ids, _ = self._match_prefix(token_ids, salt)
        return block_ids, len(block_ids) * self.block_size

    # ------------------------------------------------------------------ prefix-cache events

    def enable_events(self, capacity: int = DEFAULT_LOG_CAPACITY) -> None:
        """Start recording prefix-cache events (``common.kv.kv_events``); a no-op when already recording."""
        if self.pool.events is None:
            self.pool.events = KVEventLog(capacity)

    def disable_events(self) -> None:
        """Stop recording and drop what was not drained."""
        self.pool.events = None

    def drain_events(self) -> KVEventBatch | None:
        """The events recorded since the last drain (None when none, or when not recording)."""
        return self.pool.events.drain(self.pool.digest) if self.pool.events is not None else None

    def set_offload(self, tier: Tier | None) -> None:
        """Keep evicted full blocks in ``tier`` and restore them on a prefix hit (None: off)."""
        assert tier is None or self.enable_prefix_caching, "an offload tier is indexed by the prefix cache"
        self.offload = tier
        self.pool.on_evict = None if tier is None else tier.save
        self.pool.on_free = None if tier is None else tier.offer

    # ------------------------------------------------------------------ mutations

    def allocate(self, request_id: str, token_ids: Sequence[int], salt: bytes | None = None,
                 first_query_pos: int = 0, max_new_tokens: int | None = None,
                 tail: bool = True) -> Allocation | None:
        """Admit a new request: reuse its cached prefix and reserve fresh blocks for the rest of the prompt.

        ``first_query_pos``: the lowest position this node will compute a query for (a decode node receiving the
        prompt's KV: the prompt's length; never below the cached prefix's end, whose tokens are not computed).
        With ``window`` set, the leading blocks no such query reads (``blocks_outside_window``) get no block: their
        slots are ``NULL_BLOCK`` from the start, a cached one is not taken, and nothing is restored into them; they
        need no hit either (their hashes only carry the chain on to the blocks that do), and they count as cached:
        their KV is needed neither here nor from elsewhere.

        ``max_new_tokens``: slots only for the cached prefix and this many prompt tokens after it (a first chunk;
        None: the whole prompt). The table then holds fewer tokens than the prompt, and ``append_slots`` grows it
        chunk by chunk, so a windowed request that frees its dead blocks as it goes never holds the whole prompt.

        ``tail``: past the last full block found, look in the offload tier for a request's last, partly filled
        block that an earlier request left there (``free`` with its tokens: a conversation's previous turn): its
        KV is restored into the first new block and its tokens count as cached, so the prompt is computed from
        exactly where the history ends, not from its last full block (token-granular reuse, as SGLang's radix
        cache; a decode node whose prompt KV arrives in whole blocks passes False).
        """
        assert request_id not in self._requests, f"request {request_id!r} already has blocks"
        assert len(token_ids) > 0, "empty prompt"
        assert max_new_tokens is None or max_new_tokens > 0, f"max_new_tokens must be > 0, got {max_new_tokens}"
        # At least the prompt's last token keeps a block (as a prefix hit leaves one token to compute).
        num_dead = min(self.blocks_outside_window(first_query_pos), (len(token_ids) - 1) // self.block_size)
        cached_ids: list[int] = []
        cached_hashes: list[BlockHash] = []
        if self.enable_prefix_caching:
            cached_ids, cached_hashes = self._match_prefix(token_ids, salt, num_dead)
        # The first query computed is at the cached prefix's end at the earliest: hits wholly before its window are
        # not taken either (they stay cached where they are; a no-op without a window).
        num_dead = max(num_dead, min(self.blocks_outside_window(len(cached_ids) * self.block_size), len(cached_ids)))
        live_hits = cached_ids[num_dead:]
        # The hash chain goes on in the offload tier: blocks it holds past the pool's hits are restored below
        # (past the dead blocks too: the match above only ends at a miss after them).
        offloaded = self._match_offloaded(token_ids, salt, cached_hashes) if self.offload is not None else []
        num_cached_tokens = max(len(cached_hashes) + len(offloaded), num_dead) * self.block_size
        tail_hash, tail_len = None, 0
        if tail and self.keeps_tails:
            tail_hash, tail_len = self._match_tail(token_ids, salt, cached_hashes + offloaded)
            num_cached_tokens += tail_len
        num_tokens = len(token_ids)
        if max_new_tokens is not None:
            num_tokens = min(num_tokens, num_cached_tokens + max_new_tokens)
        num_new = self.blocks_needed(num_tokens) - max(num_dead, len(cached_ids))
        # A hit on a free cached block takes it out of the free queue, so it no longer counts as free.
        num_revived = sum(self.pool.ref_count(block_id) == 0 for block_id in live_hits)
        if num_new > self.pool.num_free_blocks - num_revived:
            return None
        # Touch before allocating so get_new_blocks can't evict the very blocks we are reusing.
        self.pool.touch(live_hits)
        restored: list[BlockHash] = []
        if offloaded or tail_hash is not None:
            # the next new blocks take the tier's KV (full ones are cached at once, as written blocks are)
            assert self.offload is not None and len(cached_ids) >= num_dead  # the match never ends before them
            # the pool's evictions below are saved without displacing them
            self.offload.pin(offloaded if tail_hash is None else [*offloaded, tail_hash])
            try:
                new_ids = self.pool.get_new_blocks(num_new)
            finally:
                self.offload.unpin()
            if tail_hash is not None:  # private to this request, which writes its remaining slots: not cached
                self.offload.load(tail_hash, new_ids[len(offloaded)])
            for block_id, block_hash in zip(new_ids, offloaded, strict=False):
                self.offload.load(block_hash, block_id)
                self.pool.cache_block(block_id, block_hash)
                restored.append(block_hash)
            if restored and self.pool.events is not None:  # findable again: a router's view must say so
                bs = self.block_size
                start = len(cached_hashes)
                self.pool.events.stored(restored, cached_hashes[-1] if cached_hashes else None,
                                        tuple(token_ids[start * bs : (start + len(restored)) * bs]), bs)
        else:
            new_ids = self.pool.get_new_blocks(num_new)
        assert len(restored) == len(offloaded)  # the table holds at least one token past them
        block_ids = [NULL_BLOCK] * num_dead + live_hits + new_ids
        self._requests[request_id] = _RequestBlocks(block_ids, num_tokens, salt, cached_hashes + restored)
        if self.enable_prefix_caching:
            self.prefix_cache_queries += len(token_ids)
            # only blocks found here (a dead one too, though it is not taken), not those merely outside the window
            found = sum(block_id != NULL_BLOCK for block_id in cached_ids) + len(restored)
            self.prefix_cache_hits += found * self.block_size + tail_len
            self.offload_hits += len(restored) * self.block_size + tail_len
            self.tail_hits += tail_len
        return Allocation(list(block_ids), num_cached_tokens)

    def append_slots(self, request_id: str, num_new_tokens: int) -> list[int] | None:
        """Grow the table by ``num_new_tokens`` slots; return the newly added block ids ([] if none needed)."""
        assert num_new_tokens >= 0, f"num_new_tokens must be >= 0, got {num_new_tokens}"
        req = self._requests[request_id]
        num_new = self.blocks_needed(req.num_tokens + num_new_tokens) - len(req.block_ids)
        if num_new > self.pool.num_free_blocks:
            return None
        new_ids = self.pool.get_new_blocks(num_new)
        req.block_ids.extend(new_ids)
        req.num_tokens += num_new_tokens
        return new_ids

    def commit(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Enter every full block of ``token_ids`` (a prefix of the request whose KV is now written) in the cache.

        Blocks become findable only here, never at allocation: a decode node reserves blocks before the
        remote prefill has filled them. Tokens of blocks committed earlier are trusted, not re-hashed.
        """
        req = self._requests[request_id]
        assert len(token_ids) <= req.num_tokens, f"commit of {len(token_ids)} tokens, table holds {req.num_tokens}"
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        first = len(req.block_hashes)
        parent = req.block_hashes[-1] if req.block_hashes else None
        events = self.pool.events
        stored: list[int] | None = [] if events is not None else None  # indexes of blocks newly cached here
        for index in range(first, len(token_ids) // bs):
            parent = hash_block(parent, token_ids[index * bs : (index + 1) * bs], req.salt)
            req.block_hashes.append(parent)
            block_id = req.block_ids[index]
            if block_id == NULL_BLOCK:  # outside the window from the start (allocate): no KV here to cache
                continue
            existing = self.pool.get_block_hash(block_id)
            if existing is None:
                if self.pool.cache_block(block_id, parent) and stored is not None:
                    stored.append(index)
            else:
                # A forked sibling sharing this block committed it first.
                assert existing == parent, f"block {block_id} is cached under a different hash"
        if stored and events is not None:
            self._record_stored(events, req, token_ids, stored)

    def fork(self, parent_id: str, child_id: str) -> list[BlockCopy] | None:
        """Give ``child_id`` the parent's tokens: full blocks shared, the partial last block copied on write."""
        assert child_id not in self._requests, f"request {child_id!r} already has blocks"
        parent = self._requests[parent_id]
        num_full = parent.num_tokens // self.block_size
        partial = len(parent.block_ids) > num_full
        if partial and self.pool.num_free_blocks < 1:
            return None
        shared = parent.block_ids[:num_full]
        self.pool.touch(b for b in shared if b != NULL_BLOCK)
        copies: list[BlockCopy] = []
        child_ids = list(shared)
        if partial:
            (dst,) = self.pool.get_new_blocks(1)
            copies.append((parent.block_ids[-1], dst))
            child_ids.append(dst)
        self._requests[child_id] = _RequestBlocks(child_ids, parent.num_tokens, parent.salt, list(parent.block_hashes))
        return copies

    def truncate(self, request_id: str, num_tokens: int) -> list[BlockCopy] | None:
        """Shrink the request to its first ``num_tokens`` tokens (speculative-decoding rollback).

        Blocks past the end are freed, tail first. If the new last block is partial, the request will
        overwrite its tail slots, so it must be private and uncached again:
        * shared (ref > 1): copy-on-write into a fresh block, returned as a (src, dst) copy; the original
          keeps its hash, which is still true for the other holders;
        * private (ref 1) and cached: its hash is dropped (the cheap choice over copying to keep the entry).
        Returns the copies to perform (usually none), or None without changes if no block is free for one.
        """
        req = self._requests[request_id]
        assert 0 <= num_tokens <= req.num_tokens, f"truncate to {num_tokens} of {req.num_tokens} tokens"
        bs = self.block_size
        num_keep = self.blocks_needed(num_tokens)
        dropped = req.block_ids[num_keep:]
        last = req.block_ids[num_keep - 1] if num_tokens % bs else None
        needs_copy = last is not None and self.pool.ref_count(last) > 1
        if needs_copy:
            # The dropped blocks this request alone holds become free before the copy is allocated.
            freed = sum(self.pool.ref_count(block_id) == 1 for block_id in dropped)
            if self.pool.num_free_blocks + freed < 1:
                return None
        self.pool.free_blocks(reversed(dropped))
        del req.block_ids[num_keep:]
        del req.block_hashes[num_tokens // bs :]
        req.num_tokens = num_tokens
        copies: list[BlockCopy] = []
        if last is not None:
            if needs_copy:
                (dst,) = self.pool.get_new_blocks(1)
                self.pool.free_blocks([last])
                req.block_ids[-1] = dst
                copies.append((last, dst))
            else:
                self.pool.uncache_block(last)
        return copies

    def free(self, request_id: str, computed_token_ids: Sequence[int] | None = None) -> None:
        """Release the request's blocks, tail first so its last blocks are evicted before its shared head.

        ``computed_token_ids``: the request's tokens whose KV is written (its prompt, and its output but the last
        token): with an offload tier its last, partly filled block is kept there first, under ``tail_key``, for
        a later prompt that goes on from exactly these tokens (``allocate``'s ``tail``: the conversation's next
        turn). Full blocks take the usual way (cached, offered to the tier when freed)."""
        req = self._requests.pop(request_id)
        if computed_token_ids is not None and self.keeps_tails:
            self._keep_tail(req, computed_token_ids)
        self.pool.free_blocks(b for b in reversed(req.block_ids) if b != NULL_BLOCK)

    def blocks_outside_window(self, first_query_pos: int) -> int:
        """Leading blocks no query at ``first_query_pos`` or later reads (0 without ``window``).

        A query at position q reads positions q - window + 1 .. q, so block i (positions i*bs .. (i+1)*bs - 1) is
        dead once (i+1)*bs <= first_query_pos - window + 1.
        """
        if self.window is None:
            return 0
        return max(0, first_query_pos - self.window + 1) // self.block_size

    def free_outside_window(self, request_id: str, first_query_pos: int, keep_from: int | None = None) -> list[int]:
        """Free the blocks no query at ``first_query_pos`` or later can read; return their ids, head first.

        Only with ``window`` set. The caller passes the lowest position any later step computes
        (``num_computed_tokens``: rollbacks never go below it), and in ``keep_from`` the first block something
        else still reads (a KV transfer sending it: ``KVConnector.kv_read_from``), which stays. Freed blocks go
        through the pool's normal free path, so they stay cached (and findable) until evicted; their table slots
        become ``NULL_BLOCK``. With prefix caching only committed blocks are freed (commit reads the table).
        """
        req = self._requests[request_id]
        if self.window is None:
            return []
        num_dead = min(self.blocks_outside_window(first_query_pos), req.num_tokens // self.block_size)
        if keep_from is not None:
            num_dead = min(num_dead, keep_from)
        if self.enable_prefix_caching:
            num_dead = min(num_dead, len(req.block_hashes))
        freed = [b for b in req.block_ids[:num_dead] if b != NULL_BLOCK]
        if freed:
            self.pool.free_blocks(freed)
            req.block_ids[:num_dead] = [NULL_BLOCK] * num_dead
        return freed

    # ------------------------------------------------------------------ internals

    def _match_offloaded(self, token_ids: Sequence[int], salt: bytes | None, cached: list[BlockHash]
                         ) -> list[BlockHash]:
        """The hashes of the prompt's full blocks after the pool's hits that the tier holds, in order, stopping at
        the first it does not; at least one prompt token is left to compute (as ``_match_prefix``)."""
        assert self.offload is not None
        bs = self.block_size
        parent = cached[-1] if cached else None
        out: list[BlockHash] = []
        for index in range(len(cached), (len(token_ids) - 1) // bs):
            parent = hash_block(parent, token_ids[index * bs : (index + 1) * bs], salt)
            if not self.offload.holds(parent) or self.pool.get_cached_block(parent) is not None:
                break
            out.append(parent)
        return out

    def _match_tail(self, token_ids: Sequence[int], salt: bytes | None, full: list[BlockHash]
                    ) -> tuple[BlockHash | None, int]:
        """The tier's longest partly filled block that goes on from the prompt's ``full`` blocks (their hashes) with
        the prompt's next tokens, leaving at least one to compute, and its length (None, 0: none)."""
        assert self.offload is not None
        bs = self.block_size
        start = len(full) * bs
        parent = full[-1] if full else None
        for length in range(min(bs - 1, len(token_ids) - 1 - start), 0, -1):
            key = tail_key(parent, token_ids[start : start + length], salt)
            if self.offload.holds(key):
                return key, length
        return None, 0

    def _keep_tail(self, req: _RequestBlocks, computed: Sequence[int]) -> None:
        assert self.offload is not None
        bs = self.block_size
        num_full, length = divmod(min(len(computed), req.num_tokens), bs)
        # Every full block of computed tokens is committed (the scheduler commits each as it fills): its hash is there.
        if length == 0 or req.block_ids[num_full] == NULL_BLOCK or len(req.block_hashes) < num_full:
            return
        parent = req.block_hashes[num_full - 1] if num_full else None
        start = num_full * bs
        self.offload.save_tail(req.block_ids[num_full], tail_key(parent, computed[start : start + length], req.salt))

    def _record_stored(self, events: KVEventLog, req: _RequestBlocks, token_ids: Sequence[int],
                       indexes: list[int]) -> None:
        # One event per contiguous run of newly cached blocks: a block another request cached first (same
        # hash, other block id) is already known to routers and splits the run.
        bs = self.block_size
        runs: list[list[int]] = []
        for index in indexes:
            if runs and runs[-1][-1] == index - 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        for run in runs:
            start, end = run[0], run[-1] + 1
            parent = req.block_hashes[start - 1] if start > 0 else None
            events.stored(req.block_hashes[start:end], parent, tuple(token_ids[start * bs : end * bs]), bs)

    def _match_prefix(self, token_ids: Sequence[int], salt: bytes | None,
                      num_unread: int = 0) -> tuple[list[int], list[BlockHash]]:
        """The cached blocks of the prompt's leading full blocks and their hashes. The first ``num_unread`` need
        no hit (outside the window: ``NULL_BLOCK`` when not cached); after them it stops at the first miss."""
        # Stop at the first miss: chained hashes mean no later block can hit once one block misses.
        bs = self.block_size
        parent: BlockHash | None = None
        block_ids: list[int] = []
        hashes: list[BlockHash] = []
        for index in range((len(token_ids) - 1) // bs):
            parent = hash_block(parent, token_ids[index * bs : (index + 1) * bs], salt)
            block_id = self.pool.get_cached_block(parent)
            if block_id is None:
                if index >= num_unread:
                    break
                block_id = NULL_BLOCK
            block_ids.append(block_id)
            hashes.append(parent)
        return block_ids, hashes

    def check_integrity(self) -> None:
        """Assert the pool's invariants and that ref counts, tables and hashes agree; tests call it often."""
        self.pool.check_integrity()
        bs = self.block_size
        refs = [0] * self.pool.num_blocks
        for request_id, req in self._requests.items():
            assert len(req.block_ids) == self.blocks_needed(req.num_tokens), (
                f"{request_id}: {len(req.block_ids)} blocks for {req.num_tokens} tokens"
            )
            live = [b for b in req.block_ids if b != NULL_BLOCK]
            assert len(set(live)) == len(live), f"{request_id}: block listed twice"
            dead = len(req.block_ids) - len(live)
            if dead:  # freed early (free_outside_window): a leading run of full blocks
                assert self.window is not None, f"{request_id}: freed slot without a window"
                assert req.block_ids[:dead] == [NULL_BLOCK] * dead, f"{request_id}: freed slots not a leading run"
            assert len(req.block_hashes) <= req.num_tokens // bs, f"{request_id}: hash of a partial block"
            for index, block_id in enumerate(req.block_ids):
                if block_id == NULL_BLOCK:
                    continue
                refs[block_id] += 1
                block_hash = self.pool.get_block_hash(block_id)
                if block_hash is None:
                    continue
                assert index < req.num_tokens // bs, f"{request_id}: partial block {block_id} is cached"
                if index < len(req.block_hashes):
                    assert block_hash == req.block_hashes[index], f"{request_id}: block {block_id} hash differs"
            if req.num_tokens % bs:
                assert self.pool.ref_count(req.block_ids[-1]) == 1, f"{request_id}: shared partial block"
        for block_id, count in enumerate(refs):
            assert self.pool.ref_count(block_id) == count, (
                f"block {block_id}: ref count {self.pool.ref_count(block_id)}, {count} table references"
            )

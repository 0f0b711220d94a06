"""The KV offload tier under a node's paged pool (``--kv-offload cpu|disk``): evicted full blocks are kept, by their
prefix-cache hash, in a larger store, and come back on a prefix hit instead of being recomputed.

- ``OffloadIndex`` (pure Python): which block hashes the store holds and in which slot, LRU over a fixed number of
  slots. The prefix cache's hash chain indexes both tiers: a prompt's blocks are matched in the pool first, then
  the chain goes on in the index (``KVCacheManager.allocate``).
- ``OffloadStore``: the slots themselves, ``[slots, *one block of the KV cache]``, in host memory (``cpu``: the
  tier of a GPU pool, or simply more blocks than the pool) or in a file mapped into memory (``disk``: a local
  file, its pages read from the page cache or the disk), and the two copies: ``save`` (a block the pool is about
  to reuse, copied out while its KV is still there) and ``load`` (a slot into a block just allocated).
- ``OffloadTier`` joins them behind the small interface the pure-Python manager calls (``Tier``).

Saves are written behind, off the step (``Copier``: a thread on CPU, a side CUDA stream on GPU, as vLLM's
offloading connector and SGLang's HiCache write back): a cached block whose last reference goes (its request
finished or was preempted) is offered to the tier (``BlockPool.on_free``) and copied out in the background while
it sits in the pool's free queue. Its KV cannot change meanwhile: a free block is written again only after
``get_new_blocks`` hands it out, and that eviction (``BlockPool.on_evict``) first waits for the block's copy
to land (by then long done: the queue evicts the least recently freed). A block evicted without an earlier offer
is saved synchronously there. A load runs inside ``allocate`` (the block is valid before any step or transfer
reads it), after any copy still writing its slot. One block is ``num_layers * 2 * block_size * heads * head_dim``
elements: a memcpy, against recomputing its tokens through every layer (benchmarks/bench_offload.py). A draft
model's KV at the same block ids is not offloaded, so ``--speculative draft_model`` refuses the tier.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from common.kv.block_hash import BlockHash

if TYPE_CHECKING:
    import torch

    from common.kv.kv_cache import KVCache

OFFLOAD_KINDS = ("none", "cpu", "disk", "shared")  # shared: common/kv/shared_tier.py


class Tier(Protocol):
    """What ``KVCacheManager`` asks of an offload tier (block ids are the pool's)."""

    def holds(self, block_hash: BlockHash) -> bool: ...

    def offer(self, block_id: int, block_hash: BlockHash) -> None:
        """Pool block ``block_id`` (cached under ``block_hash``) has just been freed: keep a copy, in the background
        if the tier writes behind; its KV stays unchanged until ``save`` is called for it (its eviction)."""

    def save(self, block_id: int, block_hash: BlockHash) -> None:
        """Keep the KV of pool block ``block_id`` (about to be reused) under ``block_hash``."""

    def save_tail(self, block_id: int, key: BlockHash) -> None:
        """Keep the KV of pool block ``block_id``, a finished request's last, partly filled block, under ``key``
        (``block_hash.tail_key``). The block is not cached in the pool, so it may be written again as soon as this
        returns: copy it now (or a snapshot of it)."""

    def load(self, block_hash: BlockHash, block_id: int) -> None:
        """Write the KV kept under ``block_hash`` into pool block ``block_id``; it must be held."""

    def pin(self, block_hashes: Sequence[BlockHash]) -> None:
        """Keep these entries while a restore of them allocates (its evictions must not displace them)."""

    def unpin(self) -> None: ...


class OffloadIndex:
    """Block hash -> slot for ``num_slots`` slots, least recently used evicted first. Pure Python."""

    def __init__(self, num_slots: int) -> None:
        assert num_slots > 0, f"num_slots must be positive, got {num_slots}"
        self.num_slots = num_slots
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.pinned: frozenset[BlockHash] = frozenset()  # never displaced (a restore in progress)
        self.hits = self.saves = self.evictions = self.dropped = 0

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slots

    def slot_of(self, block_hash: BlockHash) -> int | None:
        """The slot holding ``block_hash`` (now the most recently used), or None."""
        slot = self._slots.get(block_hash)
        if slot is not None:
            self._slots.move_to_end(block_hash)
            self.hits += 1
        return slot

    def reserve(self, block_hash: BlockHash) -> int | None:
        """A slot for ``block_hash``: its own if held, else a free one or the least recently used unpinned one's;
        None when every slot is pinned (the block is not kept)."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return self._slots[block_hash]
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h in self._slots if h not in self.pinned), None)
            if victim is None:
                self.dropped += 1
                return None
            slot = self._slots.pop(victim)
            self.evictions += 1
        self._slots[block_hash] = slot
        self.saves += 1
        return slot

    def check_integrity(self) -> None:
        held = list(self._slots.values())
        assert len(set(held)) == len(held), "a slot holds two hashes"
        assert not set(held) & set(self._free), "a held slot is also free"
        assert len(held) + len(self._free) == self.num_slots, "slots lost"


class Copier(Protocol):
    """Runs block copies off the engine's step, in the order submitted; a handle says when one has landed."""

    def submit(self, dst: torch.Tensor, src: torch.Tensor) -> object: ...

    def done(self, handle: object) -> bool: ...

    def wait(self, handle: object) -> None: ...

    def close(self) -> None: ...


class ThreadCopier:
    """CPU: one background thread copies (``Tensor.copy_`` releases the GIL), first submitted first."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-offload")

    def submit(self, dst: torch.Tensor, src: torch.Tensor) -> object:
        return self._pool.submit(dst.copy_, src)

    def done(self, handle: object) -> bool:
        return bool(handle.done())  # type: ignore[attr-defined]

    def wait(self, handle: object) -> None:
        handle.result()  # type: ignore[attr-defined]  # a failed copy raises here, in the engine thread

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class StreamCopier:
    """CUDA: copies on a side stream into pinned host memory, each after what the compute stream has queued so far
    (the step that wrote the block); an event per copy says when it landed."""

    def __init__(self, device: torch.device) -> None:
        import torch

        self._torch = torch
        self._stream = torch.cuda.Stream(device=device)

    def submit(self, dst: torch.Tensor, src: torch.Tensor) -> object:
        torch = self._torch
        self._stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return event

    def done(self, handle: object) -> bool:
        return bool(handle.query())  # type: ignore[attr-defined]

    def wait(self, handle: object) -> None:
        handle.synchronize()  # type: ignore[attr-defined]

    def close(self) -> None:
        self._stream.synchronize()


def copier_for(device: torch.device) -> Copier:
    return StreamCopier(device) if device.type == "cuda" else ThreadCopier()


class OffloadStore:
    """``num_slots`` blocks of ``kv_cache``'s shape in host memory or a memory-mapped file."""

    def __init__(self, kv_cache: KVCache, num_slots: int, path: Path | None = None) -> None:
        import torch

        self.kv_cache = kv_cache  # its ``data`` may be rebound (shared memory): read at each copy
        block = tuple(kv_cache.data.shape[1:])
        dtype = kv_cache.data.dtype
        self.path = path
        if path is None:  # pinned when the pool is on a GPU: the side stream's copies are then asynchronous
            self.data = torch.empty((num_slots, *block), dtype=dtype, pin_memory=kv_cache.data.is_cuda)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            numel = num_slots * kv_cache.data[0].numel()
            # A file of the store's size, mapped shared: the pages go to the file (and the page cache), not to
            # the process's memory. Its name is removed at once: the mapping keeps the file until the process
            # ends, however it ends (a killed node leaves no tier file behind).
            self.data = torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(num_slots, *block)
            path.unlink()

    @property
    def bytes_per_slot(self) -> int:
        return int(self.data[0].numel() * self.data.element_size())

    def save(self, block_id: int, slot: int) -> None:
        self.data[slot].copy_(self.kv_cache.data[block_id])

    def save_later(self, copier: Copier, block_id: int, slot: int) -> object:
        """``save`` through ``copier``; the views are taken now (``kv_cache.data`` may be rebound later)."""
        return copier.submit(self.data[slot], self.kv_cache.data[block_id])

    def load(self, slot: int, block_id: int) -> None:
        self.kv_cache.data[block_id].copy_(self.data[slot], non_blocking=self.kv_cache.data.is_cuda)

    def close(self) -> None:
        if self.path is not None:
            del self.data  # the last mapping of the (already unlinked) file: its blocks go back to the disk


class OffloadTier:
    """An ``OffloadIndex`` over an ``OffloadStore``: the ``Tier`` the manager calls. With a ``copier`` it writes
    behind (``offer`` copies freed blocks in the background); without, it saves only at eviction, synchronously."""

    def __init__(self, store: OffloadStore, index: OffloadIndex, copier: Copier | None = None) -> None:
        self.store, self.index, self.copier = store, index, copier
        # Copies submitted and not yet seen landed: by pool block (its KV must not change before) and by slot
        # (a load must not read it before). Both point at the same handles; landed ones are dropped lazily.
        self._pending_block: dict[int, object] = {}
        self._pending_slot: dict[int, object] = {}
        self.waits = 0  # evictions or loads that had to wait for a copy still running (should stay near 0)

    @classmethod
    def create(cls, kind: str, kv_cache: KVCache, size_gb: float, directory: Path,
               write_behind: bool = True) -> OffloadTier:
        """``kind`` cpu (host memory) or disk (a file under ``directory``) of ``size_gb`` GiB."""
        if kind not in ("cpu", "disk"):
            raise ValueError(f"kv_offload must be cpu or disk to create a private tier, got {kind!r}")
        per_block = kv_cache.data[0].numel() * kv_cache.data.element_size()
        slots = int(size_gb * 2**30) // per_block
        if slots < 1:
            raise ValueError(f"kv_offload_gb {size_gb} holds no block of {per_block} bytes")
        import os

        path = directory / f"kv-offload-{os.getpid()}-{id(kv_cache):x}.bin" if kind == "disk" else None
        copier = copier_for(kv_cache.data.device) if write_behind else None
        return cls(OffloadStore(kv_cache, slots, path), OffloadIndex(slots), copier)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def num_pending(self) -> int:
        self._reap()
        return len(self._pending_block)

    def holds(self, block_hash: BlockHash) -> bool:
        return block_hash in self.index

    def offer(self, block_id: int, block_hash: BlockHash) -> None:
        if self.copier is None:
            return
        if block_hash in self.index:  # kept already (the same hash is the same KV): just more recently used
            self.index.reserve(block_hash)
            return
        slot = self.index.reserve(block_hash)
        if slot is None:
            return
        if len(self._pending_block) > 64:
            self._reap()
        handle = self.store.save_later(self.copier, block_id, slot)
        self._pending_block[block_id] = self._pending_slot[slot] = handle

    def save(self, block_id: int, block_hash: BlockHash) -> None:
        handle = self._pending_block.pop(block_id, None)
        if handle is not None:  # offered when freed: its copy must land before the block is written again
            self._wait(handle)
        if block_hash in self.index:  # kept from the offer (unless displaced since), or an earlier one of the same KV
            self.index.reserve(block_hash)  # more recently used, as a save is
            return
        slot = self.index.reserve(block_hash)
        if slot is not None:
            self._wait_slot(slot)  # an earlier copy into the slot (its previous hash's) lands first
            self.store.save(block_id, slot)

    def save_tail(self, block_id: int, key: BlockHash) -> None:
        if key in self.index:  # kept already (the same key is the same KV): just more recently used
            self.index.reserve(key)
            return
        slot = self.index.reserve(key)
        if slot is not None:
            self._wait_slot(slot)  # an earlier copy into the slot (its previous hash's) lands first
            self.store.save(block_id, slot)

    def load(self, block_hash: BlockHash, block_id: int) -> None:
        slot = self.index.slot_of(block_hash)
        assert slot is not None, "load of a block the tier does not hold"
        self._wait_slot(slot)
        self.store.load(slot, block_id)

    def pin(self, block_hashes: Sequence[BlockHash]) -> None:
        self.index.pinned = frozenset(block_hashes)

    def unpin(self) -> None:
        self.index.pinned = frozenset()

    def close(self) -> None:
        if self.copier is not None:
            self.copier.close()
            self._pending_block.clear()
            self._pending_slot.clear()
        self.store.close()

    def _wait(self, handle: object) -> None:
        assert self.copier is not None
        if not self.copier.done(handle):
            self.waits += 1
        self.copier.wait(handle)

    def _wait_slot(self, slot: int) -> None:
        handle = self._pending_slot.pop(slot, None)
        if handle is not None:
            self._wait(handle)

    def _reap(self) -> None:
        """Forget the copies that have landed."""
        if self.copier is None:
            return
        done = self.copier.done
        self._pending_block = {b: h for b, h in self._pending_block.items() if not done(h)}
        self._pending_slot = {s: h for s, h in self._pending_slot.items() if not done(h)}

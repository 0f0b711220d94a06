"""A KV offload tier that several nodes share (``--kv-offload shared --kv-offload-dir DIR``): one file per block.

The private tiers (``common/kv/offload.py``) keep a node's evicted blocks for that node alone. In a disaggregated
deployment a conversation's answer is decoded on a decode node, and its next turn is prefilled on a prefill node
that never saw the answer: it would compute the answer's KV again. With a shared tier every node writes the blocks
it lets go of (a finished request's prompt and answer, or an eviction) into one directory, each block a file named
by its prefix-cache hash, and every node's prefix match goes on in that directory after its own pool: the prefill
node restores the history the decode node wrote, as LMCache's shared storage and Dynamo's KVBM share blocks across
workers. The router knows (the nodes report the tier's id in their stats) and counts a decode node's conversation
history as available to the prefill nodes sharing its tier (``Router.cached_blocks``).

- Files: ``DIR/<namespace>/<hash hex>.kv``, the block's raw bytes (``num_layers * 2 * block_size * heads *
  head_dim`` elements of the cache dtype). The namespace hashes the KV layout and a fingerprint of the model's
  weights, so nodes of another model (or another quantization) sharing the directory never read these blocks.
  A file is written under a temporary name and renamed: a reader sees a whole block or none.
- Each node bounds what it wrote itself to ``--kv-offload-gb`` (least recently used first, its own files only);
  a file another node still reads stays readable after its name is removed, because readers open a file when
  they find it (``holds``) and read through that descriptor (``load``).
- Writes go behind, off the step (a background thread), as the private tiers' do: a freed block's copy is
  written while it sits in the pool's free queue, and its eviction waits for that write (``save``).
- Same host: the page cache makes a restore a memory copy. Several hosts: a shared filesystem (the figures in
  benchmarks/ are from one host).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from common.kv.block_hash import BlockHash

if TYPE_CHECKING:
    import torch

    from common.kv.kv_cache import KVCache

_SUFFIX = ".kv"


def model_fingerprint(model: torch.nn.Module) -> str:
    """A short digest of a model's weights (the first 4 KiB of every tensor, with names, shapes and dtypes):
    two nodes of the same checkpoint, dtype and quantization agree; any other model differs. A parallel node's
    skeleton (weights on the meta device, held by its ranks) contributes names, shapes and dtypes only."""
    import torch

    h = hashlib.blake2b(digest_size=16)
    tensors = [*model.named_parameters(), *model.named_buffers()]
    for name, t in tensors:
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        if t.is_meta or t.numel() == 0:
            continue
        flat = t.detach().reshape(-1)[: max(1, 4096 // max(t.element_size(), 1))]
        if flat.is_cuda:
            flat = flat.cpu()
        h.update(flat.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def namespace(kv_cache: KVCache, model_key: str) -> str:
    """The subdirectory for blocks of this layout and model: nodes agree on it exactly when they may share KV."""
    data = kv_cache.data
    layout = f"{tuple(data.shape[1:])}:{data.dtype}:{model_key}"
    return hashlib.blake2b(layout.encode(), digest_size=12).hexdigest()


class SharedTier:
    """The ``Tier`` (common/kv/offload.py) over a directory of block files that other nodes read and write too."""

    def __init__(self, kv_cache: KVCache, directory: Path, size_gb: float, model_key: str,
                 write_behind: bool = True) -> None:
        self.kv_cache = kv_cache  # its ``data`` may be rebound (shared memory): read at each copy
        self.id = namespace(kv_cache, model_key)
        self.directory = directory / self.id
        self.directory.mkdir(parents=True, exist_ok=True)
        self.bytes_per_block = kv_cache.data[0].numel() * kv_cache.data.element_size()
        self.capacity = int(size_gb * 2**30) // self.bytes_per_block
        if self.capacity < 1:
            raise ValueError(f"kv_offload_gb {size_gb} holds no block of {self.bytes_per_block} bytes")
        self._own: OrderedDict[BlockHash, None] = OrderedDict()  # files this node wrote, least recent first
        self._open: dict[BlockHash, int] = {}  # files found by ``holds``, open until loaded (or dropped)
        self._pending: dict[int, Future[None]] = {}  # pool block -> its write still running
        self._lock = threading.Lock()  # ``_own`` is touched by the writer thread too
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kv-shared-tier") if write_behind else None
        self._seq = 0
        self.waits = 0  # evictions that had to wait for a write still running
        self.hits = self.saves = self.evictions = 0

    def __len__(self) -> int:
        return len(self._own)

    # ---- Tier ------------------------------------------------------------------------------------

    def holds(self, block_hash: BlockHash) -> bool:
        if block_hash in self._open:
            return True
        if len(self._open) > 4096:  # found by lookups that never loaded (an allocation refused for room)
            self._close_all()
        try:
            fd = os.open(self._path(block_hash), os.O_RDONLY)
        except FileNotFoundError:
            return False
        if os.fstat(fd).st_size != self.bytes_per_block:  # another layout's stray file: not ours to read
            os.close(fd)
            return False
        self._open[block_hash] = fd
        return True

    def offer(self, block_id: int, block_hash: BlockHash) -> None:
        if self._executor is None or block_id in self._pending:
            return
        if self._touch(block_hash):
            return
        src = self.kv_cache.data[block_id]
        self._pending[block_id] = self._executor.submit(self._write, src, block_hash)
        if len(self._pending) > 64:
            self._pending = {b: f for b, f in self._pending.items() if not f.done()}

    def save(self, block_id: int, block_hash: BlockHash) -> None:
        future = self._pending.pop(block_id, None)
        if future is not None:  # offered when freed: its write must land before the block is written again
            if not future.done():
                self.waits += 1
            future.result()
            return
        if not self._touch(block_hash):
            self._write(self.kv_cache.data[block_id], block_hash)

    def load(self, block_hash: BlockHash, block_id: int) -> None:
        import torch

        fd = self._open.pop(block_hash, None)
        if fd is None:
            fd = os.open(self._path(block_hash), os.O_RDONLY)  # found earlier and not kept open: read it now
        try:
            dst = self.kv_cache.data[block_id]
            staging = dst if dst.device.type == "cpu" else torch.empty(dst.shape, dtype=dst.dtype)
            view = memoryview(staging.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
            done = 0
            while done < len(view):
                n = os.preadv(fd, [view[done:]], done)
                if n <= 0:
                    raise OSError(f"shared KV tier: {self._path(block_hash)} ended after {done} bytes")
                done += n
            if staging is not dst:
                dst.copy_(staging)
        finally:
            os.close(fd)
        self.hits += 1
        self._touch(block_hash)

    def pin(self, block_hashes: Sequence[BlockHash]) -> None:
        """The files to restore are open already (``holds``): their writers' evictions cannot take them. Close
        those found by probes that will not be loaded."""
        keep = set(block_hashes)
        for h in [h for h in self._open if h not in keep]:
            os.close(self._open.pop(h))

    def unpin(self) -> None:
        pass

    @property
    def num_pending(self) -> int:
        self._pending = {b: f for b, f in self._pending.items() if not f.done()}
        return len(self._pending)

    def close(self) -> None:
        """Stop writing and remove the files this node wrote (other nodes' stay)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._pending.clear()
        self._close_all()
        with self._lock:
            own, self._own = list(self._own), OrderedDict()
        for h in own:
            self._unlink(h)

    # ---- internals -------------------------------------------------------------------------------

    def _path(self, block_hash: BlockHash) -> Path:
        return self.directory / (block_hash.hex() + _SUFFIX)

    def _touch(self, block_hash: BlockHash) -> bool:
        """Mark a file this node wrote as recently used; whether one with this hash exists (any node's)."""
        with self._lock:
            if block_hash in self._own:
                self._own.move_to_end(block_hash)
                return True
        return self._path(block_hash).exists()

    def _write(self, src: torch.Tensor, block_hash: BlockHash) -> None:
        import torch

        block = src if src.device.type == "cpu" else src.to("cpu")
        data = memoryview(block.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        with self._lock:
            self._seq += 1
            tmp = self.directory / f".{os.getpid()}-{threading.get_ident()}-{self._seq}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, self._path(block_hash))  # readers see the whole block or nothing
        with self._lock:
            self._own[block_hash] = None
            self._own.move_to_end(block_hash)
            self.saves += 1
            victims = []
            while len(self._own) > self.capacity:
                victims.append(self._own.popitem(last=False)[0])
                self.evictions += 1
        for h in victims:
            self._unlink(h)

    def _unlink(self, block_hash: BlockHash) -> None:
        self._path(block_hash).unlink(missing_ok=True)

    def _close_all(self) -> None:
        for fd in self._open.values():
            os.close(fd)
        self._open.clear()

"""A KV offload tier that several nodes share (``--kv-offload shared --kv-offload-dir DIR``): one file per block.

The private tiers (``common/kv/offload.py``) keep a node's evicted blocks for that node alone. In a disaggregated
deployment a conversation's answer is decoded on a decode node, and its next turn is prefilled on a prefill node
that never saw the answer: it would compute the answer's KV again. With a shared tier every node writes the blocks
it lets go of (a finished request's prompt and answer, or an eviction) into one directory, each block a file named
by its prefix-cache hash, and every node's prefix match goes on in that directory after its own pool: the prefill
node restores the history the decode node wrote, as LMCache's shared storage and Dynamo's KVBM share blocks across
workers. The router knows (the nodes report the tier's id in their stats) and counts a decode node's conversation
history as available to the prefill nodes sharing its tier (``Router.cached_blocks``).

- Files: ``DIR/<namespace>/<writer>/<hash hex>.kv``, the block's raw bytes (``num_layers * 2 * block_size *
  heads * head_dim`` elements of the cache dtype). The namespace hashes the KV layout and a fingerprint of the
  model's weights, so nodes of another model (or another quantization) sharing the directory never read these
  blocks. A file is written under a temporary name and renamed: a reader sees a whole block or none. A lookup
  tries the node's own directory, then every other writer's (listed again at most every ``RESCAN_S``).
- Each node writes only under its own ``<writer>`` directory and bounds it to ``--kv-offload-gb`` (least recently
  used first); a file another node still reads stays readable after its name is removed, because readers open a
  file when they find it (``holds``) and read through that descriptor (``load``).
- Nothing outlives its writer: a node removes its directory when it stops, and holds an exclusive ``flock`` on
  ``<writer>.lock`` while it runs; the kernel drops that lock however the process ends, so the next node to list
  the writers (any node on the directory, at its start or a rescan) finds the lock free and removes the dead
  writer's files (``reap_dead_writers``).
- Writes go behind, off the step (a background thread), as the private tiers' do: a freed block's copy is
  written while it sits in the pool's free queue, and its eviction waits for that write (``save``).
- Same host: the page cache makes a restore a memory copy. Several hosts: a shared filesystem (the figures in
  benchmarks/ are from one host).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import threading
import time
import uuid
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
_LOCK = ".lock"
RESCAN_S = 0.5  # how stale a node's list of the other writers' directories may be


def model_fingerprint(model: torch.nn.Module) -> str:
    """A short digest of a model's weights (the first 4 KiB of every tensor, with names, shapes and dtypes):
    two nodes of the same checkpoint, dtype and quantization agree; any other model differs. A parallel node's
    skeleton (weights on the meta device, held by its ranks) contributes names, shapes and dtypes only."""
    import torch

    h = hashlib.blake2b(digest_size=16)
    # Not a second copy of a weight in another library's layout (oneDNN's, common/model/gemv.py): whether a node
    # holds one is measured per process, so it would split nodes of one model.
    tensors = [(n, t) for n, t in (*model.named_parameters(), *model.named_buffers()) if not t.is_mkldnn]
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
        self.root = directory / self.id
        self.root.mkdir(parents=True, exist_ok=True)
        self.writer = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # The lock first, then the directory: a directory whose lock is free belongs to a writer that is gone.
        self._lock_fd = os.open(self.root / (self.writer + _LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.directory = self.root / self.writer  # this node's files
        self.directory.mkdir()
        self._others: list[Path] = []  # the other writers' directories, as last listed
        self._listed_at = -RESCAN_S
        self.reaped = 0  # dead writers' directories this node removed
        self._writers()  # list them now, removing those of writers that ended without closing
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
        fd = self._find(block_hash)
        if fd is None:
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

    def save_tail(self, block_id: int, key: BlockHash) -> None:
        if self._touch(key):
            return
        src = self.kv_cache.data[block_id]
        snapshot = src.to("cpu", copy=True)  # the block may be written again once this returns
        if self._executor is None:
            self._write(snapshot, key)
        else:
            self._executor.submit(self._write, snapshot, key)

    def load(self, block_hash: BlockHash, block_id: int) -> None:
        import torch

        fd = self._open.pop(block_hash, None)
        if fd is None:  # found earlier and not kept open: find it again
            fd = self._find(block_hash)
            if fd is None:
                raise FileNotFoundError(f"shared KV tier: block {block_hash.hex()} is gone from {self.root}")
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
            self._own = OrderedDict()
        shutil.rmtree(self.directory, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            (self.root / (self.writer + _LOCK)).unlink()
        os.close(self._lock_fd)

    # ---- internals -------------------------------------------------------------------------------

    def _path(self, block_hash: BlockHash, directory: Path | None = None) -> Path:
        return (directory or self.directory) / (block_hash.hex() + _SUFFIX)

    def _writers(self) -> list[Path]:
        """The other writers' directories (listed again, and dead writers reaped, at most every ``RESCAN_S``)."""
        now = time.monotonic()
        if now - self._listed_at >= RESCAN_S:
            self._listed_at = now
            self.reaped += reap_dead_writers(self.root)
            with os.scandir(self.root) as entries:
                self._others = [Path(e.path) for e in entries if e.is_dir() and e.name != self.writer]
        return self._others

    def _find(self, block_hash: BlockHash) -> int | None:
        """An open descriptor on a whole file of ``block_hash`` (this node's first, then any writer's), or None."""
        for directory in (self.directory, *self._writers()):
            try:
                fd = os.open(self._path(block_hash, directory), os.O_RDONLY)
            except (FileNotFoundError, NotADirectoryError):
                continue
            if os.fstat(fd).st_size == self.bytes_per_block:
                return fd
            os.close(fd)  # another layout's stray file: not ours to read
        return None

    def _touch(self, block_hash: BlockHash) -> bool:
        """Mark a file this node wrote as recently used; whether one with this hash exists (any node's)."""
        with self._lock:
            if block_hash in self._own:
                self._own.move_to_end(block_hash)
                return True
        return any(self._path(block_hash, d).exists() for d in self._writers())

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

    def _unlink(self, block_hash: BlockHash) -> None:  # of this node's own
        self._path(block_hash).unlink(missing_ok=True)

    def _close_all(self) -> None:
        for fd in self._open.values():
            os.close(fd)
        self._open.clear()


def reap_dead_writers(root: Path) -> int:
    """Remove the directories of writers under ``root`` whose lock no process holds (they ended without closing:
    killed, crashed); return how many. A lock held elsewhere is left alone, as is a directory without a lock file
    younger than a minute (a writer between creating its lock and its directory cannot be seen that way: the lock
    comes first; this only clears what an older layout or a hand left behind)."""
    reaped = 0
    with os.scandir(root) as entries:
        names = [e.name for e in entries]
    locks = {n[: -len(_LOCK)] for n in names if n.endswith(_LOCK)}
    for writer in locks:
        path = root / (writer + _LOCK)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # alive
            shutil.rmtree(root / writer, ignore_errors=True)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            reaped += 1
        finally:
            os.close(fd)
    for name in names:
        directory = root / name
        if name in locks or name.endswith(_LOCK) or not directory.is_dir():
            continue
        with contextlib.suppress(FileNotFoundError):
            if time.time() - directory.stat().st_mtime > 60:
                shutil.rmtree(directory, ignore_errors=True)
                reaped += 1
    return reaped

"""A POSIX shared-memory segment (a file under /dev/shm) that one node owns and same-host peers map.

Layout (every offset page-aligned, so any dtype can view the data region):

    [header: magic, version, nonce, num_slots, table_offset, data_offset, data_bytes]   one page
    [slot table: num_slots int64 words]                                                 rounded to pages
    [data: data_bytes]                                                                  e.g. the KV tensor

The owner creates it (``create``), reserves its pages up front (``posix_fallocate``: a full tmpfs then
fails here with ENOSPC instead of killing a later write with SIGBUS) and unlinks it at close; unlinking
only removes the name, every mapping stays valid until its tensors are freed. A peer opens it by name and
checks the nonce, which proves it mapped this very segment (not a same-named file in another container's
/dev/shm). An owner that was killed leaves its segment behind: the owner holds a read lock on the header
for its whole life (open-file-description locks die with the process, whatever its pid namespace), so the
next ``create`` on the host removes every segment whose header it can lock for writing.

Locks are Linux open-file-description (OFD) byte-range locks: unlike POSIX record locks they belong to an
open file, so two opens conflict even inside one process, and closing another fd of the same file does not
drop them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import secrets
import struct
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SHM_DIR = Path("/dev/shm")
PREFIX = "tandem-kv-"
_MAGIC = b"TANDEMKV"
_VERSION = 1
_HEADER = struct.Struct("<8sI4x16sQQQQ")  # magic, version, nonce, num_slots, table_offset, data_offset, data_bytes
_PAGE = mmap.PAGESIZE
_FLOCK = struct.Struct("hhxxxxqqixxxx")  # struct flock on 64-bit Linux: type, whence, start, len, pid (0 for OFD)
_OWNER_LOCK = (0, 1)  # header byte 0: read-locked by the owner while it lives


class SharedMemoryUnavailable(Exception):
    """Shared memory cannot be used here (no /dev/shm, too small, a foreign or vanished segment)."""


class SharedSegment:
    """One mapped segment: its slot table and data region as tensors, its fd (for byte-range locks)."""

    def __init__(self, path: Path, fd: int, nonce: bytes, num_slots: int, table_offset: int, data_offset: int,
                 data_bytes: int, owner: bool) -> None:
        self.path = path
        self.fd = fd
        self.nonce = nonce
        self.num_slots = num_slots
        self.table_offset = table_offset
        self.data_offset = data_offset
        self.data_bytes = data_bytes
        self.size = data_offset + data_bytes
        self.owner = owner
        # MAP_POPULATE: fault every page in now, not one 4 KiB page at a time during the first transfers.
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self._map = mmap.mmap(fd, self.size, flags=flags)
        self._unlinked = False

    @property
    def name(self) -> str:
        return self.path.name

    @classmethod
    def create(cls, data_bytes: int, num_slots: int) -> SharedSegment:
        """A new segment of this process, zero-filled, every page reserved."""
        if not SHM_DIR.is_dir() or not hasattr(fcntl, "F_OFD_SETLK"):
            raise SharedMemoryUnavailable(f"{SHM_DIR} with open-file-description locks needs Linux")
        remove_stale_segments()
        table_offset = _PAGE
        data_offset = table_offset + _round_up(num_slots * 8, _PAGE)
        size = data_offset + data_bytes
        stats = os.statvfs(SHM_DIR)
        free = stats.f_bavail * stats.f_frsize
        if free < size:
            raise SharedMemoryUnavailable(
                f"{SHM_DIR} has {free / 2**20:.0f} MiB free, the KV cache needs {size / 2**20:.0f} MiB "
                f"(a container: raise its shm size, e.g. docker --shm-size)")
        path = SHM_DIR / f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            lock(fd, *_OWNER_LOCK, exclusive=False, wait=False)  # at once: a concurrent sweep must not take it
            os.posix_fallocate(fd, 0, size)
            nonce = secrets.token_bytes(16)
            os.pwrite(fd, _HEADER.pack(_MAGIC, _VERSION, nonce, num_slots, table_offset, data_offset, data_bytes), 0)
            return cls(path, fd, nonce, num_slots, table_offset, data_offset, data_bytes, owner=True)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise SharedMemoryUnavailable(f"cannot reserve {size / 2**20:.0f} MiB in {SHM_DIR}: {exc}") from None

    @classmethod
    def open(cls, name: str, nonce: bytes) -> SharedSegment:
        """Map a peer's segment read-write; SharedMemoryUnavailable unless it is there and its nonce matches."""
        if "/" in name or not name.startswith(PREFIX):
            raise SharedMemoryUnavailable(f"{name!r} is not a Tandem segment name")
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise SharedMemoryUnavailable(f"cannot open {path}: {exc.strerror}") from None
        try:
            header = os.pread(fd, _HEADER.size, 0)
            if len(header) < _HEADER.size:
                raise SharedMemoryUnavailable(f"{path} is truncated")
            magic, version, theirs, num_slots, table_offset, data_offset, data_bytes = _HEADER.unpack(header)
            if magic != _MAGIC or version != _VERSION:
                raise SharedMemoryUnavailable(f"{path} is not a version-{_VERSION} Tandem segment")
            if not secrets.compare_digest(theirs, nonce):
                raise SharedMemoryUnavailable(f"{path} is another segment (nonce differs): not the same /dev/shm")
            return cls(path, fd, nonce, num_slots, table_offset, data_offset, data_bytes, owner=False)
        except BaseException:
            os.close(fd)
            raise

    def table(self) -> torch.Tensor:
        """The slot table, ``[num_slots]`` int64, shared with every peer that mapped the segment."""
        import torch

        return torch.frombuffer(self._map, dtype=torch.int64, count=self.num_slots, offset=self.table_offset)

    def data(self) -> torch.Tensor:
        """The data region, ``[data_bytes]`` uint8 (view it as the dtype and shape it holds)."""
        import torch

        if self.data_bytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self._map, dtype=torch.uint8, count=self.data_bytes, offset=self.data_offset)

    def lock_slots(self, start: int, count: int, exclusive: bool, wait: bool) -> bool:
        """Lock the bytes of slots ``start .. start+count-1``; with ``wait=False``, False if someone holds them."""
        assert start >= 0 and start + count <= self.num_slots and count > 0
        return lock(self.fd, self.table_offset + start * 8, count * 8, exclusive, wait)

    def unlock_slots(self, start: int, count: int) -> None:
        unlock(self.fd, self.table_offset + start * 8, count * 8)

    def unmap(self) -> None:
        """Unmap the segment now instead of when its last tensor is freed. Every tensor viewing it (``table``,
        ``data`` and their views) must be dead or never used again: they would point at unmapped memory."""
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()

    def unlink(self) -> None:
        """Remove the segment's name (owner only; idempotent). Mappings, ours and the peers', stay valid."""
        if self.owner and not self._unlinked:
            self._unlinked = True
            self.path.unlink(missing_ok=True)

    def close(self) -> None:
        """Unlink (owner) and close the fd; the mapping lives on while tensors view it."""
        self.unlink()
        with contextlib.suppress(OSError):
            os.close(self.fd)


def lock(fd: int, start: int, length: int, exclusive: bool, wait: bool) -> bool:
    """An OFD byte-range lock on ``fd``; with ``wait=False``, False when another open file holds a conflicting one."""
    kind = fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK,
                    _FLOCK.pack(kind, os.SEEK_SET, start, length, 0))
    except OSError as exc:
        if not wait and exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def unlock(fd: int, start: int, length: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, start, length, 0))


def remove_stale_segments() -> list[str]:
    """Unlink segments whose owner is gone (no read lock on their header any more); returns their names."""
    removed = []
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            if lock(fd, *_OWNER_LOCK, exclusive=True, wait=False):
                path.unlink(missing_ok=True)
                removed.append(path.name)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple

"""Shared-memory collectives for the tensor-parallel ranks of one host (a ``Communicator``).

gloo pays a large fixed cost per call on sockets, whatever the size
(benchmarks/results/2026-12-01-parallel/RESULTS.md); a decode step all-reduces a few KiB after every
row-parallel layer. Like vLLM's and SGLang's CPU all-reduce, ranks here meet in one POSIX shared-memory
segment (common/kv/shared_segment.py: a file under /dev/shm, zero-filled, nonce-checked, unlinked by its
creator at close, swept if the creator was killed). Usage:

    segment = ShmComm.create(world_size, max_bytes=4 << 20)   # the parent (or rank 0); owns the segment
    name = segment.name                                       # plain text: a spawn argument, a protobuf field
    comm = ShmComm.attach(name, rank, world_size)             # in each rank's process, ranks 0 .. T-1
    comm.all_reduce_(hidden)                                  # every rank, the same calls in the same order
    comm.close(); segment.close()                             # the creator unlinks; mappings stay valid

The name is ``<file under /dev/shm>:<nonce in hex>``: the nonce proves a rank mapped this very segment.

Layout: the segment's slot table holds one 64-byte line per rank (its own cache line, so ranks never
false-share): word 0 = the last call number the rank published, word 1 = its pid once attached. The data
region holds two halves of ``world_size`` slots of ``slot_bytes`` (``max_bytes`` rounded up to a page):

    data: [half 0: slot 0 | slot 1 | ... | slot T-1][half 1: slot 0 | ... | slot T-1]

Call ``g`` (1, 2, ...) on rank r: copy the tensor into slot r of half ``g % 2``, store ``g`` in word 0 of
line r, wait until every line reads ``>= g``, then read every slot of that half. Two halves make one
barrier per call enough: rank r writes half ``g % 2`` again only at call ``g + 2``, which it reaches after
seeing every rank publish ``g + 1``, and a rank publishes ``g + 1`` only after it finished reading call
``g``. A tensor bigger than a slot goes through in slot-sized chunks, one call each.

Results are bit-identical on every rank and deterministic: every rank sums the same slots in rank order
0..T-1 (``((x0 + x1) + x2) + ...``), in fp32 for bf16/fp16 inputs, cast back once at the end (at T = 2
that is torch's own bf16/fp16 add, which computes in fp32 and rounds once).

Memory ordering: this relies on x86-TSO. A rank's data stores (torch ``copy_``, possibly on OpenMP worker
threads, which joined before ``copy_`` returned) become visible before its later store of the call number,
because x86 never reorders stores with older stores and visibility is transitive (causality); the
reader's loads of the data come after its load of the call number and x86 never reorders loads with older
loads. glibc's non-temporal ``memcpy`` path ends with ``sfence``. The number is an aligned 8-byte store,
so it is never torn. Weakly ordered CPUs (ARM, POWER) would need release/acquire fences, which Python
cannot issue: ``create`` refuses them (SharedMemoryUnavailable), and the caller keeps gloo.

Waiting spins briefly, then yields the core (``os.sched_yield``): ranks are often oversubscribed onto
fewer cores, and a spinning rank would hold the core the late rank needs. Nothing waits forever: after
``timeout_s`` a call raises a RuntimeError naming the ranks that never arrived, and a rank that died or
closed after attaching is noticed sooner (its open-file-description lock on its line is gone). After such
an error the communicator refuses further calls: the node must be rebuilt.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import platform
import struct
import time

import torch

from common.kv.shared_segment import SharedMemoryUnavailable, SharedSegment, lock

_LINE_WORDS = 8  # one 64-byte cache line of int64 words per rank
_SEQ, _PID = 0, 1  # the words of a rank's line
_PAGE = mmap.PAGESIZE
_SPIN_POLLS = 64  # polls before yielding the core
_YIELD_S = 0.02  # then sched_yield for this long, then sleep between polls
_SLEEP_S = 2e-4
_PROBE_S = 0.25  # how often a waiting rank checks whether the late ones still live
_ACCUMULATE = {torch.bfloat16: torch.float32, torch.float16: torch.float32}
_REDUCIBLE = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64)
_FLOCK = struct.Struct("hhxxxxqqixxxx")  # struct flock on 64-bit Linux: type, whence, start, len, pid
_MAX_PLANS = 256
_TSO_MACHINES = ("x86_64", "amd64", "i686", "i386")


class ShmCommSegment:
    """The creator's handle on the segment: keeps it alive (and unswept) until ``close`` unlinks it."""

    def __init__(self, segment: SharedSegment, world_size: int, slot_bytes: int) -> None:
        self.segment = segment
        self.world_size = world_size
        self.slot_bytes = slot_bytes

    @property
    def name(self) -> str:
        """What ranks attach by: ``<file name>:<nonce hex>``."""
        return f"{self.segment.name}:{self.segment.nonce.hex()}"

    def close(self) -> None:
        """Unlink the segment's name; ranks that attached keep working on their mappings."""
        self.segment.close()

    def __enter__(self) -> ShmCommSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Plan:
    """Preallocated views for one (dtype, shape): ``slots[half][rank]`` has that shape; ``acc`` is fp32 or None."""

    __slots__ = ("acc", "slots")

    def __init__(self, slots: tuple[list[torch.Tensor], list[torch.Tensor]], acc: torch.Tensor | None) -> None:
        self.slots = slots
        self.acc = acc


class ShmComm:
    """One rank's view of a shared-memory group: ``all_reduce_`` and ``all_gather`` among same-host processes."""

    def __init__(self, segment: SharedSegment, rank: int, world_size: int, timeout_s: float) -> None:
        """Use ``attach``; this claims ``rank`` in an already opened ``segment``."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if segment.num_slots != world_size * _LINE_WORDS or segment.data_bytes % (2 * world_size * _PAGE):
            raise ValueError(f"segment {segment.name} was not made for {world_size} ranks")
        self._segment = segment
        self._rank = rank
        self._world_size = world_size
        self.timeout_s = timeout_s
        self.slot_bytes = segment.data_bytes // (2 * world_size)
        self._table = segment.table()  # keeps the numpy view's memory alive
        # int64 words; an access is cheap (measured: benchmarks/results/figures-from-code.md)
        self._words: memoryview = self._table.numpy().data
        self._data = segment.data()
        self._generation = 0
        self._broken: str | None = None
        self._closed = False
        self._halves: dict[torch.dtype, torch.Tensor] = {}  # dtype -> [2, T, slot elements]
        self._plans: dict[tuple[torch.dtype, torch.Size], _Plan] = {}  # only for shapes that fit a slot
        self._others = [j * _LINE_WORDS + _SEQ for j in range(world_size) if j != rank]
        self._claim()

    @classmethod
    def create(cls, world_size: int, max_bytes: int = 4 << 20) -> ShmCommSegment:
        """A new segment for ``world_size`` ranks exchanging up to ``max_bytes`` per call (more is chunked).

        The caller owns it (``close`` unlinks it). SharedMemoryUnavailable if /dev/shm cannot hold it."""
        if world_size < 1 or max_bytes < 1:
            raise ValueError(f"need world_size >= 1 and max_bytes >= 1, got {world_size} and {max_bytes}")
        if platform.machine().lower() not in _TSO_MACHINES:
            raise SharedMemoryUnavailable(f"shared-memory collectives rely on x86-TSO store ordering, "
                                          f"not available on {platform.machine()}")
        slot_bytes = -(-max_bytes // _PAGE) * _PAGE
        try:
            segment = SharedSegment.create(2 * world_size * slot_bytes, world_size * _LINE_WORDS)
        except SharedMemoryUnavailable as exc:
            raise SharedMemoryUnavailable(f"shared-memory collectives for {world_size} ranks: {exc}") from None
        return ShmCommSegment(segment, world_size, slot_bytes)

    @classmethod
    def attach(cls, name: str, rank: int, world_size: int, timeout_s: float = 60.0) -> ShmComm:
        """Map the segment ``name`` (``ShmCommSegment.name``) as ``rank`` of ``world_size``.

        A rank can be attached once, by one live process. SharedMemoryUnavailable if the segment is gone or
        another one; ValueError if it was made for another world size or the rank is out of range."""
        file_name, sep, nonce = name.partition(":")
        if not sep:
            raise ValueError(f"shared-memory communicator name {name!r} is not '<file>:<nonce hex>'")
        segment = SharedSegment.open(file_name, bytes.fromhex(nonce))
        try:
            return cls(segment, rank, world_size, timeout_s)
        except BaseException:
            segment.close()
            raise

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    # ------------------------------------------------------------------------------------------- collectives

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group in place (rank order, fp32 accumulation for bf16/fp16) and return it."""
        plan = self._plans.get((tensor.dtype, tensor.shape))
        if plan is not None and tensor.is_contiguous() and tensor.is_cpu:  # the hot path: a shape seen before
            self._reduce(plan, tensor)
            return tensor
        if self._world_size == 1 or tensor.numel() == 0:
            return tensor
        if tensor.dtype not in _REDUCIBLE:
            raise TypeError(f"all_reduce_ supports {[str(d) for d in _REDUCIBLE]}, got {tensor.dtype}")
        if not tensor.is_cpu:
            raise ValueError(f"ShmComm reduces CPU tensors, got one on {tensor.device}")
        flat = tensor.contiguous().view(-1)
        chunk = self.slot_bytes // tensor.element_size()
        if flat.numel() <= chunk and tensor.is_contiguous():
            self._reduce(self._plan(tensor.dtype, tensor.shape), tensor)
            return tensor
        for start in range(0, flat.numel(), chunk):
            part = flat[start : start + chunk]
            self._reduce(self._plan(part.dtype, part.shape), part)
        if not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``tensor`` (equal shapes and dtypes), concatenated along ``dim`` in rank order."""
        if self._world_size == 1:
            return tensor
        if not tensor.is_cpu or tensor.dim() == 0:
            raise ValueError(f"ShmComm gathers CPU tensors of one or more dims, got {tensor.dim()} on {tensor.device}")
        flat = tensor.contiguous().view(-1)
        n = flat.numel()
        out = torch.empty((self._world_size, n), dtype=tensor.dtype)  # [T, n]: rank j's tensor, flattened
        chunk = self.slot_bytes // tensor.element_size()
        for start in range(0, n, chunk):
            c = min(chunk, n - start)
            half = self._exchange(flat[start : start + c])
            out[:, start : start + c].copy_(half[:, :c])
        dim = dim % tensor.dim()
        if dim == 0:
            return out.view(self._world_size * tensor.shape[0], *tensor.shape[1:])
        return torch.cat(out.view(self._world_size, *tensor.shape).unbind(0), dim=dim)

    def close(self) -> None:
        """Leave the group: drops this rank's liveness lock, so a peer still waiting for it fails within a second."""
        if not self._closed:
            self._closed = True
            os.close(self._alive_fd)
            self._segment.close()

    # ------------------------------------------------------------------------------------------- internals

    def _reduce(self, plan: _Plan, tensor: torch.Tensor) -> None:
        # tensor: contiguous, of the plan's dtype and shape (at most a slot); overwritten with the sum over ranks.
        generation = self._generation + 1
        slots = plan.slots[generation & 1]
        slots[self._rank].copy_(tensor)
        self._publish(generation)
        acc = plan.acc
        if acc is None:  # fp32, or bf16/fp16 at T = 2: torch adds those in fp32 and rounds once, the same sum
            torch.add(slots[0], slots[1], out=tensor)
            for slot in slots[2:]:
                tensor.add_(slot)
        else:  # an fp32 accumulator: upcasts are exact, one rounding at the end
            acc.copy_(slots[0])
            for slot in slots[1:]:
                acc.add_(slot)
            tensor.copy_(acc)

    def _exchange(self, chunk: torch.Tensor) -> torch.Tensor:
        """Publish contiguous ``chunk``; this call's half, ``[T, slot elements]``, valid until this rank's next call."""
        halves = self._halves.get(chunk.dtype)
        if halves is None:
            halves = self._halves[chunk.dtype] = self._view(chunk.dtype)
        generation = self._generation + 1
        half = halves[generation & 1]
        half[self._rank, : chunk.numel()].copy_(chunk)
        self._publish(generation)
        return half

    def _publish(self, generation: int) -> None:
        if self._broken is not None:
            raise RuntimeError(f"ShmComm rank {self._rank} is unusable after an earlier failure: {self._broken}")
        if self._closed:
            raise RuntimeError(f"ShmComm rank {self._rank} is closed")
        self._generation = generation
        words = self._words
        words[self._rank * _LINE_WORDS + _SEQ] = generation  # after the data: x86-TSO keeps the order
        for index in self._others:
            if words[index] < generation:
                self._wait(generation)
                return

    def _wait(self, generation: int) -> None:
        words = self._words
        start = time.monotonic()
        next_probe = start + _PROBE_S
        polls = 0
        while True:
            late = [index for index in self._others if words[index] < generation]
            if not late:
                return
            polls += 1
            if polls < _SPIN_POLLS:
                continue
            now = time.monotonic()
            if now - start < _YIELD_S:
                os.sched_yield()
                continue
            time.sleep(_SLEEP_S)
            if now >= next_probe:
                next_probe = now + _PROBE_S
                self._check_late([index // _LINE_WORDS for index in late], generation, now - start)

    def _check_late(self, late: list[int], generation: int, waited_s: float) -> None:
        gone = [(j, self._words[j * _LINE_WORDS + _PID]) for j in late
                if self._words[j * _LINE_WORDS + _PID] != 0 and not self._alive(j)]
        if gone:
            who = ", ".join(f"rank {j} (pid {pid})" for j, pid in gone)
            self._fail(f"{who} died or closed before call {generation}")
        if waited_s >= self.timeout_s:
            never = [j for j in late if self._words[j * _LINE_WORDS + _PID] == 0]
            detail = f" (never attached: ranks {never})" if never else ""
            self._fail(f"ranks {late} did not reach call {generation} within {self.timeout_s:g} s{detail}")

    def _fail(self, reason: str) -> None:
        self._broken = f"ShmComm rank {self._rank} of {self._world_size} ({self._segment.name}): {reason}"
        raise RuntimeError(self._broken)

    def _plan(self, dtype: torch.dtype, shape: torch.Size) -> _Plan:
        plan = self._plans.get((dtype, shape))
        if plan is None:
            halves = self._halves.get(dtype)
            if halves is None:
                halves = self._halves[dtype] = self._view(dtype)
            if len(self._plans) >= _MAX_PLANS:
                self._plans.clear()
            n = shape.numel()
            accumulate = _ACCUMULATE.get(dtype) if self._world_size > 2 else None
            acc = None if accumulate is None else torch.empty(shape, dtype=accumulate)
            slots = ([halves[0, j, :n].view(shape) for j in range(self._world_size)],
                     [halves[1, j, :n].view(shape) for j in range(self._world_size)])
            plan = self._plans[(dtype, shape)] = _Plan(slots, acc)
        return plan

    def _view(self, dtype: torch.dtype) -> torch.Tensor:
        # [2, T, slot elements] of dtype over the data region (slots are page-aligned: any dtype fits).
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return self._data.view(dtype).view(2, self._world_size, self.slot_bytes // itemsize)

    # -------------------------------------------------------------------------------------------- liveness

    def _lock_range(self, rank: int) -> tuple[int, int]:
        return self._segment.table_offset + rank * _LINE_WORDS * 8, 8

    def _claim(self) -> None:
        # A read lock on the first word of our line marks us alive. It is taken on an fd of its own (a new
        # open file description of the same file): OFD locks die with the last fd of their description, and
        # the mmap keeps a dup of the segment's fd open for as long as tensors view it, so a lock there
        # would outlive close(). Taking it as a write lock first proves no live process holds this rank;
        # the downgrade to a read lock is atomic.
        self._alive_fd = os.open(f"/proc/self/fd/{self._segment.fd}", os.O_RDWR)
        start, length = self._lock_range(self._rank)
        line = self._rank * _LINE_WORDS
        try:
            if not lock(self._alive_fd, start, length, exclusive=True, wait=False):
                raise RuntimeError(f"rank {self._rank} of {self._segment.name} is already attached by a live "
                                   "process")
            if self._words[line + _PID] != 0 or self._words[line + _SEQ] != 0:
                raise RuntimeError(f"rank {self._rank} of {self._segment.name} was attached before (pid "
                                   f"{self._words[line + _PID]}); a group cannot replace a rank: make a new segment")
            self._words[line + _PID] = os.getpid()
            lock(self._alive_fd, start, length, exclusive=False, wait=False)
        except BaseException:
            os.close(self._alive_fd)
            raise

    def _alive(self, rank: int) -> bool:
        start, length = self._lock_range(rank)
        probe = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, length, 0)
        result = fcntl.fcntl(self._segment.fd, fcntl.F_OFD_GETLK, probe)
        return _FLOCK.unpack(result)[0] != fcntl.F_UNLCK

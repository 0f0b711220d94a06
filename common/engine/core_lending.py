"""A decode node's idle cores lent to the prefill node beside it on the same host (``tandem up``'s pinned layout).

One request at a time, a disaggregated turn's compute is its prefill, on the prefill node's core, while the decode
node's core waits for the KV. In full disaggregation the decode node gets its work from the prefill nodes: once it
has nothing to step, it stays idle until a prefill lands. So a prefill node may run its layers on its own cores
plus the idle decode node's and give them back as soon as that node has work again, the CPU counterpart of
SGLang's prefill/decode multiplexing of one GPU's SMs. A colocated replica cannot do this: its neighbour's next
request can arrive at any moment, from outside.

- ``ActivityFile`` (the decode node, ``--activity-file PATH``): one shared-memory page saying whether the node's
  engine has a step to run (``IDLE``, ``BUSY``, ``STOPPED``), written by its engine thread when that changes.
- ``ActivityView`` (the prefill node, ``--borrow-from PATH,...``): reads it; a file that is missing, foreign or
  ``STOPPED`` reads as not idle (and is looked for again every second).
- ``CoreBorrower`` (the prefill node, ``--borrow-cpus CPUS``): before each decoder layer, on the engine thread, the
  layer runs with one OpenMP thread per own and borrowed CPU while every view reads idle, else on the own CPUs
  only: a decode node that gets work waits at most one prefill layer for its core. A forward borrows however few
  its rows (4 new tokens after a cached history compute faster on two cores too), unless it runs as the one-call
  C++ step that takes a few rows after a cached prefix (common/model/decode_step.py). The engine thread's
  OpenMP team is bound one thread per CPU at its first borrowed layer (``pin_team``: the engine thread on its own
  CPU, the worker on the borrowed one), so the switch is only the engine thread's OpenMP thread count
  (``omp_set_num_threads``: its own ICV, which PyTorch's kernels and oneDNN read). Unbound, the two threads shared
  both CPUs and a woken worker often landed on its master's CPU while the other idled (session 42: lent forwards
  of the same size took 40 to 108 ms). Where the team cannot be bound (no libgomp), the engine thread's affinity
  switches with the count instead.

The process starts on its own and borrowed CPUs (the launcher pins both) so that libgomp, which counts the CPUs at
load, lets its workers spin between kernels rather than sleep (``GOMP_SPINCOUNT`` bounds that spin: the launcher
sets 10000: as fast as 30000 or more between kernels, and a worker lets the decode node's core go sooner);
``CoreBorrower.adopt`` then narrows the starting thread to its own CPUs before any other thread starts.
Measured in session 41: benchmarks/results/2026-12-07-core-lending/RESULTS.md.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.config.settings import ModelSettings, NodeSettings

MAGIC = b"TNDMACT1"
_HEADER = struct.Struct("<8sQ")  # magic, writer pid
STATE_OFFSET = _HEADER.size  # one byte: the state
SIZE = 64
IDLE, BUSY, STOPPED = 0, 1, 2
REOPEN_S = 1.0  # how often a view looks again for a file that is missing or stopped
# After a forward that completed a prompt, its KV lands on the decode node within a few milliseconds and that node
# starts decoding it: the layers of the prefill node's next forward in that time (a queued prompt) do not borrow.
HANDOVER_S = 0.02
SPINCOUNT = "10000"  # GOMP_SPINCOUNT for a borrowing node (the launcher's default; libgomp reads it at load)


class ActivityFile:
    """The writer: this node's engine says whether it has a step to run (``set_busy``, from the engine thread)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._map[STATE_OFFSET] = BUSY  # until the engine thread says otherwise
        self._map[: _HEADER.size] = _HEADER.pack(MAGIC, os.getpid())
        self._busy = True

    def set_busy(self, busy: bool) -> None:
        if busy != self._busy:
            self._busy = busy
            self._map[STATE_OFFSET] = BUSY if busy else IDLE

    def close(self) -> None:
        """The node stops: a borrower lets the cores go (a restarted node writes the file again)."""
        if self._map.closed:
            return
        self._map[STATE_OFFSET] = STOPPED
        self._map.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class ActivityView:
    """The reader: whether the node writing ``path`` is idle now."""

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self._clock = clock
        self._map: mmap.mmap | None = None
        self._next_look = 0.0
        self._open()

    def _open(self) -> None:
        self._next_look = self._clock() + REOPEN_S
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return
        try:
            if os.fstat(fd).st_size < SIZE:
                return
            mapped = mmap.mmap(fd, SIZE, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        if mapped[: len(MAGIC)] != MAGIC:
            mapped.close()
            return
        if self._map is not None:
            self._map.close()
        self._map = mapped

    def idle(self) -> bool:
        m = self._map
        state = m[STATE_OFFSET] if m is not None else STOPPED
        if state == STOPPED and self._clock() >= self._next_look:
            self._open()  # the node restarted (a new file at the path), or came up after us
            state = self._map[STATE_OFFSET] if self._map is not None else STOPPED
        return state == IDLE

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


class CoreBorrower:
    """Runs a prefill's decoder layers on ``own`` + ``borrowed`` CPUs while every ``views`` reads idle (the
    model's ``layer_threads``; every call on the engine thread). Counts the layers run each way."""

    def __init__(self, own: Sequence[int], borrowed: Sequence[int], views: Sequence[ActivityView],
                 set_threads: Callable[[int], None] | None = None,
                 set_affinity: Callable[[set[int]], None] | None = None,
                 pin: Callable[[list[int]], bool] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not own or not borrowed or set(own) & set(borrowed):
            raise ValueError(f"borrowing needs own and borrowed CPUs, apart: own {sorted(own)}, "
                             f"borrowed {sorted(borrowed)}")
        if not views:
            raise ValueError("borrowing needs the activity file of the node whose CPUs it borrows (--borrow-from)")
        self.own, self.borrowed = set(own), set(borrowed)
        self.views = list(views)
        self._set_threads = set_threads
        self._set_affinity = set_affinity or (lambda cpus: os.sched_setaffinity(0, cpus))
        self._pin = pin
        self.pinned: bool | None = None  # whether the team is bound one thread per CPU (None: not tried yet)
        self.lending = False  # whether the engine thread runs on the borrowed CPUs now
        self._clock = clock
        self._quiet_until = 0.0  # no borrowing before then (a prompt's KV is landing on the decode node)
        self.borrowed_layers = self.own_layers = 0

    @classmethod
    def adopt(cls, borrowed: Sequence[int], views: Sequence[ActivityView]) -> CoreBorrower:
        """In the process's starting thread, before any other thread starts: this process was started on its own
        CPUs and ``borrowed`` ones (so libgomp counted both); it keeps the others and runs on its own from here."""
        allowed = os.sched_getaffinity(0)
        missing = set(borrowed) - allowed
        if missing:
            raise ValueError(f"--borrow-cpus {','.join(map(str, borrowed))}: this process may not run on CPU(s) "
                             f"{','.join(map(str, sorted(missing)))} (start it on its own CPUs and these)")
        own = allowed - set(borrowed)
        if not own:
            raise ValueError(f"--borrow-cpus {','.join(map(str, borrowed))}: these are every CPU this process may "
                             "run on; it needs CPUs of its own too")
        os.sched_setaffinity(0, own)
        return cls(sorted(own), borrowed, views)

    def _threads(self, n: int) -> None:
        if self._set_threads is None:
            from common.kernels.openmp import thread_count_setter

            self._set_threads = thread_count_setter()
        self._set_threads(n)

    def _bind_team(self) -> bool:
        """Bind the engine thread's OpenMP team, own CPUs first, once (the first borrowed layer: the warm-up)."""
        if self.pinned is None:
            if self._pin is None:
                from common.kernels.openmp import pin_team

                self._pin = pin_team
            self.pinned = bool(self._pin(sorted(self.own) + sorted(self.borrowed)))
        return self.pinned

    def _lend(self, on: bool) -> None:
        if on == self.lending:
            return
        self.lending = on
        if on:
            if not self._bind_team():
                self._set_affinity(self.own | self.borrowed)
            self._threads(len(self.own) + len(self.borrowed))
        else:
            self._threads(len(self.own))
            if not self.pinned:
                self._set_affinity(self.own)

    def before_layer(self) -> None:
        on = all(v.idle() for v in self.views) and self._clock() >= self._quiet_until
        self._lend(on)
        if on:
            self.borrowed_layers += 1
        else:
            self.own_layers += 1

    def after_layers(self) -> None:
        self._lend(False)

    def layer_counts(self) -> tuple[int, int]:
        """Layers run on own + borrowed CPUs, and on the own ones only."""
        return self.borrowed_layers, self.own_layers

    def handing_over(self) -> None:
        self._quiet_until = self._clock() + HANDOVER_S

    @contextlib.contextmanager
    def borrowing(self) -> Iterator[None]:
        """Run the body on both sets, whatever the views say (the start-up warm-up of the kernels)."""
        self._lend(True)
        try:
            yield
        finally:
            self._lend(False)

    def close(self) -> None:
        for view in self.views:
            view.close()


def check_lending_role(role: str, node: NodeSettings, model: ModelSettings) -> None:
    """Refuse at start what core lending cannot honour: borrowing anywhere but on a CPU prefill node that runs its
    model in its own process, an activity file anywhere but on a decode node."""
    if node.borrow_cpus:
        if role != "prefill":
            raise ValueError(f"--borrow-cpus / --borrow-from are a prefill node's (it borrows a decode node's CPUs); "
                             f"this is a {role} node")
        if model.device != "cpu" or model.parallel:
            raise ValueError("--borrow-cpus runs a prefill node's layers on more CPU threads: it needs --device cpu "
                             "and the model in the node's own process (no --tensor/--pipeline-parallel-size > 1)")
    if node.activity_file and role != "decode":
        raise ValueError(f"--activity-file is a decode node's (a prefill node borrows its CPUs while it is idle); "
                         f"this is a {role} node")

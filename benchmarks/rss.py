"""Resident memory of processes over time: sampling from /proc and the soak's flatness analysis.

``RssSampler`` reads ``VmRSS`` from ``/proc/<pid>/status`` of each named process every ``interval_s`` on
its own thread, with its parts ``RssAnon`` (the process's own heap) and ``RssShmem`` (shared memory it
maps: a node's own KV segment, and on a prefill node every same-host decode node's KV it copies into); a
process restarted under the same name shows up with a new pid. ``rss_growth`` judges each
process by its latest pid only (a restarted process starts small again), after a warm-up: the median of the
last quarter of its samples against the median of the first quarter.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

FLAT_WITHIN_PCT = 10.0  # the soak's goal: RSS of every process flat within 10% after warm-up


@dataclass(frozen=True)
class RssSample:
    t_s: float  # seconds since the sampler started
    process: str
    pid: int
    rss_kib: int
    anon_kib: int = 0  # RssAnon: private memory (heap, tensors of its own)
    shmem_kib: int = 0  # RssShmem: resident shared memory it maps (KV segments)


@dataclass(frozen=True)
class RssReading:
    rss_kib: int
    anon_kib: int
    shmem_kib: int


def _status_kib(status_text: str, field: str) -> int | None:
    for line in status_text.splitlines():
        if line.startswith(field + ":"):
            value, _, unit = line.split(":", 1)[1].strip().partition(" ")
            assert unit.strip() in ("kB", ""), f"unexpected {field} unit in {line!r}"
            return int(value)
    return None


def parse_vmrss_kib(status_text: str) -> int | None:
    """``VmRSS`` in KiB from the text of ``/proc/<pid>/status``; None when absent (a zombie has none)."""
    return _status_kib(status_text, "VmRSS")


def parse_rss(status_text: str) -> RssReading | None:
    """``VmRSS`` with its ``RssAnon`` and ``RssShmem`` parts (0 where the kernel omits one); None for a zombie."""
    rss = parse_vmrss_kib(status_text)
    if rss is None:
        return None
    return RssReading(rss, _status_kib(status_text, "RssAnon") or 0, _status_kib(status_text, "RssShmem") or 0)


def read_rss(pid: int, proc_root: Path = Path("/proc")) -> RssReading | None:
    """The process's resident set and its parts, or None when it is gone (or not readable)."""
    try:
        return parse_rss((proc_root / str(pid) / "status").read_text())
    except OSError:
        return None


def read_rss_kib(pid: int, proc_root: Path = Path("/proc")) -> int | None:
    """The process's resident set in KiB, or None when it is gone (or not readable)."""
    reading = read_rss(pid, proc_root)
    return None if reading is None else reading.rss_kib


class RssSampler:
    """Samples the RSS of ``pids()`` (name -> pid, asked anew at each sample) until ``stop``."""

    def __init__(self, pids: Callable[[], Mapping[str, int]], interval_s: float,
                 read: Callable[[int], RssReading | None] = read_rss) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.pids = pids
        self.interval_s = interval_s
        self.read = read
        self.samples: list[RssSample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.started_at = 0.0  # time.monotonic() at start; sample times count from it

    def sample_once(self) -> None:
        t = time.monotonic() - self.started_at
        for name, pid in sorted(self.pids().items()):
            got = self.read(pid)
            if got is not None:
                self.samples.append(RssSample(round(t, 3), name, pid, got.rss_kib, got.anon_kib, got.shmem_kib))

    def start(self) -> RssSampler:
        self.started_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        self.sample_once()
        while not self._stop.wait(self.interval_s):
            self.sample_once()

    def stop(self) -> list[RssSample]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.samples


@dataclass(frozen=True)
class RssGrowth:
    """One process's memory over the soak (its latest pid, after warm-up)."""

    process: str
    pid: int
    num_samples: int
    start_mib: float  # median of the first quarter of the samples after warm-up
    end_mib: float  # median of the last quarter
    peak_mib: float
    anon_start_mib: float = 0.0  # the same medians of RssAnon (the process's own memory) ...
    anon_end_mib: float = 0.0
    shmem_start_mib: float = 0.0  # ... and of RssShmem (the KV segments it maps)
    shmem_end_mib: float = 0.0

    @property
    def growth_pct(self) -> float:
        return 100.0 * (self.end_mib - self.start_mib) / self.start_mib if self.start_mib else 0.0

    def flat(self, within_pct: float = FLAT_WITHIN_PCT) -> bool:
        return abs(self.growth_pct) <= within_pct


def rss_growth(samples: Sequence[RssSample], warmup_s: float) -> list[RssGrowth]:
    """Per process (by name, in name order): growth of its latest pid's RSS from ``warmup_s`` after that pid's
    first sample on. A process with no sample after warm-up is judged on all of its latest pid's samples."""
    out = []
    for name in sorted({s.process for s in samples}):
        mine = [s for s in samples if s.process == name]
        pid = mine[-1].pid
        mine = [s for s in mine if s.pid == pid]
        steady = [s for s in mine if s.t_s >= mine[0].t_s + warmup_s] or mine
        quarter = max(1, len(steady) // 4)
        mib = [s.rss_kib / 1024 for s in steady]
        anon = [s.anon_kib / 1024 for s in steady]
        shmem = [s.shmem_kib / 1024 for s in steady]
        out.append(RssGrowth(name, pid, len(steady), statistics.median(mib[:quarter]),
                             statistics.median(mib[-quarter:]), max(mib),
                             statistics.median(anon[:quarter]), statistics.median(anon[-quarter:]),
                             statistics.median(shmem[:quarter]), statistics.median(shmem[-quarter:])))
    return out

"""Give freed heap memory back to the operating system now and then (glibc's ``malloc_trim``).

A node's forward allocates and frees large temporaries of changing sizes (prefill chunks of any length).
glibc serves them from its heap once its dynamic mmap threshold has grown, and freed heap memory between
live blocks stays resident: measured in a soak, a prefill node's own memory (RssAnon) climbed over 6 minutes
while a decode node's stayed flat (benchmarks/results/2026-12-01-soak-30min/RESULTS.md). ``malloc_trim(0)``
returns every free page of every arena (``madvise(MADV_DONTNEED)``), so the engine thread calls it between
steps every ``interval_s`` (a few milliseconds each time; 0 turns it off). Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)
DEFAULT_INTERVAL_S = 10.0


def _load_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # musl, macOS: no malloc_trim
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


_TRIM = _load_trim()


def trim_heap() -> bool:
    """Return free heap pages to the OS; True if glibc released any."""
    return bool(_TRIM(0)) if _TRIM is not None else False


class HeapTrimmer:
    """Calls ``trim_heap`` at most once per ``interval_s`` from ``maybe_trim`` (the engine loop's)."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, clock: Callable[[], float] = time.monotonic,
                 trim: Callable[[], bool] = trim_heap) -> None:
        if interval_s < 0:
            raise ValueError(f"heap trim interval must be >= 0, got {interval_s}")
        self.interval_s = interval_s
        self.clock = clock
        self.trim = trim
        self.num_trims = 0
        self._next = clock() + interval_s

    @property
    def available(self) -> bool:
        return _TRIM is not None

    def maybe_trim(self) -> None:
        if self.interval_s == 0:
            return
        now = self.clock()
        if now >= self._next:
            self.trim()
            self.num_trims += 1
            self._next = self.clock() + self.interval_s

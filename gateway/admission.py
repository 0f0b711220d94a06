"""The gateway's admission: at most ``max_inflight`` samples run; more wait in a bounded FIFO queue.

Load the system can serve is queued, not refused: a request beyond the in-flight limit waits (cancellable,
at most ``queue_timeout_s``) for earlier ones to finish. ``RESOURCE_EXHAUSTED`` only when ``max_queued``
requests already wait or the wait ran out; both messages name the limit. FIFO: a later request never
overtakes a waiting one, even when it would fit (a request of n samples waits for n free slots).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from common.serving.errors import ResourceExhaustedError


@dataclass
class _Waiter:
    n: int
    granted: asyncio.Future[None]


class AdmissionQueue:
    """Counts samples in flight and queues requests beyond ``max_inflight`` (all on one event loop)."""

    def __init__(self, max_inflight: int, max_queued: int, queue_timeout_s: float) -> None:
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.num_inflight = 0
        self._waiting: deque[_Waiter] = deque()

    @property
    def num_queued(self) -> int:
        return len(self._waiting)

    @contextlib.asynccontextmanager
    async def slots(self, n: int, timeout_s: float | None = None) -> AsyncIterator[float]:
        """Hold ``n`` in-flight slots for the body; yields the seconds spent queued. ``timeout_s`` caps the
        wait below ``queue_timeout_s`` (the request's own deadline)."""
        n = min(n, self.max_inflight)  # a request wider than the limit runs alone rather than never
        waited = await self._acquire(n, self.queue_timeout_s if timeout_s is None
                                     else min(timeout_s, self.queue_timeout_s))
        try:
            yield waited
        finally:
            self.num_inflight -= n
            self._grant()

    async def _acquire(self, n: int, timeout_s: float) -> float:
        if not self._waiting and self.num_inflight + n <= self.max_inflight:
            self.num_inflight += n
            return 0.0
        if len(self._waiting) >= self.max_queued:
            raise ResourceExhaustedError(f"too many requests: {self.num_inflight} in flight (max_inflight="
                                         f"{self.max_inflight}) and {len(self._waiting)} queued (max_queued="
                                         f"{self.max_queued}); retry later")
        loop = asyncio.get_running_loop()
        waiter = _Waiter(n, loop.create_future())
        self._waiting.append(waiter)
        started = loop.time()
        try:
            await asyncio.wait_for(asyncio.shield(waiter.granted), timeout_s)
        except BaseException as exc:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self.num_inflight -= n  # granted just as we gave up: hand the slots on
            else:
                waiter.granted.cancel()
                self._waiting.remove(waiter)
            self._grant()
            if isinstance(exc, TimeoutError):
                raise ResourceExhaustedError(
                    f"waited {timeout_s:.3g} s for one of max_inflight={self.max_inflight} slots "
                    f"(queue_timeout_s={self.queue_timeout_s:g}, or the request's deadline when sooner)") from None
            raise
        return loop.time() - started

    def _grant(self) -> None:
        """Admit waiting requests in order while their samples fit."""
        while self._waiting and self.num_inflight + self._waiting[0].n <= self.max_inflight:
            waiter = self._waiting.popleft()
            self.num_inflight += waiter.n
            waiter.granted.set_result(None)

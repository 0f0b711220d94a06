"""A node's role, as the scheduler and the engine see it: where a request's KV comes from and goes to.

vLLM v1's ``KVConnectorBase`` shape. The scheduler is role-agnostic; it asks its connector

- ``get_num_new_matched_tokens``: how many of a request's prompt tokens get their KV from another node
  (a decode node: all those not in its own prefix cache). Such a request waits in ``WAITING_FOR_KV``
  with its blocks allocated until the KV has arrived;
- ``request_finished``: whether a finished request's blocks must be held (a prefill node: until the
  KV transfer has read them), to be freed later by ``Scheduler.free_held``;
- ``kv_read_from``: the first block a transfer may still read, so the blocks a sliding window frees early
  stop before it (a prefill node sends only the blocks the decode node's window reads, from that block on);
- ``can_preempt``: whether a request's blocks may be freed for recompute (not while a send may read them);
- ``ends_at_first_token``: whether requests end once their prompt is computed and one token sampled.

and the engine calls the worker side: ``save_kv`` after every forward, once the step's KV is written, and
``get_finished`` at the start of every step: the transfers that ended since the last one (vLLM's
``get_finished``). The KV transfer layer reports each transfer's end into the connector's ``FinishedTransfers``
inbox from its own threads, once nothing of it is in flight, and wakes the engine; the engine thread then
starts the requests whose KV landed, frees the blocks a finished send held, and aborts the requests whose
transfer failed. So KV arrival and release stay on the engine thread, and every transfer a connector
tracks ends in exactly one report: nothing needs a timer to stay leak-free.

The base class is the colocated role: everything computed here, nothing held, nothing sent. The prefill
node's producer lives in ``prefill_service.kv_producer``, the decode node's consumer in
``decode_service.kv_consumer``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.engine.commands import ChunkTiming, KVDestination
    from common.engine.request import Request
    from common.engine.scheduler_output import SchedulerOutput


@dataclass
class Finished:
    """What ended since the last step: ``loaded`` (request id, the remote prefill's first token), ``sent``
    (request ids whose send is over: their held blocks can go), ``failed`` (request id, why: abort it)."""

    loaded: list[tuple[str, int]] = field(default_factory=list)
    sent: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loaded or self.sent or self.failed)


class FinishedTransfers:
    """The inbox the transfer layer reports into (any thread) and the engine thread drains each step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending = Finished()
        # Set by the engine's loop (AsyncEngine): wakes it when it idles, so a landed KV starts decoding now.
        self.wake: Callable[[], None] = lambda: None

    def loaded(self, request_id: str, first_token: int) -> None:
        with self._lock:
            self._pending.loaded.append((request_id, first_token))
        self.wake()

    def sent(self, request_id: str) -> None:
        with self._lock:
            self._pending.sent.append(request_id)
        self.wake()

    def failed(self, request_id: str, reason: str) -> None:
        with self._lock:
            self._pending.failed.append((request_id, reason))
        self.wake()

    def take(self) -> Finished:
        if not self._pending:  # the common case, read without the lock: a report racing it is taken next step
            return Finished()
        with self._lock:
            taken, self._pending = self._pending, Finished()
        return taken

    def __bool__(self) -> bool:
        return bool(self._pending)


class KVConnector:
    """The colocated role: a request's KV is computed here and freed when it finishes."""

    role = "colocated"
    ends_at_first_token = False

    def __init__(self) -> None:
        self.finished = FinishedTransfers()

    # ---- scheduler side --------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Prompt tokens after the first ``num_computed_tokens`` whose KV another node provides."""
        return 0

    def request_finished(self, request: Request) -> bool:
        """``request`` just finished: True to hold its blocks until ``Scheduler.free_held``."""
        return False

    def kv_read_from(self, request: Request) -> int | None:
        """The first of ``request``'s blocks that a KV transfer may still read (a prefill node's send): it and
        the blocks after it stay even once outside every sliding window. None: no transfer reads its blocks."""
        return None

    def can_preempt(self, request: Request) -> bool:
        """Whether ``request``'s blocks may be freed for recompute now: not while a KV transfer may read them."""
        return True

    # ---- engine side -----------------------------------------------------------------------------

    def attach(self, request_id: str, destination: KVDestination,
               chunk_timings: list[ChunkTiming] | None) -> None:
        """Send the request's KV to ``destination`` as it is computed (prefill nodes only)."""
        raise ValueError(f"a {self.role} node does not send KV; the request's destination must be empty")

    def await_destination(self, request_id: str, chunk_timings: list[ChunkTiming] | None) -> None:
        """The request's KV is computed now and sent once ``attach_destination`` says where (prefill nodes only)."""
        raise ValueError(f"a {self.role} node does not send KV; the request's destination must be empty")

    def attach_destination(self, request_id: str, destination: KVDestination) -> None:
        """The destination of a request added with ``await_destination``: push what is computed, then the rest."""
        raise ValueError(f"a {self.role} node does not send KV")

    def track_load(self, request_id: str, transfer_id: str) -> None:
        """The request's prompt KV comes by ``transfer_id`` (decode nodes only): its end is reported here."""
        raise ValueError(f"a {self.role} node does not receive KV")

    def save_kv(self, scheduled: SchedulerOutput, step_start_ns: int) -> None:
        """After a forward: the scheduled chunks' KV is in the cache (the step began at ``step_start_ns``)."""

    def get_finished(self) -> Finished:
        """Before a step: the loads and sends that ended since the last one."""
        return self.finished.take()

    def forget(self, request_id: str) -> None:
        """The request left the engine (finished and released, or aborted): drop what is kept for it."""

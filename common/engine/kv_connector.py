"""A node's role, as the scheduler and the engine see it: where a request's KV comes from and goes to.

vLLM v1's ``KVConnectorBase`` shape. The scheduler is role-agnostic; it asks its connector

- ``get_num_new_matched_tokens``: how many of a request's prompt tokens get their KV from another node
  (a decode node: all those not in its own prefix cache). Such a request waits in ``WAITING_FOR_KV``
  with its blocks allocated until the KV has arrived;
- ``request_finished``: whether a finished request's blocks must be held (a prefill node: until the
  KV transfer has read them), to be freed later by ``Scheduler.free_held``;
- ``ends_at_first_token``: whether requests end once their prompt is computed and one token sampled.

and the engine calls the worker side, ``save_kv``, after every forward, once the step's KV is written.

The base class is the colocated role: everything computed here, nothing held, nothing sent. The prefill
node's producer lives in ``prefill_service.kv_producer``, the decode node's consumer in
``decode_service.kv_consumer``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.engine.commands import ChunkTiming, KVDestination
    from common.engine.request import Request
    from common.engine.scheduler_output import SchedulerOutput


class KVConnector:
    """The colocated role: a request's KV is computed here and freed when it finishes."""

    role = "colocated"
    ends_at_first_token = False

    # ---- scheduler side --------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Prompt tokens after the first ``num_computed_tokens`` whose KV another node provides."""
        return 0

    def request_finished(self, request: Request) -> bool:
        """``request`` just finished: True to hold its blocks until ``Scheduler.free_held``."""
        return False

    # ---- engine side -----------------------------------------------------------------------------

    def attach(self, request_id: str, destination: KVDestination,
               chunk_timings: list[ChunkTiming] | None) -> None:
        """Send the request's KV to ``destination`` as it is computed (prefill nodes only)."""
        raise ValueError(f"a {self.role} node does not send KV; the request's destination must be empty")

    def save_kv(self, scheduled: SchedulerOutput, step_start_ns: int) -> None:
        """After a forward: the scheduled chunks' KV is in the cache (the step began at ``step_start_ns``)."""

    def forget(self, request_id: str) -> None:
        """The request left the engine (finished and released, or aborted): drop what is kept for it."""

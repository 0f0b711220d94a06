"""Runs an engine in its own thread and talks to asyncio servicers through queues.

The engine thread owns the engine outright: every mutation (add, abort, reserve...) is a typed command
(``common.engine.commands``) queued to it and applied between steps by ``EngineCore.handle``, so the
scheduler and block pool need no locks. KV transfers that end are reported into the engine's connector by
the transfer layer, which wakes the thread; its next step applies them. Outputs go back to per-request
``asyncio.Queue``s on the servicer's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from common.engine.commands import AbortRequest, EngineCommand
from common.engine.heap import HeapTrimmer
from common.engine.request import RequestOutput
from common.errors import EngineDeadError

if TYPE_CHECKING:
    from common.engine.core_lending import ActivityFile
    from common.engine.engine_core import EngineCore

T = TypeVar("T")
_Reply = Callable[[object, "BaseException | None"], None]  # delivers a command's result or error
log = logging.getLogger(__name__)

# How long the idle engine thread sleeps waiting for a command before re-checking for shutdown.
_IDLE_POLL_S = 0.05

# How long a thread that wants the GIL waits before the holder must hand it over (``sys.setswitchinterval``;
# Python's default is 5 ms). The engine thread takes the GIL back after each of the ~400 kernels of an
# op-by-op step while the servers' threads run Python on the same cores, so at 5 ms it queued behind them:
# served fp32 steps took 1.2-1.4x their offline time. At 0.1 ms, 384 -> 128 tokens at 1.2 req/s under vLLM's
# client (2-core Xeon, alternating runs): output 117-119 -> 135-136 tok/s, TTFT p50 1.19-1.35 -> 0.67-0.72 s,
# a 384-token prefill step 590-610 -> 420-440 ms (0.5 ms: 126-131 tok/s).
ENGINE_SWITCH_INTERVAL_S = 1e-4


class AsyncEngine:
    """An ``EngineCore`` driven by a background thread, with an async API."""

    def __init__(self, engine: EngineCore, name: str = "engine", activity: ActivityFile | None = None) -> None:
        """``activity``: the file this node's engine thread keeps saying whether it has a step to run (a decode
        node's ``--activity-file``: a prefill node beside it borrows its cores while it is idle)."""
        self.engine = engine
        self._activity = activity
        # A command and, when someone awaits its reply, how to deliver it; None wakes the thread to stop.
        self._commands: queue.SimpleQueue[tuple[EngineCommand[Any], _Reply | None] | None] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | Exception]]] = {}
        self._stop = threading.Event()
        self._error: BaseException | None = None
        # A transfer reported into the connector wakes an idle thread (None: no command, just a look).
        engine.connector.finished.wake = lambda: self._commands.put(None)
        # Process-wide: every engine thread wants it; never raised above what the process already set.
        sys.setswitchinterval(min(sys.getswitchinterval(), ENGINE_SWITCH_INTERVAL_S))
        from common.kernels.openmp import hand_over_openmp

        hand_over_openmp()  # TANDEM_CPU_OMP_HANDOFF: one libgomp team in the process, the engine thread's
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- async API -------------------------------------------------------------------------------

    async def call(self, command: EngineCommand[T]) -> T:
        """Apply ``command`` on the engine thread between steps and return its reply (or raise its error)."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def reply(result: object, exc: BaseException | None) -> None:
            if exc is not None:
                loop.call_soon_threadsafe(_set_exception, future, exc)
            else:
                loop.call_soon_threadsafe(_set_result, future, cast(T, result))

        self._commands.put((command, reply))
        return await future

    def open_stream(self, request_id: str) -> asyncio.Queue[RequestOutput | Exception]:
        """Register a queue that receives every output of ``request_id`` (call before it can produce any)."""
        q: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def stream(self, request_id: str,
                     q: asyncio.Queue[RequestOutput | Exception]) -> AsyncIterator[RequestOutput]:
        """Yield outputs until the request finishes. If the consumer stops early, the request is aborted."""
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self.close_stream(request_id)
            if not finished:
                self.submit(AbortRequest(request_id))

    def submit(self, command: EngineCommand[Any]) -> None:
        """Fire-and-forget a command on the engine thread (safe from any thread); errors are logged."""
        self._commands.put((command, None))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.engine.close()  # a parallel node's ranks stop with it
        if self._activity is not None:
            self._activity.close()

    @property
    def failed(self) -> bool:
        """The engine thread crashed (not: it was shut down)."""
        return self._error is not None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine thread failed: {self._error!r}")

    # ---- engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        trimmer = HeapTrimmer()  # freed forward temporaries go back to the OS (common/engine/heap.py)
        try:
            activity = self._activity
            while not self._stop.is_set():
                busy = self.engine.has_unfinished()
                if activity is not None:
                    activity.set_busy(busy)
                self._drain_commands(block=not busy)
                if self.engine.has_unfinished():
                    if activity is not None:
                        activity.set_busy(True)  # before the step: a borrower gives the cores back at its next layer
                    # The outputs first: each hand-off wakes the event loop, which runs what it was handed in
                    # order (a first token's answer, then the KV events' fan-out).
                    self._deliver(self.engine.step(publish_kv_events=False))
                    self.engine.publish_kv_events()
                trimmer.maybe_trim()
        except BaseException as exc:  # the thread must report, not vanish
            log.exception("engine thread crashed")
            self._error = exc
            for rid in list(self._streams):
                self._push(rid, EngineDeadError(f"engine thread failed: {exc!r}"))

    def _drain_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=_IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if item is not None:
                self._apply(*item)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: EngineCommand[Any], reply: _Reply | None) -> None:
        try:
            result = self.engine.handle(command)
        except Exception as exc:  # a caller's mistake (or a failed command): delivered, the engine goes on
            if reply is None:
                log.warning("engine command %s failed: %r", type(command).__name__, exc)
            else:
                reply(None, exc)
            return
        if reply is not None:
            reply(result, None)
        self._deliver(self.engine.take_announced())  # a reservation made now: its blocks, on its stream

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._push(out.request_id, out)

    def _push(self, request_id: str, item: RequestOutput | Exception) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            loop, q = entry
            loop.call_soon_threadsafe(q.put_nowait, item)


def _set_result(future: asyncio.Future[T], value: T) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)

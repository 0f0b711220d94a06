"""A 2-rank torch.distributed process group for one prefill/decode pair, and the two threads that drive it.

Why threads: constructing the group blocks until the peer constructs its side, and gloo's send/recv are
rendezvous-style (a send completes only once the matching recv is posted), so neither may run on an event
loop. Order: both sides must post their data ops in the same order (the order of the control stream). One
*poster* thread per pair constructs the group and then posts every op, strictly in submission order, as soon
as it is submitted (p2p posting does not block); one *waiter* thread waits for the posted ops in the same
order and reports each as finished. So chunk k+1 is already posted while chunk k's bytes move: back-to-back
chunks stream without a rendezvous gap, and at most ``_WINDOW`` ops are in flight.

A broken group (peer died, op timed out) is never reused: every Work is released and the group dropped,
which closes its sockets (a live Work would keep them open), so no late byte can land in a block the caller
has since freed; only then does any op hear of the failure. Backend by device: gloo for CPU tensors, NCCL
for CUDA tensors; everything else is the same code path.
"""

from __future__ import annotations

import collections
import concurrent.futures
import datetime
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kv_transfer.errors import TransferFailed

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})
_WINDOW = 64  # data ops posted and not finished, per pair and side


@dataclass(frozen=True)
class PairGroupConfig:
    """Where and how the pair rendezvous (from the HandshakeReply)."""

    store_host: str
    store_port: int
    prefix: str  # PrefixStore namespace, unique per pair and epoch: f"pair/{sender_id}/{epoch}"
    rank: int  # this side's rank; the peer is 1 - rank
    timeout_s: float  # group timeout: construction and every data op
    bind_host: str  # local address gloo listens on; a wildcard means gloo's default (hostname lookup)


@dataclass(frozen=True)
class DataOp:
    """One unit of work of a pair, posted strictly after every op submitted before it.

    ``tensors`` is called on the poster thread right before posting and returns the contiguous tensors to send
    (or receive into), one p2p op each; None makes the op a marker that moves nothing. ``finish`` is called
    exactly once, on the waiter thread and in submission order: with None once the op's data moved (for a
    marker: once every earlier op finished), or with the reason the group broke or was closed. When ``finish``
    runs, no data of this op is in flight anymore.
    """

    send: bool
    tensors: Callable[[], list[torch.Tensor]] | None
    finish: Callable[[str | None], None]


@dataclass
class _Posted:
    op: DataOp
    works: list[Any]  # gloo/NCCL Work objects; cleared before the group is dropped


class PairGroup:
    """The data plane of one pair: a process group plus its poster and waiter threads, fed through ``submit``."""

    def __init__(self, name: str, device: torch.device, on_broken: Callable[[str], None]) -> None:
        self.name = name
        self.device = device
        # Called once, from a pair thread, when the group breaks by itself (not on close()).
        self._on_broken = on_broken
        self._ops: queue.SimpleQueue[DataOp | None] = queue.SimpleQueue()  # submit -> poster
        self._posted: collections.deque[_Posted | None] = collections.deque()  # poster -> waiter
        self._posted_cv = threading.Condition()
        self._slots = threading.Semaphore(_WINDOW)
        self._lock = threading.Lock()  # guards _error, _closed
        self._error: str | None = None  # once set, nothing more is posted and ops finish with it
        self._closed = False
        self._pg_lock = threading.Lock()  # held while posting, so dropping the group never races a post
        self._pg: Any = None
        self._peer = 0
        self._timeout_s = 0.0
        self._threads: list[threading.Thread] = []

    def start(self, config: PairGroupConfig) -> concurrent.futures.Future[None]:
        """Construct the group on the poster thread, then serve ops; the future tells how construction went."""
        assert not self._threads, "start() twice"
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._peer = 1 - config.rank
        self._timeout_s = config.timeout_s
        self._threads = [
            threading.Thread(target=self._poster, args=(config, ready), name=f"kv-post-{self.name}", daemon=True),
            threading.Thread(target=self._waiter, name=f"kv-wait-{self.name}", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        return ready

    def submit(self, op: DataOp) -> None:
        """Queue ``op`` behind every op submitted before it. Thread-safe."""
        with self._lock:
            if not self._closed:
                self._ops.put(op)
                return
            error = self._error or "pair closed"
        op.finish(error)

    def close(self, reason: str = "pair closed") -> None:
        """Stop moving data: nothing more is posted, the group is dropped and every op not finished yet finishes
        with ``reason``; then both threads exit. The op being waited for (if any) ends first: it completes, or
        fails within the group timeout. Thread-safe, idempotent."""
        with self._lock:
            if self._error is None:
                self._error = reason
            if self._closed:
                return
            self._closed = True
            self._ops.put(None)

    @property
    def running(self) -> bool:
        """True while a pair thread is alive (still moving data, or dropping the group after close)."""
        return any(thread.is_alive() for thread in self._threads)

    def join(self, timeout_s: float) -> bool:
        """Wait (blocking) for both threads to exit; False if one is still busy after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 0))
        return not self.running

    # ------------------------------------------------------------------ pair threads

    def _poster(self, config: PairGroupConfig, ready: concurrent.futures.Future[None]) -> None:
        try:
            self._pg = _construct(config, self.device)
        except Exception as exc:
            reason = f"pair group {config.prefix} could not be formed: {exc}"
            ready.set_exception(TransferFailed(None, reason))
            self._broke(reason)
        else:
            ready.set_result(None)
        while (op := self._ops.get()) is not None:
            self._slots.acquire()  # at most _WINDOW ops posted and not finished
            posted = _Posted(op, [])
            error: str | None = None
            with self._pg_lock:
                if self._error is None and self._pg is not None:
                    try:
                        self._post(posted)
                    except Exception as exc:  # the peer died, a CUDA error: the group is done
                        error = f"pair group {self.name} broke: {exc}"
                with self._posted_cv:
                    self._posted.append(posted)
                    self._posted_cv.notify()
            if error is not None:  # outside the except block: no traceback pins a Work
                self._broke(error)
        with self._posted_cv:
            self._posted.append(None)
            self._posted_cv.notify()

    def _waiter(self) -> None:
        while True:
            with self._posted_cv:
                self._posted_cv.wait_for(lambda: bool(self._posted))
                head = self._posted.popleft()
            if head is None:
                break
            error = self._error
            if error is None:
                try:
                    self._complete(head)
                except Exception as exc:  # the peer died, a timeout, a CUDA error: the group is done
                    error = f"pair group {self.name} broke: {exc}"
                if error is not None:
                    self._broke(error)
            if error is not None:
                head.works.clear()
                self._drop()  # idempotent; also when close() came from outside
            try:
                head.op.finish(error)
            except Exception:
                log.exception("KV pair %s: op bookkeeping failed", self.name)
            self._slots.release()
        self._drop()

    def _post(self, posted: _Posted) -> None:
        """Post the op's p2p ops without waiting (one tag: gloo and NCCL match per peer in posting order)."""
        op = posted.op
        if op.tensors is None:
            return
        post = self._pg.send if op.send else self._pg.recv
        for tensor in op.tensors():
            assert tensor.is_contiguous(), "send/recv need contiguous tensors"
            posted.works.append(post([tensor], self._peer, 0))

    def _complete(self, posted: _Posted) -> None:
        """Wait for the op's p2p ops, each within the group timeout from now."""
        deadline = time.monotonic() + self._timeout_s
        try:
            for work in posted.works:
                # On gloo, wait() is what drives completion (is_completed() stays False until then).
                work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            if posted.works and self.device.type == "cuda":
                self._sync_cuda(deadline)
        finally:
            posted.works.clear()

    def _sync_cuda(self, deadline: float) -> None:
        # NCCL's wait() only orders the current stream after the op; the host learns it finished from an
        # event recorded behind it. Polled with a deadline so a hung peer cannot block the pair forever.
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        while not event.query():
            if time.monotonic() > deadline:
                raise TimeoutError(f"CUDA p2p op not finished after {self._timeout_s}s")
            time.sleep(0.0002)

    def _broke(self, reason: str) -> None:
        with self._lock:
            first = self._error is None
            if first:
                self._error = reason
        if first:
            log.warning("KV pair %s: %s", self.name, reason)
            self._on_broken(reason)

    def _drop(self) -> None:
        """Release every posted Work, then the group itself: its sockets close, no posted recv can land."""
        with self._pg_lock:  # the poster checks _error under this lock, so nothing is posted after this
            with self._posted_cv:
                for posted in self._posted:
                    if posted is not None:
                        posted.works.clear()
            pg, self._pg = self._pg, None
        if pg is not None and self.device.type == "cuda":
            try:
                pg.abort()
            except Exception:
                log.exception("KV pair %s: NCCL abort failed", self.name)
        del pg


def _construct(config: PairGroupConfig, device: torch.device) -> Any:
    """Rendezvous on the decode node's store under the pair's prefix; blocks until the peer constructs too."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=config.timeout_s)
    # A client connection of our own: the store object is not shared across pair threads.
    store = dist.TCPStore(config.store_host, config.store_port, None, False, timeout=timeout)
    prefixed = dist.PrefixStore(config.prefix, store)
    if device.type == "cuda":
        import torch
        from torch.distributed import ProcessGroupNCCL  # type: ignore[attr-defined]  # absent on CPU builds

        torch.cuda.set_device(device)
        nccl_options = ProcessGroupNCCL.Options()
        nccl_options._timeout = timeout
        return ProcessGroupNCCL(prefixed, config.rank, 2, nccl_options)
    gloo = dist.ProcessGroupGloo
    options = gloo._Options()  # type: ignore[attr-defined]  # the options type c10d itself uses
    options._timeout = timeout
    if config.bind_host in WILDCARD_HOSTS:
        options._devices = [gloo.create_default_device()]
    else:
        options._devices = [gloo.create_device(hostname=config.bind_host)]
    return gloo(prefixed, config.rank, 2, options)

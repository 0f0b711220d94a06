"""The decode side's data plane of a same-host pair: the sender copies into our blocks itself.

A KVChunk arrives only once its runs were copied (under their grants, kv_transfer/block_grants.py), so a
chunk's "recv" finishes as soon as it is submitted: ``tensors`` is still called (it claims the blocks in
the transfer table, or picks scratch for a refused chunk, which stays untouched) and ``finish(None)``
follows at once. Same interface as ``PairGroup``, so ``ReceiverPair`` keeps one code path.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kv_transfer.pair_group import DataOp, PairGroupConfig


class LocalPlane:
    """Runs each op inline, in submission order; nothing is ever in flight."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._error: str | None = None

    def start(self, config: PairGroupConfig | None = None) -> concurrent.futures.Future[None]:
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        ready.set_result(None)
        return ready

    def submit(self, op: DataOp) -> None:
        with self._lock:
            error = self._error
        if error is None and op.tensors is not None:
            op.tensors()
        op.finish(error)

    def close(self, reason: str = "pair closed") -> None:
        with self._lock:
            if self._error is None:
                self._error = reason

    @property
    def running(self) -> bool:
        return False

    def join(self, timeout_s: float) -> bool:
        return True

"""Ranks as spawned processes, for the collectives benchmark and the parallel tests (the node's own ranks
are subprocesses with a typed channel: common/parallel/executor.py)."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Sequence


def run_ranks(target: Callable[..., None], args: Sequence[tuple[object, ...]], timeout_s: float) -> list[int | None]:
    """Run ``target(*args[r])`` in one spawned process per rank; return their exit codes once every one ended,
    one failed (the rest are then terminated: a rank waiting on a dead peer would hang) or ``timeout_s`` passed
    (None: still running at the deadline, then terminated)."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=a, daemon=True) for a in args]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    codes: list[int | None] = []
    try:
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
        codes = [p.exitcode for p in procs]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
            proc.join(5)
    return codes

"""Builds every CPU kernel module this CPU runs, ahead of time: ``python -m common.kernel_prebuild``.

``make venv`` (so ``make demo`` and ``make test``) runs it, so that no node and no test compiles under a
start-up deadline; a module already built loads in well under a second.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable

from common.attention.cpu_kernels import paged_decode_kernel
from common.cpu_kernel_module import cpu_kernels
from common.kernel_build import build_root
from common.quant.cpu_kernels import best_isa

log = logging.getLogger(__name__)


def build_all() -> list[tuple[str, bool, float]]:
    """Build (or load) every CPU kernel module for this CPU, as many at once as there are cores (each build
    is one compiler process): [(what, built, seconds)]."""
    from concurrent.futures import ThreadPoolExecutor

    def timed(build: Callable[[], object]) -> tuple[bool, float]:
        start = time.perf_counter()
        try:
            ok = build() is not None
        except RuntimeError as exc:
            log.warning("%s", exc)
            ok = False
        return ok, time.perf_counter() - start

    builds: dict[str, Callable[[], object]] = {"linears, fused ops and the one-call step": cpu_kernels,
                                               "paged decode attention": paged_decode_kernel}
    with ThreadPoolExecutor(max_workers=max(1, min(len(builds), os.cpu_count() or 1))) as pool:
        done = {what: pool.submit(timed, build) for what, build in builds.items()}
        return [(what, *future.result()) for what, future in done.items()]


def main() -> int:
    import torch

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if torch.cuda.is_available():
        print(">> CPU kernels: not built ahead (CUDA is here; a CPU node builds them at start-up)", flush=True)
        return 0
    print(f">> CPU kernels ({best_isa()}) in {build_root()}", flush=True)
    for what, ok, seconds in build_all():
        print(f"   {what}: {'ready' if ok else 'NOT BUILT (a slower path serves)'} ({seconds:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

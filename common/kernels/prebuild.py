"""Builds every CPU kernel module this CPU runs, ahead of time: ``python -m common.kernels.prebuild``.

``make venv`` (so ``make demo`` and ``make test``) runs it, so that no node and no test compiles under a
start-up deadline; a module already built loads in well under a second. ``--next-isa`` also builds the
linears / fused ops / step module for the next-widest instruction set (AVX2 on an AVX-512 machine, the
plain C++ build on an AVX2 one): the test suite checks both, and ``make test`` builds it here, beside pip,
rather than inside a test.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import time
from collections.abc import Callable

from common.kernels.build import build_root
from common.kernels.cpu import cpu_kernels, paged_decode_kernel
from common.kernels.isa import best_isa, runnable_isas

log = logging.getLogger(__name__)


def build_all(next_isa: bool = False) -> list[tuple[str, bool, float]]:
    """Build (or load) every CPU kernel module for this CPU (with ``next_isa``: and the next-widest ISA's
    linears / fused ops / step), as many at once as there are cores (each build is one compiler process):
    [(what, built, seconds)]."""
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
    following = runnable_isas()[1:2]
    if next_isa and following:
        builds[f"linears, fused ops and the one-call step ({following[0]}, for the tests)"] = \
            functools.partial(cpu_kernels, following[0])
    with ThreadPoolExecutor(max_workers=max(1, min(len(builds), os.cpu_count() or 1))) as pool:
        done = {what: pool.submit(timed, build) for what, build in builds.items()}
        return [(what, *future.result()) for what, future in done.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.kernels.prebuild", description=__doc__.split("\n")[0])
    parser.add_argument("--next-isa", action="store_true",
                        help="also build the next-widest instruction set's module (the test suite checks it)")
    args = parser.parse_args(argv)
    import torch

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if torch.cuda.is_available():
        print(">> CPU kernels: not built ahead (CUDA is here; a CPU node builds them at start-up)", flush=True)
        return 0
    print(f">> CPU kernels ({best_isa()}) in {build_root()}", flush=True)
    for what, ok, seconds in build_all(args.next_isa):
        print(f"   {what}: {'ready' if ok else 'NOT BUILT (a slower path serves)'} ({seconds:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

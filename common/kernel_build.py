"""Builds Tandem's C++ CPU kernels with torch's extension loader, safely across processes.

torch's ``load_inline`` guards a build directory with a lock *file* (``FileBaton``): a process that is
killed while it compiles leaves the file behind, and every later process waits on it forever. The test
suite and ``tandem up`` stop nodes at any moment (a start-up deadline, a test that kills a node), so a
killed build used to hang every node started after it. Here each build runs under an ``fcntl.flock`` on
a file beside the build directory instead: the kernel releases it when its holder dies, and whoever holds
it next removes the dead builder's baton before calling ``load_inline``.

Builds live under ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) in a folder named after
the Python and torch versions: torch's own versioner hashes only the sources and flags, so a module built
against another torch would otherwise load and crash.

``python -m common.kernel_build`` builds every kernel module this CPU runs (``make venv`` does, so that no
node or test compiles under a start-up deadline); a module already built loads in about a second.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)


def build_root() -> Path:
    """The folder that holds every Tandem kernel build for this Python and torch."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    tag = f"tandem-py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}".replace("+", "_")
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / tag


def load_kernel_module(name: str, source: str, functions: Sequence[str], cflags: Sequence[str],
                       ldflags: Sequence[str] = ("-fopenmp",)) -> ModuleType:
    """Compile (once) and import the extension ``name`` from one C++ translation unit.

    Raises what ``load_inline`` raises (no compiler, no ninja, a compile error); callers decide whether a
    slower path serves instead.
    """
    from torch.utils.cpp_extension import load_inline

    build_dir = build_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    with (build_dir.parent / f"{name}.flock").open("a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # released by the kernel if this process dies
        try:
            baton = build_dir / "lock"
            if baton.exists():  # no live Tandem builder holds it: we hold the flock
                log.warning("removing %s left by a build that did not finish", baton)
                baton.unlink(missing_ok=True)
            return load_inline(name=name, cpp_sources=[source], functions=list(functions),
                               extra_cflags=list(cflags), extra_ldflags=list(ldflags),
                               build_directory=str(build_dir), verbose=False)
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def build_all() -> list[tuple[str, bool, float]]:
    """Build (or load) every CPU kernel module for this CPU, as many at once as there are cores (each build
    is one compiler process): [(what, built, seconds)]."""
    from concurrent.futures import ThreadPoolExecutor

    from common.attention.cpu_kernels import paged_decode_kernel
    from common.model.fused_ops import cpp_module
    from common.quant.cpu_kernels import quant_kernels

    def timed(build: Callable[[], object]) -> tuple[bool, float]:
        start = time.perf_counter()
        try:
            ok = build() is not None
        except RuntimeError as exc:
            log.warning("%s", exc)
            ok = False
        return ok, time.perf_counter() - start

    builds: dict[str, Callable[[], object]] = {"quantized linears and GEMV": quant_kernels,
                                               "fused layer ops": cpp_module,
                                               "paged decode attention": paged_decode_kernel}
    with ThreadPoolExecutor(max_workers=max(1, min(len(builds), os.cpu_count() or 1))) as pool:
        done = {what: pool.submit(timed, build) for what, build in builds.items()}
        return [(what, *future.result()) for what, future in done.items()]


def main() -> int:
    from common.quant.cpu_kernels import best_isa

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    print(f">> CPU kernels ({best_isa()}) in {build_root()}", flush=True)
    for what, ok, seconds in build_all():
        print(f"   {what}: {'ready' if ok else 'NOT BUILT (a slower path serves)'} ({seconds:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One OpenMP team in a serving process: the engine thread's.

PyTorch's CPU ops run their parallel regions in libgomp, which keeps a team of worker threads per thread that
starts a region. A serving process builds its model in the main thread (loading, and the start-up races that
choose the linear methods, run parallel regions there), then steps the engine in its own thread: two teams,
four libgomp threads on two cores. Past as many threads as CPUs, libgomp cuts the time a waiting worker spins
before it sleeps from ~300,000 rounds to 100 ("throttled"), so the engine's worker slept between nearly every
two kernels of a step and each region began by waking it: the engine thread's worker was busy 60-80% of a
served step, and a 1,024-token prefill step of SmolLM2 (bf16, two Xeon cores, vLLM's client at 2 req/s) took
434 ms on average against 380 ms with the main thread's team let go (session 33:
benchmarks/results/2026-12-06-startup-races/RESULTS.md). Offline, where one thread does everything, the worker
never sleeps.

``hand_over_openmp`` (``TANDEM_CPU_OMP_HANDOFF``: auto, where PyTorch's OpenMP is libgomp with OpenMP 5's
``omp_pause_resource_all``; on: that, or a start-up error; off: both teams stay) lets the calling thread's team
go before the engine thread starts: its workers exit and libgomp counts only the engine's. A later parallel
region in that thread builds a team again (threads that copy KV between nodes run their own; unmeasured).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from common.config.settings import kernel_setting

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp.h: omp_pause_soft (the threads go; the library stays usable)


def loaded_libgomp() -> list[str]:
    """Paths of every libgomp mapped into this process (PyTorch's wheels carry their own); empty elsewhere."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return []
    paths = {line.split(maxsplit=5)[-1].strip() for line in maps.read_text().splitlines() if "libgomp" in line}
    return sorted(p for p in paths if p.startswith("/"))


def _libgomps() -> list[ctypes.CDLL]:
    return [ctypes.CDLL(path) for path in loaded_libgomp()]


def libgomp_functions(name: str) -> list[Any]:
    """``name`` (a ctypes function) in every libgomp mapped into this process that has it."""
    return [fn for lib in _libgomps() if (fn := getattr(lib, name, None)) is not None]


def thread_count_setter() -> Callable[[int], None]:
    """Sets the calling thread's OpenMP thread count without torch.set_num_threads (which also resets PyTorch's
    global count and clears oneDNN's computation cache): libgomp's own ``omp_set_num_threads`` where PyTorch
    runs on libgomp, else torch's."""
    for fn in libgomp_functions("omp_set_num_threads"):
        fn.argtypes, fn.restype = [ctypes.c_int], None
        return fn  # type: ignore[no-any-return]
    import torch

    return torch.set_num_threads


def pin_team(cpus: Sequence[int]) -> bool:
    """Bind the calling thread's OpenMP team, one thread per CPU: thread ``i`` (0: the caller) to ``cpus[i]``.

    One parallel region of ``len(cpus)`` threads in every libgomp of the process, each thread setting its own
    affinity; libgomp keeps a team's threads in their places across regions and thread counts, so a later region of
    ``k`` threads runs on ``cpus[:k]``. Without it the team's threads share the set of CPUs they were started on,
    and a woken worker may land on the CPU its master runs on while another CPU idles (session 42: a lent prefill
    layer's worker and master took turns on one core for up to 88 ms of a 108 ms forward). False where PyTorch's
    OpenMP is not libgomp (nothing bound)."""
    import os

    callback_type = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    pinned = False
    for lib in _libgomps():
        parallel, thread_num = getattr(lib, "GOMP_parallel", None), getattr(lib, "omp_get_thread_num", None)
        if parallel is None or thread_num is None:
            continue
        thread_num.argtypes, thread_num.restype = [], ctypes.c_int
        parallel.argtypes = [callback_type, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        parallel.restype = None
        errors: list[BaseException] = []

        def bind(_: object, thread_num: Any = thread_num, errors: list[BaseException] = errors) -> None:
            try:
                os.sched_setaffinity(0, {cpus[thread_num()]})
            except BaseException as exc:  # raised in a libgomp thread: reported in the caller
                errors.append(exc)

        body = callback_type(bind)
        parallel(body, None, len(cpus), 0)  # ctypes lets the GIL go: each thread takes it to run bind
        if errors:
            raise errors[0]
        pinned = True
    return pinned


def hand_over_openmp() -> bool:
    """Let the calling thread's libgomp team go (see the module docstring); True when one was let go or none
    existed. Call it from the thread that built the model, before the engine thread's first step."""
    mode = str(kernel_setting("cpu_omp_handoff"))  # TANDEM_CPU_OMP_HANDOFF
    if mode == "off":
        return False
    released = False
    for pause in libgomp_functions("omp_pause_resource_all"):
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        released = pause(OMP_PAUSE_SOFT) == 0 or released
    if not released:
        if mode == "on":
            raise RuntimeError("TANDEM_CPU_OMP_HANDOFF=on, but this process has no libgomp with "
                               "omp_pause_resource_all to let the start-up thread's OpenMP team go")
        log.info("the start-up thread's OpenMP team stays: no libgomp with omp_pause_resource_all here")
    return released

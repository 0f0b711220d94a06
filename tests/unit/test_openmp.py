"""The start-up thread's OpenMP team let go when the engine thread takes over (common/kernels/openmp.py). Each
probe runs in a fresh interpreter with two OpenMP threads: libgomp's teams are process-wide state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.kernels.openmp import hand_over_openmp, loaded_libgomp

REPO = Path(__file__).resolve().parents[2]
# A parallel region in the main thread (it builds a libgomp team: one worker thread beside it), the hand-over,
# then a parallel region in another thread (the engine's): the process's threads after each, and its result.
PROBE = """
import json, os, sys, threading, torch
sys.path.insert(0, {repo!r})
from common.kernels.openmp import hand_over_openmp, loaded_libgomp
torch.set_num_threads(2)
def threads():
    return len(os.listdir("/proc/self/task"))
before = threads()
x = torch.ones(1 << 24)
x.add_(1)  # a parallel region in this thread: its team's worker stays
with_team = threads()
handed = hand_over_openmp()
after = threads()
out = {{}}
def engine():
    y = torch.ones(1 << 24)
    y.mul_(3)
    out["sum"] = float(y.sum())
t = threading.Thread(target=engine)
t.start()
t.join()
print(json.dumps({{"libgomp": bool(loaded_libgomp()), "before": before, "with_team": with_team, "handed": handed,
                  "after": after, "sum": out["sum"]}}))
"""


def _probe(mode: str) -> dict[str, int | bool | float]:
    env = {**os.environ, "TANDEM_CPU_OMP_HANDOFF": mode, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(repo=str(REPO))], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    result: dict[str, int | bool | float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_the_start_up_threads_team_goes_and_the_engine_thread_still_runs_in_parallel() -> None:
    got = _probe("auto")
    if not got["libgomp"]:
        pytest.skip("PyTorch's OpenMP here is not libgomp")
    assert got["with_team"] == got["before"] + 1  # the main thread's worker
    assert got["handed"] is True and got["after"] == got["before"]  # ... gone
    assert got["sum"] == 3.0 * (1 << 24)


def test_off_keeps_the_team() -> None:
    got = _probe("off")
    if not got["libgomp"]:
        pytest.skip("PyTorch's OpenMP here is not libgomp")
    assert got["handed"] is False and got["after"] == got["with_team"]


def test_a_bad_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CPU_OMP_HANDOFF", "sometimes")
    with pytest.raises(ValueError, match="TANDEM_CPU_OMP_HANDOFF='sometimes'; choose one of auto, on, off"):
        hand_over_openmp()


def test_libgomp_is_found_where_pytorch_loads_it() -> None:
    import torch

    paths = loaded_libgomp()
    assert all(Path(p).exists() for p in paths)
    if sys.platform == "linux" and torch.backends.openmp.is_available():
        # Linux wheels of PyTorch carry GNU's OpenMP (torch/lib/libgomp*.so*), loaded with torch itself
        assert any(Path(p).name.startswith("libgomp") for p in paths), paths


# An engine thread on one CPU binds its team to that CPU and another: where each thread of the team may run after,
# across regions of one and two threads (the thread count a lending prefill node switches layer by layer).
PIN_PROBE = """
import json, os, sys, threading, torch
sys.path.insert(0, {repo!r})
from common.kernels.openmp import pin_team, thread_count_setter
cpus = sorted(os.sched_getaffinity(0))[:2]
def allowed():
    out = {{}}
    for tid in os.listdir("/proc/self/task"):
        out[int(tid)] = sorted(os.sched_getaffinity(int(tid)))
    return out
out = {{}}
def engine():
    os.sched_setaffinity(0, {{cpus[0]}})
    before = set(allowed())
    out["pinned"] = pin_team(cpus)
    set_threads = thread_count_setter()
    x = torch.ones(1 << 22)
    for n in (1, 2, 1, 2):
        set_threads(n)
        x.add_(1)
    now = allowed()
    out["engine"] = now[threading.get_native_id()]
    out["workers"] = [now[t] for t in set(now) - before]
    out["sum"] = float(x.sum())
t = threading.Thread(target=engine)
t.start()
t.join()
print(json.dumps({{"cpus": cpus, **out}}))
"""


def test_pin_team_binds_the_engine_threads_team_one_thread_per_cpu() -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    out = subprocess.run([sys.executable, "-c", PIN_PROBE.format(repo=str(REPO))], capture_output=True, text=True,
                         timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if not got["pinned"]:
        pytest.skip("PyTorch's OpenMP here is not libgomp")
    first, second = got["cpus"]
    assert got["engine"] == [first]  # the calling thread: thread 0 of its team
    assert got["workers"] == [[second]]  # its one worker, still there and still bound after 1- and 2-thread regions
    assert got["sum"] == 5.0 * (1 << 22)

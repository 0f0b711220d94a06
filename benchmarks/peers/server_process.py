"""A peer's own HTTP server as a child process (vLLM's, llama.cpp's): started on a free loopback port with its
output in a log file, ready at its first ``200`` on ``GET /health``, stopped with its whole process group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from common.serving.port_reservation import reserve_port


def healthy(base_url: str) -> bool:
    """Whether ``GET base_url/health`` answers 200 (servers answer 503 while they load)."""
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2.0) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def server_process(name: str, argv: Callable[[int], list[str]], env: Mapping[str, str], log_path: Path,
                   ready_timeout_s: float, stop_grace_s: float) -> Iterator[tuple[str, float]]:
    """Start ``argv(port)``; yield (its base URL, seconds from start to its first healthy answer). Raises
    ``RuntimeError`` naming ``name`` and the log when it exits or is not ready in time. On exit its process
    group gets SIGTERM, then SIGKILL after ``stop_grace_s``."""
    port = reserve_port()
    base_url = f"http://127.0.0.1:{port}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv(port), env=dict(env), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        while not healthy(base_url):
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode} during start-up; see {log_path}")
            if time.monotonic() - start > ready_timeout_s:
                raise RuntimeError(f"{name} was not ready within {ready_timeout_s:.0f} s; see {log_path}")
            time.sleep(0.5)
        yield base_url, time.monotonic() - start
    finally:
        stop(proc, stop_grace_s)


def stop(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM to ``proc``'s process group, SIGKILL when it outlives ``grace_s``."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

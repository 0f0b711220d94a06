"""Remote control for harness processes (tests/kv_transfer/harness.py): real processes, gloo, loopback."""

from __future__ import annotations

import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).with_name("harness.py")
_names = itertools.count()


class Harness:
    """One node process. ``send`` returns a request id; ``reply`` waits for its answer (bounded)."""

    def __init__(self, role: str, log_dir: Path, **config: Any) -> None:
        self.role = role
        self.config = config
        self.log_path = log_dir / f"{role}-{next(_names)}.log"
        # The checkout first, what the caller's PYTHONPATH holds after it (the GPU lease's installed wheels).
        python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": python_path, "OMP_NUM_THREADS": "1"}
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(HARNESS), json.dumps({"role": role, **config})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, cwd=ROOT, env=env,
        )
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._replies: dict[int, queue.Queue[dict[str, Any]]] = {}
        self._events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._ready: queue.Queue[dict[str, Any]] = queue.Queue()
        self.info: dict[str, Any] = {}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            if "id" in msg:
                self._reply_queue(msg["id"]).put(msg)
            elif "event" in msg:
                self._events.put(msg)
            elif msg.get("ready"):
                self._ready.put(msg)

    def _reply_queue(self, rid: int) -> queue.Queue[dict[str, Any]]:
        with self._lock:
            return self._replies.setdefault(rid, queue.Queue())

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text().splitlines()[-lines:])

    def wait_ready(self, timeout_s: float = 60) -> Harness:
        try:
            self.info = self._ready.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"{self.role} harness not ready:\n{self.log_tail()}") from None
        return self

    def send(self, cmd: str, **args: Any) -> int:
        rid = next(self._ids)
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"id": rid, "cmd": cmd, **args}) + "\n")
        self.proc.stdin.flush()
        return rid

    def reply(self, rid: int, timeout_s: float = 30) -> dict[str, Any]:
        try:
            msg = self._reply_queue(rid).get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"{self.role} harness: no reply to #{rid}:\n{self.log_tail()}") from None
        assert msg["ok"], f"{self.role} harness: {msg['error']}\n{self.log_tail()}"
        return msg

    def call(self, cmd: str, reply_timeout_s: float = 30, **args: Any) -> dict[str, Any]:
        return self.reply(self.send(cmd, **args), reply_timeout_s)

    def event(self, name: str, timeout_s: float = 30) -> dict[str, Any]:
        try:
            msg = self._events.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"{self.role} harness: no {name} event:\n{self.log_tail()}") from None
        assert msg["event"] == name, msg
        return msg

    def destination(self, reservation: dict[str, Any], transfer_id: str) -> dict[str, Any]:
        """The KVDestination (as a dict) for a reservation this decode harness made."""
        return {"kv_endpoint": self.info["kv_endpoint"], "node_id": self.info["node_id"], "transfer_id": transfer_id,
                "block_ids": reservation["block_ids"], "num_cached_tokens": reservation["num_cached_tokens"]}

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def begin_close(self) -> None:
        """Ask for a graceful shutdown (closes stdin: the harness closes its receiver / sender and exits)."""
        if self.proc.poll() is None and self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()

    def close(self) -> None:
        self.begin_close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()
        self._log.close()


def stop(harnesses: list[Harness]) -> None:
    """Shut several harnesses down at once."""
    for harness in harnesses:
        harness.begin_close()
    for harness in harnesses:
        harness.close()


def start(log_dir: Path, *nodes: tuple[str, dict[str, Any]]) -> list[Harness]:
    """Start several harnesses at once (interpreter start-up dominates) and wait until all are ready."""
    harnesses = [Harness(role, log_dir, **config) for role, config in nodes]
    try:
        return [h.wait_ready() for h in harnesses]
    except BaseException:
        stop(harnesses)
        raise


SPEC = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": 4, "dtype": "bfloat16"}
BYTES_PER_BLOCK = 2 * 2 * 4 * 2 * 8 * 2  # num_layers * (K, V) * block_size * heads * head_dim * bf16


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., list[Harness]]]:
    """``spawn(("decode", {...}), ("prefill", {...}))`` starts harnesses and stops them (kills stragglers) after."""
    started: list[Harness] = []

    def factory(*nodes: tuple[str, dict[str, Any]]) -> list[Harness]:
        harnesses = start(tmp_path, *nodes)
        started.extend(harnesses)
        return harnesses

    yield factory
    stop(started)


@pytest.fixture(scope="module", params=["socket", "shm"])
def kv_cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Harness]]:
    """One decode and two prefill processes for a whole module, pickle disabled inside all three; once with
    the socket data plane (gloo pair groups), once with the same-host one (shared memory).

    Block ids are fragmented on both sides (every 3rd decode block and every 4th prefill block pinned), so
    runs break on either side.
    """
    common = {**SPEC, "forbid_pickle": True, "group_timeout_s": 10.0, "transport": request.param}
    nodes = start(
        tmp_path_factory.mktemp("kv-cluster"),
        ("decode", {**common, "num_blocks": 192, "fragment": 3, "node_id": "decode-0"}),
        ("prefill", {**common, "num_blocks": 96, "fragment": 4, "node_id": "prefill-0"}),
        ("prefill", {**common, "num_blocks": 96, "node_id": "prefill-1"}),
    )
    yield nodes
    stop(nodes)

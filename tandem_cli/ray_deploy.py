"""``tandem ray``: Tandem on a Ray cluster, for more than one machine (docs/multi-machine.md).

Plain detached Ray actors, not a Ray Serve application: each actor runs one Tandem process (``tandem serve
gateway|prefill|decode``) and keeps it alive, so Tandem keeps its own gRPC data path, its KV plane and its
gateway's routing; Ray carries only placement (a STRICT_PACK placement group per node, one bundle per rank),
lifetimes (``max_restarts``: a node whose process dies is restarted by Ray, and re-registers with the
gateway's Membership service) and discovery (named actors in the ``tandem`` namespace: ``DEPLOYMENT:ROLE-I``).
Ray's own control calls carry only strings and small dicts; nothing Tandem sends on its wires is pickled.

The gateway actor also holds the deployment's record (``DeploymentSpec`` as JSON), so ``tandem ray scale``
and ``tandem ray down`` from any machine of the cluster find everything by the deployment's name.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

NAMESPACE = "tandem"
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class DeploymentSpec:
    """What ``tandem ray up`` was asked for: enough for ``scale`` to start more nodes like the first ones."""

    name: str = "tandem"
    model_args: tuple[str, ...] = ()  # flags for every process (--model, --dtype...)
    node_args: tuple[str, ...] = ()  # extra flags for every prefill/decode node
    prefill_args: tuple[str, ...] = ()  # a role's own flags (its T x P layout)
    decode_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    # Per rank (one placement-group bundle each); a node takes the list's entries in turn (node i: i mod len).
    prefill_resources: tuple[dict[str, float], ...] = ({"CPU": 1.0},)
    decode_resources: tuple[dict[str, float], ...] = ({"CPU": 1.0},)
    gateway_resources: dict[str, float] = dataclasses.field(default_factory=dict)
    prefill_ranks: int = 1  # T x P of a prefill node: the bundles packed on one Ray node
    decode_ranks: int = 1
    gateway_port: int = 50051
    http_port: int = 0
    internal_port: int = 50052
    placement_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.name or ":" in self.name:
            raise ValueError(f"--name: {self.name!r} must be non-empty and contain no ':'")
        for role in ROLES:
            if not getattr(self, f"{role}_resources"):
                raise ValueError(f"--{role}-resources: give at least one resource dict")
            if getattr(self, f"{role}_ranks") < 1:
                raise ValueError(f"{role} ranks (T x P) must be >= 1")

    def resources(self, role: str, index: int) -> dict[str, float]:
        options: tuple[dict[str, float], ...] = getattr(self, f"{role}_resources")
        return options[index % len(options)]

    def ranks(self, role: str) -> int:
        return int(getattr(self, f"{role}_ranks"))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> DeploymentSpec:
        raw = json.loads(text)
        for key in ("model_args", "node_args", "prefill_args", "decode_args", "gateway_args", "prefill_resources",
                    "decode_resources"):
            raw[key] = tuple(raw[key])
        return cls(**raw)


def parse_resources(text: str, flag: str) -> tuple[dict[str, float], ...]:
    """``'{"host_a": 1}'`` (every node) or ``'[{"host_b": 1}, {"host_c": 1}]'`` (node i takes entry i mod n):
    the resources of one rank's bundle."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag}: {text!r} is not JSON ({exc.msg})") from None
    items = value if isinstance(value, list) else [value]
    out = []
    for item in items:
        if not isinstance(item, dict) or not item or not all(
                isinstance(k, str) and isinstance(v, int | float) and v > 0 for k, v in item.items()):
            raise ValueError(f"{flag}: {text!r}: each entry must be a non-empty object of resource -> amount > 0")
        out.append({k: float(v) for k, v in item.items()})
    return tuple(out)


def actor_name(deployment: str, member: str) -> str:
    return f"{deployment}:{member}"


class TandemProcess:
    """A Ray actor that runs one Tandem service process on its Ray node and keeps it alive: when the process
    exits (killed, crashed), the actor exits too, and Ray restarts the actor (``max_restarts``), which starts
    the process again; a node then registers with the gateway again under the same node id."""

    def __init__(self, role: str, member: str, args: list[str], ports: list[int], host_id: str = "",
                 spec: str = "") -> None:
        import ray

        from common.serving.port_reservation import reserve_ports

        self.role, self.member = role, member
        self._spec = spec  # the gateway's: the deployment's record, kept across Ray's restarts of the actor
        self.host = ray.util.get_node_ip_address()  # Tandem listens where Ray does (127.0.0.1 on a one-box cluster)
        self.ray_node_id = ray.get_runtime_context().get_node_id()
        self.port = ports[0] if ports and ports[0] else reserve_ports(1)[0]
        argv = [sys.executable, "-m", "tandem_cli", "serve", role, "--host", self.host, "--port", str(self.port),
                *args]
        if role != "gateway":
            # One host identity per Ray node: KV between Ray nodes goes over sockets, within one over shared memory.
            argv += ["--node-id", member, "--host-id", host_id or self.ray_node_id]
        self._stopping = threading.Event()
        started = threading.Event()
        threading.Thread(target=self._watch, args=(argv, started), name="tandem-ray-watch", daemon=True).start()
        started.wait()

    def _watch(self, argv: list[str], started: threading.Event) -> None:
        """Start the process and wait for it, on one thread that lives as long as it: the process's death
        signal (PR_SET_PDEATHSIG, armed by child_setup) follows the thread that started it."""
        from tandem_cli.child_setup import PARENT_PID_ENV

        env = {**os.environ, PARENT_PID_ENV: str(os.getpid())}  # the process dies with this actor
        self.proc = subprocess.Popen(argv, env=env, start_new_session=True)
        started.set()
        self.proc.wait()
        if not self._stopping.is_set():  # Ray restarts the actor, which starts the process again
            print(f"tandem ray: {self.member} exited with {self.proc.returncode}; the actor exits for Ray to "
                  f"restart it", file=sys.stderr, flush=True)
            os._exit(1)

    def info(self) -> dict[str, Any]:
        return {"member": self.member, "role": self.role, "address": f"{self.host}:{self.port}",
                "ray_node_id": self.ray_node_id, "pid": self.proc.pid, "actor_pid": os.getpid(),
                "running": self.proc.poll() is None}

    def wait_serving(self, timeout_s: float) -> dict[str, Any]:
        """Block until the process answers its gRPC health check SERVING; raise when it exits or times out."""
        from tandem_cli.launcher import is_serving

        deadline = time.monotonic() + timeout_s
        while not is_serving(f"{self.host}:{self.port}", 2.0):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.member} exited with code {self.proc.returncode} during start-up "
                                   f"(its log is the Ray worker's: `ray logs` on {self.host})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.member} was not serving within {timeout_s:.0f} s")
            time.sleep(0.3)
        return self.info()

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM (the node deregisters and finishes its calls), SIGKILL after ``grace_s``."""
        self._stopping.set()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode

    def spec(self) -> str:
        """The deployment's record (the gateway actor holds it): ``DeploymentSpec`` as JSON."""
        return self._spec

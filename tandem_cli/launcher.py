"""``tandem up``: 1 gateway + N prefill + M decode nodes as local processes.

Each node gets its own CPU cores and a matching torch thread count (oversubscribed OpenMP threads make
small matrix products 10-100x slower), as separate GPUs would give each its own device. compose.yaml
describes the same topology for containers; ``tests/deploy/test_compose.py`` checks they agree.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

GATEWAY_PORT = 50051
# Fixed internal ports, as in compose.yaml: prefill nodes from 50061, decode nodes from 50071.
PREFILL_BASE_PORT = 50061
DECODE_BASE_PORT = 50071


@dataclass(frozen=True)
class NodeSpec:
    name: str  # "gateway", "prefill-0", "decode-1"...
    role: str  # "gateway" | "prefill" | "decode"
    port: int
    args: tuple[str, ...] = ()
    cpus: tuple[int, ...] = ()  # empty: no pinning
    metrics_port: int | None = None  # its Prometheus /metrics port, when the topology serves metrics

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass(frozen=True)
class Topology:
    """The processes of one local deployment."""

    num_prefill: int = 1
    num_decode: int = 1
    gateway_port: int = GATEWAY_PORT
    free_ports: bool = False  # tests: pick free ports instead of the fixed ones
    model_args: tuple[str, ...] = ()  # flags for every process: --model, --home, --dtype...
    node_args: tuple[str, ...] = ()  # extra flags for every prefill/decode node
    decode_args: tuple[str, ...] = ()  # extra flags for decode nodes only (speculative decoding)
    gateway_args: tuple[str, ...] = ()
    cpus: tuple[int, ...] = field(default_factory=lambda: tuple(sorted(os.sched_getaffinity(0))))
    # Prometheus /metrics: the gateway on metrics_base_port, prefill nodes on the next ports, then decode
    # nodes. None: no metrics endpoints. With free_ports, free ports are picked instead (any value but None).
    metrics_base_port: int | None = None

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("num_prefill and num_decode must be >= 1")
        n = self.num_prefill + self.num_decode + 1
        base = self.metrics_base_port
        if base is not None and not self.free_ports and not 1 <= base <= 65536 - n:
            raise ValueError(f"metrics_base_port must be in [1, {65536 - n}] ({n} services), got {base}")

    def nodes(self) -> list[NodeSpec]:
        n = self.num_prefill + self.num_decode + 1
        ports = _free_ports(n) if self.free_ports else None
        metrics_ports = self._metrics_ports(n)
        workers = [("prefill", i) for i in range(self.num_prefill)] + [("decode", i) for i in range(self.num_decode)]
        specs: list[NodeSpec] = []
        for k, (role, i) in enumerate(workers):
            base = PREFILL_BASE_PORT if role == "prefill" else DECODE_BASE_PORT
            port = ports[k] if ports else base + i
            extra = self.decode_args if role == "decode" else ()
            metrics_port = metrics_ports[k + 1] if metrics_ports else None
            metrics = ("--metrics-port", str(metrics_port)) if metrics_port else ()
            specs.append(NodeSpec(f"{role}-{i}", role, port,
                                  ("--node-id", f"{role}-{i}", *self.model_args, *self.node_args, *extra, *metrics),
                                  self._cores(k, len(workers)), metrics_port))
        gateway_port = ports[-1] if ports else self.gateway_port
        prefill = ",".join(s.target for s in specs if s.role == "prefill")
        decode = ",".join(s.target for s in specs if s.role == "decode")
        metrics_port = metrics_ports[0] if metrics_ports else None
        metrics = ("--metrics-port", str(metrics_port)) if metrics_port else ()
        gateway = NodeSpec("gateway", "gateway", gateway_port,
                           ("--prefill", prefill, "--decode", decode, *self.model_args, *self.gateway_args, *metrics),
                           (), metrics_port)
        return [*specs, gateway]

    def _metrics_ports(self, n: int) -> list[int] | None:
        """The gateway's first, then the workers' in order."""
        if self.metrics_base_port is None:
            return None
        if self.free_ports:
            return _free_ports(n)
        return [self.metrics_base_port + k for k in range(n)]

    def _cores(self, k: int, n: int) -> tuple[int, ...]:
        return split_cores(self.cpus, k, n)


@dataclass(frozen=True)
class ColocatedTopology:
    """``replicas`` colocated servers (``tandem serve colocated``), each on its own cores: the disaggregated
    topology's baseline on the same hardware (as many replicas as it has prefill + decode nodes). Clients
    spread requests over the replicas themselves; there is no gateway."""

    replicas: int = 1
    base_port: int = GATEWAY_PORT
    free_ports: bool = False
    model_args: tuple[str, ...] = ()
    node_args: tuple[str, ...] = ()  # engine flags (KV cache size, batch limits) for every replica
    cpus: tuple[int, ...] = field(default_factory=lambda: tuple(sorted(os.sched_getaffinity(0))))

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("replicas must be >= 1")

    def nodes(self) -> list[NodeSpec]:
        ports = _free_ports(self.replicas) if self.free_ports else [self.base_port + i for i in range(self.replicas)]
        return [NodeSpec(f"colocated-{i}", "colocated", port,
                         ("--node-id", f"colocated-{i}", *self.model_args, *self.node_args),
                         split_cores(self.cpus, i, self.replicas))
                for i, port in enumerate(ports)]


def split_cores(cpus: tuple[int, ...], k: int, n: int) -> tuple[int, ...]:
    """Process ``k`` of ``n``'s cores: split evenly; with fewer cores than processes, shared round-robin."""
    if len(cpus) >= n:
        per = len(cpus) // n
        return cpus[k * per : (k + 1) * per]
    return (cpus[k % len(cpus)],)


def _child_setup(cpus: set[int]) -> None:
    """In the child before exec: pin its cores, and die with the launcher (no orphans if it is killed)."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    except OSError:  # not Linux/glibc: the launcher's own stop() still ends the children
        pass


def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Launcher:
    """Start, health-check and stop the processes of a topology."""

    def __init__(self, topology: Topology | ColocatedTopology, log_dir: Path | None = None,
                 env: dict[str, str] | None = None, role_env: dict[str, dict[str, str]] | None = None) -> None:
        """``env`` is added to every process's environment, ``role_env[role]`` to that role's (it wins)."""
        self.topology = topology
        self.specs = topology.nodes()
        self.log_dir = log_dir
        self.env = env or {}
        self.role_env = role_env or {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def gateway(self) -> NodeSpec:
        return next(s for s in self.specs if s.role == "gateway")

    def start(self, only: str | None = None) -> None:
        """Start every process, or those of one role (``only``)."""
        for spec in self.specs:
            if only is not None and spec.role != only:
                continue
            env = {**os.environ, **self.env, **self.role_env.get(spec.role, {})}
            if spec.cpus:
                threads = str(len(spec.cpus))
                env.update(TANDEM_NUM_THREADS=threads, OMP_NUM_THREADS=threads)
            argv = [sys.executable, "-m", "tandem_cli", "serve", spec.role, "--port", str(spec.port), *spec.args]
            out = None
            if self.log_dir is not None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                out = open(self.log_dir / f"{spec.name}.log", "wb")  # noqa: SIM115 - lives as long as the process
            cpus = set(spec.cpus)
            self.procs[spec.name] = subprocess.Popen(
                argv, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                preexec_fn=lambda cpus=cpus: _child_setup(cpus),
                start_new_session=True,  # Ctrl-C reaches us only; we stop the children in order
            )

    def wait_healthy(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        for spec in self.specs:
            while spec.name in self.procs:
                proc = self.procs[spec.name]
                if proc.poll() is not None:
                    raise RuntimeError(f"{spec.name} exited with code {proc.returncode} during start-up"
                                       + (f"; see {self.log_dir / (spec.name + '.log')}" if self.log_dir else ""))
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{spec.name} was not healthy within {timeout_s:.0f} s")
                if is_serving(spec.target, min(2.0, remaining)):
                    break
                time.sleep(0.2)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM (graceful drain) the gateway first, then the nodes; SIGKILL what is left after grace."""
        for spec in sorted(self.specs, key=lambda s: s.role != "gateway"):
            proc = self.procs.get(spec.name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def __enter__(self) -> Launcher:
        # Nodes first, the gateway once they answer: its first Stats poll then sees every node up.
        self.start(only="prefill")
        self.start(only="decode")
        self.start(only="colocated")
        try:
            self.wait_healthy()
            self.start(only="gateway")
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def is_serving(target: str, timeout_s: float) -> bool:
    """One gRPC health check: True when the server answers SERVING."""
    return check_health(target, timeout_s) == "SERVING"


def check_health(target: str, timeout_s: float, service: str = "") -> str:
    """One gRPC health check (``grpc.health.v1``) of ``service`` ("" = the whole server) at ``target``:
    the status it answers (``SERVING``, ``NOT_SERVING``...), or the RPC's error code when it answers none."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout_s)
    except grpc.RpcError as exc:
        code = exc.code() if isinstance(exc, grpc.Call) else None
        return code.name if code is not None else "UNAVAILABLE"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

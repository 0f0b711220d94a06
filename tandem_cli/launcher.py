"""``tandem up``: 1 gateway + N prefill + M decode nodes as local processes.

Each node gets its own CPU cores and a matching torch thread count (oversubscribed OpenMP threads make
small matrix products many times slower: benchmarks/results/figures-from-code.md), as separate GPUs would
give each its own device. compose.yaml describes the same topology for containers;
``tests/deploy/test_compose.py`` checks they agree.

Supervision (``RestartPolicy``, what compose's ``restart: unless-stopped`` does): once the deployment is
up, a process that exits for any reason is started again on the same port after an exponential backoff,
and the restart is logged; the rest keep serving, and the gateway routes to a node again once its Stats
answer. Only ``stop`` (Ctrl-C, SIGTERM) ends the deployment.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from common.engine.core_lending import SPINCOUNT
from common.errors import EXIT_ADDRESS_IN_USE
from common.serving.port_reservation import reserve_ports
from tandem_cli.child_setup import PARENT_PID_ENV, PIN_CPUS_ENV

if TYPE_CHECKING:
    import grpc

GATEWAY_PORT = 50051
MAX_PORT_MOVES = 3  # per process and start: a port lost to another process is chosen again this often
HTTP_PORT = 8000  # the gateway's OpenAI-compatible HTTP API (vLLM's and SGLang's usual port)
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
    http_port: int | None = None  # the gateway's OpenAI-compatible HTTP API, when it serves one
    # A prefill node's: a decode node's cores it may run its layers on while that node is idle (core lending:
    # common/engine/core_lending.py); the process starts pinned to both sets.
    borrow_cpus: tuple[int, ...] = ()
    files: tuple[str, ...] = ()  # files it keeps (a decode node's activity file), removed when the launcher stops

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def ports(self) -> tuple[int, ...]:
        """Every port it listens on: gRPC, then metrics and HTTP where it serves them."""
        return (self.port, *(p for p in (self.metrics_port, self.http_port) if p))


@dataclass(frozen=True)
class Topology:
    """The processes of one local deployment."""

    num_prefill: int = 1
    num_decode: int = 1
    gateway_port: int = GATEWAY_PORT
    http_port: int | None = HTTP_PORT  # the gateway's HTTP API; None: off (with free_ports: a free port)
    free_ports: bool = False  # tests: pick free ports instead of the fixed ones
    model_args: tuple[str, ...] = ()  # flags for every process: --model, --home, --dtype...
    node_args: tuple[str, ...] = ()  # extra flags for every prefill/decode node
    decode_args: tuple[str, ...] = ()  # extra flags for decode nodes only (speculative decoding, parallel layout)
    prefill_args: tuple[str, ...] = ()  # extra flags for prefill nodes only (their parallel layout)
    gateway_args: tuple[str, ...] = ()
    cpus: tuple[int, ...] = field(default_factory=lambda: tuple(sorted(os.sched_getaffinity(0))))
    # Prometheus /metrics: the gateway on metrics_base_port, prefill nodes on the next ports, then decode
    # nodes. None: no metrics endpoints. With free_ports, free ports are picked instead (any value but None).
    metrics_base_port: int | None = None
    # Prefill node i runs its layers on decode node i's cores too while that node is idle (CPU nodes with a model
    # in their own process, each on cores of its own; common/engine/core_lending.py). ``tandem up``: on.
    cpu_lending: bool = False

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("num_prefill and num_decode must be >= 1")
        n = self.num_prefill + self.num_decode + 1
        base = self.metrics_base_port
        if base is not None and not self.free_ports and not 1 <= base <= 65536 - n:
            raise ValueError(f"metrics_base_port must be in [1, {65536 - n}] ({n} services), got {base}")

    def nodes(self) -> list[NodeSpec]:
        n = self.num_prefill + self.num_decode + 1
        ports = reserve_ports(n + 1) if self.free_ports else None  # the last one: HTTP
        metrics_ports = self._metrics_ports(n)
        workers = [("prefill", i) for i in range(self.num_prefill)] + [("decode", i) for i in range(self.num_decode)]
        cores = [self._cores(k, len(workers)) for k in range(len(workers))]
        # Lending pairs prefill node i with decode node i, each on cores of its own.
        pairs = min(self.num_prefill, self.num_decode) if self.cpu_lending and len(self.cpus) >= len(workers) else 0
        activity = [activity_path(f"decode-{i}") for i in range(pairs)]
        specs: list[NodeSpec] = []
        for k, (role, i) in enumerate(workers):
            base = PREFILL_BASE_PORT if role == "prefill" else DECODE_BASE_PORT
            port = ports[k] if ports else base + i
            extra = self.decode_args if role == "decode" else self.prefill_args
            metrics_port = metrics_ports[k + 1] if metrics_ports else None
            metrics = ("--metrics-port", str(metrics_port)) if metrics_port else ()
            lending: tuple[str, ...] = ()
            borrow: tuple[int, ...] = ()
            files: tuple[str, ...] = ()
            if i < pairs and role == "prefill":
                borrow = cores[self.num_prefill + i]
                lending = ("--borrow-cpus", ",".join(map(str, borrow)), "--borrow-from", activity[i])
            elif i < pairs:
                lending, files = ("--activity-file", activity[i]), (activity[i],)
            specs.append(NodeSpec(f"{role}-{i}", role, port,
                                  ("--node-id", f"{role}-{i}", *self.model_args, *self.node_args, *extra, *metrics,
                                   *lending), cores[k], metrics_port, borrow_cpus=borrow, files=files))
        gateway_port = ports[-2] if ports else self.gateway_port
        http_port = None if self.http_port is None else ports[-1] if ports else self.http_port
        http = ("--http-port", str(http_port)) if http_port else ()
        prefill = ",".join(s.target for s in specs if s.role == "prefill")
        decode = ",".join(s.target for s in specs if s.role == "decode")
        metrics_port = metrics_ports[0] if metrics_ports else None
        metrics = ("--metrics-port", str(metrics_port)) if metrics_port else ()
        gateway = NodeSpec("gateway", "gateway", gateway_port,
                           ("--prefill", prefill, "--decode", decode, *self.model_args, *self.gateway_args, *metrics,
                            *http), (), metrics_port, http_port)
        return [*specs, gateway]

    def _metrics_ports(self, n: int) -> list[int] | None:
        """The gateway's first, then the workers' in order."""
        if self.metrics_base_port is None:
            return None
        if self.free_ports:
            return reserve_ports(n)
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
    # Each replica also serves the OpenAI HTTP API (free ports, or HTTP_PORT + i without free_ports).
    serve_http: bool = False

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("replicas must be >= 1")

    def nodes(self) -> list[NodeSpec]:
        n = self.replicas
        ports = reserve_ports(2 * n) if self.free_ports else [self.base_port + i for i in range(n)] + [
            HTTP_PORT + i for i in range(n)]
        specs = []
        for i in range(n):
            http_port = ports[n + i] if self.serve_http else None
            http = ("--http-port", str(http_port)) if http_port else ()
            specs.append(NodeSpec(f"colocated-{i}", "colocated", ports[i],
                                  ("--node-id", f"colocated-{i}", *self.model_args, *self.node_args, *http),
                                  split_cores(self.cpus, i, n), http_port=http_port))
        return specs


def activity_path(name: str) -> str:
    """Where a decode node of this launcher keeps its activity file: shared memory where the host has it."""
    import secrets
    import tempfile

    folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return str(folder / f"tandem-{os.getpid()}-{secrets.token_hex(4)}-{name}.activity")


def split_cores(cpus: tuple[int, ...], k: int, n: int) -> tuple[int, ...]:
    """Process ``k`` of ``n``'s cores: split evenly; with fewer cores than processes, shared round-robin."""
    if len(cpus) >= n:
        per = len(cpus) // n
        return cpus[k * per : (k + 1) * per]
    return (cpus[k % len(cpus)],)


@dataclass(frozen=True)
class RestartPolicy:
    """When a supervised process that exited starts again: after ``initial_backoff_s``, doubling with each
    exit that comes within ``reset_after_s`` of its start (a crash loop), up to ``max_backoff_s``; a process
    that ran longer than ``reset_after_s`` starts again after ``initial_backoff_s``."""

    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    reset_after_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_backoff_s <= self.max_backoff_s or self.reset_after_s <= 0:
            raise ValueError("RestartPolicy: need 0 < initial_backoff_s <= max_backoff_s and reset_after_s > 0")

    def next_backoff(self, previous_s: float | None, ran_s: float) -> float:
        """The wait before the next start, given the previous wait (None: first restart) and how long the
        process ran."""
        if previous_s is None or ran_s >= self.reset_after_s:
            return self.initial_backoff_s
        return min(previous_s * 2, self.max_backoff_s)


def _print_event(message: str) -> None:
    print(f"tandem: {message}", file=sys.stderr, flush=True)


class Launcher:
    """Start, health-check, supervise and stop the processes of a topology.

    With ``restart`` (``tandem up``), a thread restarts any process that exits once the deployment is up,
    as ``RestartPolicy`` says, and reports each restart through ``on_event``; without it (the default, for
    tests that kill a node to watch the rest cope) a process that exits stays down.
    """

    def __init__(self, topology: Topology | ColocatedTopology, log_dir: Path | None = None,
                 env: dict[str, str] | None = None, role_env: dict[str, dict[str, str]] | None = None,
                 restart: RestartPolicy | None = None, on_event: Callable[[str], None] = _print_event) -> None:
        """``env`` is added to every process's environment, ``role_env[role]`` to that role's (it wins)."""
        self.topology = topology
        self.specs = topology.nodes()
        self.log_dir = log_dir
        self.env = env or {}
        self.role_env = role_env or {}
        self.restart = restart
        self.on_event = on_event
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.restarts: dict[str, int] = {}  # restarts of each process so far
        self._started_at: dict[str, float] = {}
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._credentials = _health_credentials({**os.environ, **self.env})

    @property
    def gateway(self) -> NodeSpec:
        return next(s for s in self.specs if s.role == "gateway")

    def log_path(self, name: str) -> Path | None:
        return self.log_dir / f"{name}.log" if self.log_dir is not None else None

    def start(self, only: str | None = None) -> None:
        """Start every process, or those of one role (``only``)."""
        for spec in self.specs:
            if only is None or spec.role == only:
                self._spawn(spec)

    def _spawn(self, spec: NodeSpec, append: bool = False) -> None:
        env = {**os.environ, **self.env, **self.role_env.get(spec.role, {})}
        if spec.cpus:
            threads = str(len(spec.cpus))
            env.update(TANDEM_NUM_THREADS=threads, OMP_NUM_THREADS=threads)
        argv = [sys.executable, "-m", "tandem_cli", "serve", spec.role, "--port", str(spec.port), *spec.args]
        out = None
        path = self.log_path(spec.name)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            out = open(path, "ab" if append else "wb")  # noqa: SIM115 - lives as long as the process
        env[PIN_CPUS_ENV] = ",".join(str(c) for c in (*spec.cpus, *spec.borrow_cpus))
        if spec.borrow_cpus:  # libgomp reads it at load: its workers let the lent cores go soon after a layer
            env.setdefault("GOMP_SPINCOUNT", SPINCOUNT)
        env[PARENT_PID_ENV] = str(os.getpid())
        self.procs[spec.name] = subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
            start_new_session=True,  # Ctrl-C reaches us only; we stop the children in order
        )
        if out is not None:
            out.close()  # the child holds its own copy
        self._started_at[spec.name] = time.monotonic()

    def wait_healthy(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        for k in range(len(self.specs)):
            moves = 0
            while self.specs[k].name in self.procs:
                spec = self.specs[k]
                proc = self.procs[spec.name]
                if proc.poll() is not None:
                    if (proc.returncode == EXIT_ADDRESS_IN_USE and self.topology.free_ports
                            and moves < MAX_PORT_MOVES):
                        moves += 1  # another process took a port chosen for it: choose again and restart it
                        self._spawn(self._move_to_new_ports(k))
                        continue
                    path = self.log_path(spec.name)
                    what = (f"could not listen on its port{'s' if spec.metrics_port or spec.http_port else ''} "
                            f"{', '.join(str(p) for p in spec.ports)} (in use?)"
                            if proc.returncode == EXIT_ADDRESS_IN_USE else f"exited with code {proc.returncode}")
                    raise RuntimeError(f"{spec.name} {what} during start-up" + (f"; see {path}" if path else ""))
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{spec.name} was not healthy within {timeout_s:.0f} s")
                if is_serving(spec.target, min(2.0, remaining), self._credentials):
                    break
                time.sleep(0.2)

    def _move_to_new_ports(self, k: int) -> NodeSpec:
        """Give ``specs[k]`` new reserved ports (gRPC, metrics, HTTP: whichever it has) and rewrite the
        flags that name them, its own and the gateway's list of nodes."""
        spec = self.specs[k]
        old_ports = spec.ports
        new_ports = reserve_ports(len(old_ports))
        renamed = dict(zip((str(p) for p in old_ports), (str(p) for p in new_ports), strict=True))
        targets = {spec.target: f"127.0.0.1:{new_ports[0]}"}

        def rewrite(args: tuple[str, ...], own: bool) -> tuple[str, ...]:
            out = list(args)
            for i, arg in enumerate(out):
                if own and i > 0 and out[i - 1] in ("--metrics-port", "--http-port") and arg in renamed:
                    out[i] = renamed[arg]
                elif not own:  # the gateway's --prefill / --decode lists
                    out[i] = ",".join(targets.get(part, part) for part in arg.split(","))
            return tuple(out)

        rest = iter(new_ports[1:])  # in the order of ``ports``
        metrics_port = next(rest) if spec.metrics_port else None
        http_port = next(rest) if spec.http_port else None
        moved = dataclasses.replace(spec, port=new_ports[0], args=rewrite(spec.args, own=True),
                                    metrics_port=metrics_port, http_port=http_port)
        self.specs = [moved if i == k else dataclasses.replace(s, args=rewrite(s.args, own=False))
                      if s.role == "gateway" and spec.role != "gateway" else s for i, s in enumerate(self.specs)]
        self.on_event(f"{spec.name}: a port was taken before it could listen; moved to {moved.target}")
        return moved

    def supervise(self) -> None:
        """Start the supervisor thread (``__enter__`` does, when ``restart`` is set)."""
        assert self.restart is not None, "supervise() needs a RestartPolicy"
        if self._supervisor is None:
            self._supervisor = threading.Thread(target=self._supervise, args=(self.restart,),
                                                name="tandem-supervisor", daemon=True)
            self._supervisor.start()

    def _supervise(self, policy: RestartPolicy) -> None:
        """Restart what exits, each after its backoff; report when a restarted process serves again."""
        due: dict[str, float] = {}  # name -> when to start it again
        backoff: dict[str, float] = {}
        recovering: dict[str, float] = {}  # restarted, not yet healthy -> next health check
        while not self._stopping.wait(0.2):
            now = time.monotonic()
            for spec in self.specs:
                proc = self.procs.get(spec.name)
                if proc is None:
                    continue
                if proc.poll() is not None:
                    recovering.pop(spec.name, None)
                    if spec.name not in due:
                        ran_s = now - self._started_at.get(spec.name, now)
                        wait_s = backoff[spec.name] = policy.next_backoff(backoff.get(spec.name), ran_s)
                        due[spec.name] = now + wait_s
                        self.on_event(f"{spec.name} exited with {_describe_exit(proc.returncode)} after "
                                      f"{ran_s:.0f} s; restarting it in {wait_s:g} s")
                    elif now >= due[spec.name]:
                        del due[spec.name]
                        self._restart(spec)
                        recovering[spec.name] = now + 1.0
                elif spec.name in recovering and now >= recovering[spec.name]:
                    if is_serving(spec.target, 1.0, self._credentials):
                        del recovering[spec.name]
                        self.on_event(f"{spec.name} is serving again on {spec.target}")
                    else:
                        recovering[spec.name] = time.monotonic() + 1.0

    def _restart(self, spec: NodeSpec) -> None:
        if self._stopping.is_set():
            return
        n = self.restarts[spec.name] = self.restarts.get(spec.name, 0) + 1
        path = self.log_path(spec.name)
        if path is not None:
            with open(path, "ab") as f:
                f.write(f"--- tandem up: restart {n} of {spec.name} ---\n".encode())
        self._spawn(spec, append=True)
        self.on_event(f"restarted {spec.name} (restart {n}, pid {self.procs[spec.name].pid})"
                      + (f"; log {path}" if path else ""))

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM (graceful drain) the gateway first, then the nodes; SIGKILL what is left after grace."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join()  # no restart races the stop below
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
        for spec in self.specs:  # what a node killed before it could clean up left behind
            for path in spec.files:
                Path(path).unlink(missing_ok=True)

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
        if self.restart is not None:
            self.supervise()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def _health_credentials(environ: dict[str, str]) -> grpc.ChannelCredentials | None:
    """The TLS credentials the launched processes take from ``TANDEM_TLS_*``, for the launcher's health checks."""
    from common.config.settings import SecuritySettings, load_settings
    from common.serving.security import channel_credentials

    return channel_credentials(load_settings(SecuritySettings, environ=environ))


def is_serving(target: str, timeout_s: float, credentials: grpc.ChannelCredentials | None = None) -> bool:
    """One gRPC health check: True when the server answers SERVING."""
    return check_health(target, timeout_s, credentials=credentials) == "SERVING"


def check_health(target: str, timeout_s: float, service: str = "",
                 credentials: grpc.ChannelCredentials | None = None) -> str:
    """One gRPC health check (``grpc.health.v1``) of ``service`` ("" = the whole server) at ``target``:
    the status it answers (``SERVING``, ``NOT_SERVING``...), or the RPC's error code when it answers none.
    ``credentials``: TLS (a server that requires client certificates needs them in these too)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with (grpc.secure_channel(target, credentials) if credentials is not None
              else grpc.insecure_channel(target)) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout_s)
    except grpc.RpcError as exc:
        code = exc.code() if isinstance(exc, grpc.Call) else None
        return code.name if code is not None else "UNAVAILABLE"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

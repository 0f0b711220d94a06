"""Start a ``grpc.aio`` server the way every Tandem service runs: status interceptor, health, reflection,
graceful shutdown on SIGINT/SIGTERM.

Shutdown order: health goes NOT_SERVING (so launchers and balancers stop sending), the server stops
accepting RPCs, in-flight RPCs get ``grace_s`` to finish and are cancelled after it, then the shutdown
hooks run (close channels, stop engine loops, flush exporters).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.errors import AddressInUseError
from common.serving.channel import format_address, open_channel
from common.serving.status import StatusInterceptor
from common.telemetry.propagation import server_interceptors

log = logging.getLogger(__name__)

ServicerAdder = Callable[[grpc.aio.Server], None]
ShutdownHook = Callable[[], Awaitable[None]]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

UNREQUESTED_CALL_WAIT_S = 7 * 24 * 3600  # a week: longer than any deadline Tandem sets (request_timeout_s)
PENDING_CALLS = 1 << 20  # calls received and not yet taken up; Tandem's admission queue limits what runs and waits

SERVER_OPTIONS: tuple[tuple[str, Any], ...] = (
    # Without this, two servers can silently share a port (Linux SO_REUSEPORT) and split the traffic.
    ("grpc.so_reuseport", 0),
    # Accept the keepalive pings of common.serving.channel's clients (every 30 s), even while this server sends
    # nothing (a long queued RPC): a ping sooner than this after the last is a "strike", and past 2 strikes
    # gRPC closes the transport with GOAWAY (ENHANCE_YOUR_CALM), failing every call on it. The server-side
    # default is 5 minutes; the ..._min_ping_interval_... option set here before is a sender's option.
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 20_000),
    # Calls gRPC has received that the server has not yet taken up (grpc.aio takes them up one per turn of its
    # event loop) wait in a pending list, and gRPC cancels some of them, CANCELLED "CANCELLED", before any
    # handler or log of ours sees them: at random once more than max_pending_requests wait (1,000; every one
    # past the hard limit, 3,000), and every one that waited longer than server_max_unrequested_time_in_server
    # (30 s). 1,200 requests at once against a gateway ended with 4-7 of them CANCELLED that no client
    # cancelled (issue 32); 2,000 calls at once at one bare server, 168. Load the system can serve is queued,
    # not refused, and a request is cancelled only by its client or its deadline: the gateway's admission
    # queue (max_inflight, max_queued, queue_timeout_s) decides what waits and names its limit when it refuses,
    # and a call's deadline still ends its wait (tests/gateway/test_serving_server.py).
    ("grpc.server.max_pending_requests", PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", PENDING_CALLS),
    ("grpc.server_max_unrequested_time_in_server", UNREQUESTED_CALL_WAIT_S),
)


@dataclass
class RunningServer:
    """A started server; ``stop`` shuts it down gracefully and is safe to call more than once."""

    server: grpc.aio.Server
    health: Any  # grpc_health.v1.health.aio.HealthServicer
    host: str
    port: int
    service_names: tuple[str, ...]
    http_url: str = ""  # the OpenAI-compatible HTTP API beside it (http://host:port), when the process serves one
    internal_address: str = ""  # a gateway's internal port (Membership), when it serves one
    engine: object | None = None  # the node's engine (a ``failed`` property): serve_until_signal watches it
    kv_index: object | None = None  # a gateway's prefix index kept from the nodes' KV events (KvIndexSync)
    _hooks: list[ShutdownHook] = field(default_factory=list)
    _stopping_hooks: list[ShutdownHook] = field(default_factory=list)
    _stopping: bool = False
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def address(self) -> str:
        """``host:port`` that clients dial (the bound port when 0 was asked for)."""
        return format_address(self.host, self.port)

    def add_shutdown_hook(self, hook: ShutdownHook) -> None:
        """Run ``hook`` after the server stopped; hooks run in reverse order of registration."""
        self._hooks.append(hook)

    def add_stopping_hook(self, hook: ShutdownHook) -> None:
        """Run ``hook`` as the server begins to stop, before in-flight RPCs drain (a node deregisters then)."""
        self._stopping_hooks.append(hook)

    async def set_serving(self, serving: bool) -> None:
        """Report every service (and the server as a whole) SERVING or NOT_SERVING."""
        status = SERVING if serving else NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        """Stop gracefully: NOT_SERVING, refuse new RPCs, drain in-flight ones up to ``grace_s``, stop."""
        if self._stopping:
            # A second stop (a second Ctrl-C) may shorten the grace period; gRPC honours the smaller one.
            await self.server.stop(grace_s)
            await self._stopped.wait()
            return
        self._stopping = True
        try:
            await self.health.enter_graceful_shutdown()
            for hook in self._stopping_hooks:
                try:
                    await hook()
                except Exception:
                    log.exception("stopping hook %r failed", hook)
            await self.server.stop(grace_s)
            for hook in reversed(self._hooks):
                try:
                    await hook()
                except Exception:
                    log.exception("shutdown hook %r failed", hook)
        finally:
            self._stopped.set()

    async def wait_for_termination(self) -> None:
        """Return once ``stop`` has finished."""
        await self._stopped.wait()


async def start_server(
    servicer_adders: Sequence[ServicerAdder],
    service_names: Sequence[str],
    host: str,
    port: int,
    interceptors: Sequence[grpc.aio.ServerInterceptor] | None = None,
    options: Sequence[tuple[str, Any]] = (),
    credentials: grpc.ServerCredentials | None = None,
) -> RunningServer:
    """Build, bind and start a server hosting the given services plus health and reflection.

    ``servicer_adders`` are the generated ``add_XServicer_to_server`` functions bound to their servicer
    (e.g. ``functools.partial(add_TandemServicer_to_server, servicer)``); ``service_names`` are the full
    names (``tandem.v1.Tandem``) reported by health and reflection. ``interceptors`` default to one
    ``StatusInterceptor()``; the first interceptor is the outermost. When this process traces, the trace
    context interceptor goes before them all (the caller's context is current in every handler).
    ``port`` 0 picks a free port. ``credentials`` (``common.serving.security.server_credentials``): serve TLS
    (mutual TLS when they require client certificates); None: plaintext.
    """
    if interceptors is None:
        interceptors = [StatusInterceptor()]
    interceptors = [*server_interceptors(), *interceptors]
    merged_options = dict(SERVER_OPTIONS)
    merged_options.update(options)
    server = grpc.aio.server(interceptors=list(interceptors), options=list(merged_options.items()))
    for add in servicer_adders:
        add(server)

    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = tuple(service_names)
    for name in ("", *names):
        await health_servicer.set(name, SERVING)
    reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)

    address = format_address(host, port)
    try:
        bound = (server.add_secure_port(address, credentials) if credentials is not None
                 else server.add_insecure_port(address))
    except RuntimeError as exc:  # recent grpcio raises; older ones return 0
        raise AddressInUseError(f"cannot listen on {address}: port in use or not a local address ({exc})") from None
    if bound == 0:
        raise AddressInUseError(f"cannot listen on {address}: port in use or not a local address")
    await server.start()
    log.info("serving %s on %s%s", ", ".join(names), format_address(host, bound), " (TLS)" if credentials else "")
    return RunningServer(server=server, health=health_servicer, host=host, port=bound, service_names=names)


def install_signal_handlers(running: RunningServer, grace_s: float) -> None:
    """On SIGINT/SIGTERM stop ``running`` gracefully; a second signal stops it at once.

    Call from inside the running event loop (asyncio's signal handlers need the main thread).
    """
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()  # keep references: the loop holds tasks only weakly

    def on_signal(signum: int) -> None:
        grace = 0.0 if tasks else grace_s
        log.info("received %s; stopping (grace %.1f s)", signal.Signals(signum).name, grace)
        task = loop.create_task(running.stop(grace))
        tasks.add(task)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)


ENGINE_WATCH_INTERVAL_S = 1.0


async def serve_until_signal(running: RunningServer, grace_s: float, engine: object | None = None) -> None:
    """Install the signal handlers, freeze the start-up heap, and return once the server has stopped.

    ``engine`` (default ``running.engine``; anything with a ``failed`` property, an AsyncEngine): when its
    thread dies (a parallel node's rank died, a bug), the server reports NOT_SERVING, stops, and this raises
    SystemExit(1), so that a supervisor (``tandem up``, compose's ``restart``) starts the node afresh instead
    of it failing every call.
    """
    install_signal_handlers(running, grace_s)
    freeze_startup_heap()
    engine = engine if engine is not None else running.engine
    watch = None if engine is None else asyncio.create_task(_stop_when_dead(running, engine))
    await running.wait_for_termination()
    if watch is not None:
        watch.cancel()
        if getattr(engine, "failed", False):
            raise SystemExit(1)


async def _stop_when_dead(running: RunningServer, engine: object) -> None:
    while not getattr(engine, "failed", False):
        await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)
    log.error("the engine died; the node stops (its supervisor restarts it)")
    await running.set_serving(False)
    await running.stop(1.0)


def freeze_startup_heap() -> None:
    """Move every object alive after start-up (model, tokenizer, modules) out of the garbage collector's reach.

    They live as long as the process, yet each full collection walked them all (slow: docs/observability.md has
    the time measured with a model, a tokenizer and three services in one process), and the objects serving
    churns through (protobuf messages, spans waiting in the export queue) set one off every few seconds under
    load. Collect first so no start-up garbage is kept.
    """
    gc.collect()
    gc.freeze()


async def wait_for_health(target: str, timeout_s: float, service: str = "",
                          credentials: grpc.ChannelCredentials | None = None) -> None:
    """Return once ``target`` reports ``service`` SERVING; raise ``TimeoutError`` after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last = "no answer"
    async with open_channel(target, credentials=credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while (remaining := deadline - loop.time()) > 0:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service),
                                         timeout=min(remaining, 1.0), wait_for_ready=True)
                if reply.status == SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.aio.AioRpcError as exc:
                last = f"{exc.code().name}: {exc.details()}"
            await asyncio.sleep(min(0.05, max(deadline - loop.time(), 0.0)))
    raise TimeoutError(f"{target} did not report {service or 'the server'} SERVING within {timeout_s:g} s ({last})")

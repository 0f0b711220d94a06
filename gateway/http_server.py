"""uvicorn serving an ASGI app as a task of the running event loop, beside the ``grpc.aio`` server.

One loop, one process: the HTTP front calls the same runner and backend objects as the gRPC front, with
no thread hop. Signals stay with the process's own handlers (``serve_until_signal``), which stop this
server through ``stop`` after the gRPC server drained.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Generator
from pathlib import Path
from typing import Any

import uvicorn

from common.errors import AddressInUseError
from common.serving.channel import format_address

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # the gateway's own SIGINT/SIGTERM handlers stop us (uvicorn's would take them over)


class HttpServer:
    """A started uvicorn server; ``stop`` lets in-flight responses finish for up to ``grace_s``."""

    def __init__(self, server: _Server, task: asyncio.Task[None], host: str, port: int, tls: bool = False) -> None:
        self._server = server
        self._task = task
        self.host = host
        self.port = port
        self.tls = tls

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.address}"

    @staticmethod
    async def start(app: Any, host: str, port: int, grace_s: float,
                    tls: tuple[Path, Path] | None = None) -> HttpServer:
        """Bind ``host:port`` (0: a free port) and serve ``app``; raise ``OSError`` when it cannot listen.
        ``tls``: (certificate, key) PEM files: serve HTTPS."""
        cert, key = tls or (None, None)
        config = uvicorn.Config(app, host=host, port=port, lifespan="off", log_config=None, access_log=False,
                                timeout_graceful_shutdown=max(1, round(grace_s)), server_header=False,
                                ssl_certfile=cert, ssl_keyfile=key)
        server = _Server(config)
        task = asyncio.create_task(server.serve(), name=f"http-{host}:{port}")
        while not server.started:
            if task.done():  # uvicorn logs the bind error and exits (SystemExit) instead of raising it
                with contextlib.suppress(BaseException):
                    task.result()
                raise AddressInUseError(f"cannot listen on {format_address(host, port)} for HTTP: port in use "
                                        "or not a local address")
            await asyncio.sleep(0.01)
        bound = server.servers[0].sockets[0].getsockname()[1]
        http = HttpServer(server, task, host, bound, tls is not None)
        log.info("serving the OpenAI-compatible HTTP API on %s", http.url)
        return http

    async def stop(self) -> None:
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

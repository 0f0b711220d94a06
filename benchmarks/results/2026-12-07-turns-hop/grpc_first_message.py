"""Loopback, two processes on their own cores (grpc.aio both): a stream-stream call's first message to its first
answer, on a call opened then vs on one opened ahead of time; the server answers each message at once (session 40).

    python grpc_first_message.py
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from grpc import aio

ROUNDS = 300


def _identity(b: bytes) -> bytes:
    return b


async def _echo(messages: AsyncIterator[bytes], context: aio.ServicerContext) -> AsyncIterator[bytes]:
    async for _ in messages:
        yield b"x"


async def serve(port_file: str) -> None:
    server = aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", {
        "SS": grpc.stream_stream_rpc_method_handler(_echo, _identity, _identity)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    Path(port_file).write_text(str(port))
    await server.wait_for_termination()


async def client(port: int) -> None:
    call_of = aio.insecure_channel(f"127.0.0.1:{port}").stream_stream("/t.T/SS", _identity, _identity)
    payload = b"a" * 2000
    took: dict[str, list[float]] = {"a new call": [], "a call opened ahead": []}
    for _ in range(ROUNDS):
        t = time.perf_counter()
        call = call_of()
        await call.write(payload)
        await call.read()
        took["a new call"].append(time.perf_counter() - t)
        call.cancel()
        call = call_of()
        await call.wait_for_connection()
        await asyncio.sleep(0.002)
        t = time.perf_counter()
        await call.write(payload)
        await call.read()
        took["a call opened ahead"].append(time.perf_counter() - t)
        call.cancel()
        await asyncio.sleep(0.002)
    for name, values in took.items():
        v = sorted(values[30:])
        print(f"{name}: p50 {statistics.median(v) * 1e3:.3f} ms, p90 {v[int(0.9 * len(v))] * 1e3:.3f} ms")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "server":
        asyncio.run(serve(sys.argv[2]))
        return
    port_file = f"/tmp/grpc-first-message-{os.getpid()}.port"
    server = subprocess.Popen(["taskset", "-c", "0", sys.executable, __file__, "server", port_file])
    try:
        path = Path(port_file)
        while not (path.exists() and path.read_text()):
            time.sleep(0.05)
        os.sched_setaffinity(0, {1})
        asyncio.run(client(int(path.read_text())))
    finally:
        server.kill()
        os.remove(port_file)


if __name__ == "__main__":
    main()

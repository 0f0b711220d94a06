"""N streaming calls at once over one channel at a bare Tandem server (common.serving.server.start_server):

    python benchmarks/results/2026-12-06-burst/storm.py N BUSY_S MESSAGES ['[["grpc.option", value], ...]']

The server runs in its own process; BUSY_S blocks its event loop that long between turns; each call gets
MESSAGES messages, 0.1 s apart. Prints how many calls ended each way."""

import asyncio
import collections
import pathlib
import subprocess
import sys
import time

import grpc

SERVER = r'''
import asyncio, json, sys, time
BUSY, MSGS, OPTS, REPO = float(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
sys.path.insert(0, REPO)
import grpc
from common.serving.server import start_server

async def run(request, context):
    for _ in range(MSGS):
        await asyncio.sleep(0.1)
        yield b"t" * 20

def add(server):
    handler = grpc.unary_stream_rpc_method_handler(run)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("s", {"m": handler}),))

async def main():
    srv = await start_server([add], ["s"], "127.0.0.1", 0, options=[tuple(o) for o in OPTS])
    print(srv.port, flush=True)
    async def hog():
        while True:
            time.sleep(BUSY)
            await asyncio.sleep(0)
    task = asyncio.create_task(hog())
    await asyncio.sleep(3600)
    task.cancel()

asyncio.run(main())
'''


async def one(stub, out):
    t = time.time()
    try:
        async for _ in stub(b"", timeout=600):
            pass
        out["ok"] += 1
    except grpc.aio.AioRpcError as e:
        out[f"{e.code().name}: {e.details()} | {e.debug_error_string()[:150]} @ {time.time() - t:.1f}s"] += 1


async def main(port, n):
    out: collections.Counter[str] = collections.Counter()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        await ch.channel_ready()
        stub = ch.unary_stream("/s/m")
        t = time.time()
        await asyncio.gather(*(one(stub, out) for _ in range(n)))
        print(round(time.time() - t, 1), "s", dict(out))


if __name__ == "__main__":
    repo = str(pathlib.Path(__file__).resolve().parents[3])
    options = sys.argv[4] if len(sys.argv) > 4 else "[]"
    server = subprocess.Popen([sys.executable, "-c", SERVER, sys.argv[2], sys.argv[3], options, repo],
                              stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    try:
        asyncio.run(main(int(server.stdout.readline()), int(sys.argv[1])))
    finally:
        server.kill()

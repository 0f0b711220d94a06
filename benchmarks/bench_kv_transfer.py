"""KV transfer throughput between two real processes, next to raw send/recv on a plain pair group.

    python -m benchmarks.bench_kv_transfer [--iters N] [--tokens 128,1024,4096]

Ships SmolLM2-135M's KV (30 layers, 3 KV heads, head dim 64, block size 16, bf16: 368,640 bytes per block)
from a KVSender in this process into a KVReceiver in a child process, over loopback. Each transfer is timed
on the sender from ``open`` to ``wait`` returning (every chunk acked by the receiver), pair already formed.
In the same run, ``raw`` is ``pg.send`` of one tensor of the same total size on a plain gloo pair group
between the same two processes (the receiver posting its recv in a loop). Rows:

* contiguous: all blocks pushed at once, consecutive ids on both sides (one run, one send);
* chunked: pushed 256 tokens at a time, as chunked prefill would (one KVChunk and one send per push);
* fragmented: destination ids every other block (one send per block);
* pipelined: 8 transfers in flight at once, aggregate bytes / wall time.

Device = the KV cache's device (CPU here, gloo); the parent and child talk through JSON lines, no pickle.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import grpc
import torch
import torch.distributed as dist

from common.kv.kv_cache import KVCache, KVCacheSpec
from kv_transfer import KVReceiver, KVSender, make_layout
from tandem.v1 import prefill_pb2

SPEC = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype_name="bfloat16")
BYTES_PER_BLOCK = SPEC.bytes_per_block(2)  # 368,640
NUM_BLOCKS = 520  # room for 4k tokens every other block (512) on the decode side
CHUNK_TOKENS = 256
PIPELINE = 8
_ids = itertools.count()


def _raw_group(store_port: int, rank: int) -> Any:
    store = dist.TCPStore("127.0.0.1", store_port, None, False, timeout=datetime.timedelta(seconds=30))
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = datetime.timedelta(seconds=30)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(dist.PrefixStore("raw", store), rank, 2, options)


# ---------------------------------------------------------------------------------------------- decode child


async def _decode_child() -> None:
    torch.set_num_threads(1)
    loop = asyncio.get_running_loop()
    cache = KVCache(SPEC, NUM_BLOCKS)
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    receiver = KVReceiver(cache, make_layout(SPEC, "SmolLM2-135M-Instruct", "bench"), "decode-bench")
    receiver.add_to_server(server)
    await server.start()
    raw_store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30),
                              wait_for_workers=False)
    print(json.dumps({"kv_endpoint": f"127.0.0.1:{port}", "raw_port": raw_store.port}), flush=True)
    raw_pg = await asyncio.to_thread(_raw_group, raw_store.port, 1)
    lines: asyncio.Queue[str] = asyncio.Queue()
    threading.Thread(target=lambda: [loop.call_soon_threadsafe(lines.put_nowait, line) for line in sys.stdin]
                     + [loop.call_soon_threadsafe(lines.put_nowait, "")], daemon=True).start()

    buffers: dict[int, torch.Tensor] = {}
    while line := await lines.get():
        cmd = json.loads(line)
        if cmd["cmd"] == "raw":  # post the recv first, say so, then wait: raw gets no rendezvous delay
            buffer = buffers.setdefault(cmd["nbytes"], torch.zeros(cmd["nbytes"] // 2, dtype=torch.bfloat16))
            work = raw_pg.recv([buffer], 0, 0)
            print(json.dumps({"posted": True}), flush=True)
            await asyncio.to_thread(work.wait)
        else:  # expect a batch, answer at once, then wait for all of them
            for tid in cmd["ids"]:
                receiver.expect(tid, cmd["block_ids"], 0)
            print(json.dumps({"expected": len(cmd["ids"])}), flush=True)
            results = await asyncio.gather(*(receiver.wait(tid, 60) for tid in cmd["ids"]))
            assert all(r.bytes == len(cmd["block_ids"]) * BYTES_PER_BLOCK for r in results)
    await receiver.close()
    await server.stop(0)


# ---------------------------------------------------------------------------------------------- prefill parent


class _Child:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_kv_transfer", "--role", "decode"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self.read()

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("decode child exited")
        return json.loads(line)

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()


async def _raw_once(child: _Child, pg: Any, tensor: torch.Tensor) -> float:
    child.send(cmd="raw", nbytes=tensor.numel() * tensor.element_size())
    await asyncio.to_thread(child.read)
    start = time.perf_counter()
    await asyncio.to_thread(pg.send([tensor], 1, 0).wait)
    return time.perf_counter() - start


async def _kv_once(child: _Child, sender: KVSender, name: str, dst: list[int], blocks_per_push: int,
                   in_flight: int = 1) -> float:
    """Seconds for ``in_flight`` concurrent transfers of ``len(dst)`` blocks, each open() -> wait()."""
    src = list(range(len(dst)))
    ids = [f"{name}-{next(_ids)}" for _ in range(in_flight)]
    child.send(cmd="expect", ids=ids, block_ids=dst)
    await asyncio.to_thread(child.read)

    async def one(tid: str) -> None:
        handle = await sender.open(tid, prefill_pb2.KVDestination(kv_endpoint=child.info["kv_endpoint"]))
        for start in range(0, len(dst), blocks_per_push):
            handle.push(src[start : start + blocks_per_push], dst[start : start + blocks_per_push])
        handle.complete(0, None, 0)
        await handle.wait(60)

    start = time.perf_counter()
    await asyncio.gather(*(one(tid) for tid in ids))
    return time.perf_counter() - start


async def _bench_size(child: _Child, raw_pg: Any, sender: KVSender, tokens: int, iters: int) -> list[dict[str, Any]]:
    num_blocks = tokens // SPEC.block_size
    nbytes = num_blocks * BYTES_PER_BLOCK
    tensor = torch.randn(nbytes // 2).to(torch.bfloat16)
    contiguous = list(range(num_blocks))
    every_other = list(range(0, 2 * num_blocks, 2))
    per_chunk = CHUNK_TOKENS // SPEC.block_size
    cases: dict[str, tuple[int, int, Callable[[], Awaitable[float]]]] = {  # name: (sends, transfers, timed)
        "raw pg.send/recv": (1, 1, lambda: _raw_once(child, raw_pg, tensor)),
        "contiguous": (1, 1, lambda: _kv_once(child, sender, "c", contiguous, num_blocks)),
        f"chunked ({CHUNK_TOKENS} tok/push)": (-(-num_blocks // per_chunk), 1,
                                               lambda: _kv_once(child, sender, "k", contiguous, per_chunk)),
        "fragmented (every other dst)": (num_blocks, 1, lambda: _kv_once(child, sender, "f", every_other, num_blocks)),
        f"pipelined ({PIPELINE} in flight)": (
            PIPELINE, PIPELINE, lambda: _kv_once(child, sender, "p", contiguous, num_blocks, PIPELINE)),
    }
    # Interleaved rounds, so every case sees the same machine weather; the first round warms up.
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(iters + 1):
        for name, (_, _, timed) in cases.items():
            times[name].append(await timed())
    raw = statistics.median(times["raw pg.send/recv"][1:])
    rows = []
    for name, (sends, transfers, _) in cases.items():
        seconds = statistics.median(times[name][1:])
        low, high = (statistics.quantiles(times[name][1:], n=4)[i] for i in (0, 2))
        gbps = transfers * nbytes / seconds / 1e9
        print(f"| {tokens} | {num_blocks} | {nbytes / 1e6:.1f} | {name} | {sends} | {seconds * 1e3:.2f} | "
              f"{low * 1e3:.2f}-{high * 1e3:.2f} | {gbps:.2f} | {transfers * raw / seconds:.0%} |", flush=True)
        rows.append({"tokens": tokens, "blocks": num_blocks, "bytes": nbytes, "case": name, "sends": sends,
                     "median_ms": seconds * 1e3, "gb_s": gbps, "vs_raw": transfers * raw / seconds})
    return rows


async def _bench(tokens_list: list[int], iters: int) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    child = _Child()
    raw_pg = await asyncio.to_thread(_raw_group, child.info["raw_port"], 0)
    cache = KVCache(SPEC, NUM_BLOCKS)
    cache.data.copy_(torch.randn(cache.data.shape, dtype=torch.bfloat16))
    sender = KVSender(cache, make_layout(SPEC, "SmolLM2-135M-Instruct", "bench"), "prefill-bench")
    print(f"SmolLM2-135M KV: {BYTES_PER_BLOCK:,} bytes per block of {SPEC.block_size} tokens; gloo over loopback, "
          f"2 processes, {iters} interleaved rounds; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}\n")
    print("| tokens | blocks | MB | case | sends | median ms | p25-p75 ms | GB/s | vs raw |")
    print("|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    rows = []
    for tokens in tokens_list:
        rows += await _bench_size(child, raw_pg, sender, tokens, iters)
    await sender.close()
    assert child.proc.stdin is not None
    child.proc.stdin.close()
    child.proc.wait(30)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--tokens", default="128,1024,4096")
    parser.add_argument("--json", dest="json_path", help="also write the rows here as JSON")
    parser.add_argument("--role", choices=["prefill", "decode"], default="prefill", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "decode":
        asyncio.run(_decode_child())
    else:
        rows = asyncio.run(_bench([int(t) for t in args.tokens.split(",")], args.iters))
        if args.json_path:
            Path(args.json_path).write_text(json.dumps({
                "model": "SmolLM2-135M-Instruct", "backend": "gloo", "bytes_per_block": BYTES_PER_BLOCK,
                "block_size": SPEC.block_size, "iters": args.iters, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

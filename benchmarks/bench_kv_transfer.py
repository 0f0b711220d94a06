"""KV transfer throughput between two real processes: sockets (gloo) and same-host shared memory, next to
raw send/recv on a plain pair group and to a memory copy.

    python -m benchmarks.bench_kv_transfer [--iters N] [--tokens 128,1024,4096] [--transports socket,shm]

Ships SmolLM2-135M's KV (30 layers, 3 KV heads, head dim 64, block size 16, bf16: 368,640 bytes per block)
from a KVSender in this process into a KVReceiver in a child process, over loopback. Each transfer is timed
on the sender from ``open`` to ``wait`` returning (every chunk acked by the receiver), pair already formed.
In the same run, ``raw`` is ``pg.send`` of one tensor of the same total size on a plain gloo pair group
between the same two processes (the receiver posting its recv in a loop), and ``memcpy`` is one
``copy_`` of the same bytes between two warm buffers of this process (1 thread, like the transfer's copy
thread): the ceiling for the same-host transport, which is that copy into the decode node's shared-memory
KV plus the control messages. The decode child shares its KV (transport auto); one sender per transport.
Rows:

* contiguous: all blocks pushed at once, consecutive ids on both sides (one run, one send);
* chunked: pushed 256 tokens at a time, as chunked prefill would (one KVChunk and one send per push);
* fragmented: destination ids every other block (one send per block);
* pipelined: 8 transfers in flight at once, aggregate bytes / wall time.

Device = the KV cache's device (CPU here); the parent and child talk through JSON lines, no pickle. The
report names the CPU and its vector/copy-relevant flags, since memcpy bandwidth depends on them.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
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

from benchmarks.machine import cpu_name, present_flags
from common.kv.kv_cache import KVCache, KVCacheSpec
from kv_transfer import KVReceiver, KVSender, make_layout
from tandem.v1 import prefill_pb2

SPEC = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype_name="bfloat16")
BYTES_PER_BLOCK = SPEC.bytes_per_block(2)  # 368,640
NUM_BLOCKS = 520  # room for 4k tokens every other block (512)
DECODE_BLOCKS = 8 * 256 + 8  # the decode side: 8 pipelined 4k-token transfers, each into its own blocks
CHUNK_TOKENS = 256
PIPELINE = 8
_ids = itertools.count()
_FLAGS = ("sse4_2", "avx", "avx2", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "erms", "fsrm", "rep_good")


def cpu_flags() -> list[str]:
    """The copy- and vector-relevant flags of this CPU (``/proc/cpuinfo``), in a fixed order."""
    return present_flags(_FLAGS)


def _raw_group(store_port: int, rank: int) -> Any:
    store = dist.TCPStore("127.0.0.1", store_port, None, False, timeout=datetime.timedelta(seconds=30))
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = datetime.timedelta(seconds=30)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(dist.PrefixStore("raw", store), rank, 2, options)


# ---------------------------------------------------------------------------------------------- decode child


async def _decode_child(device: str) -> None:
    torch.set_num_threads(1)
    loop = asyncio.get_running_loop()
    cache = KVCache(SPEC, DECODE_BLOCKS, device)
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
            for tid, block_ids in zip(cmd["ids"], cmd["block_ids"], strict=True):
                receiver.expect(tid, block_ids, 0)
            print(json.dumps({"expected": len(cmd["ids"])}), flush=True)
            results = await asyncio.gather(*(receiver.wait(tid, 60) for tid in cmd["ids"]))
            assert all(r.bytes == len(ids) * BYTES_PER_BLOCK for r, ids in zip(results, cmd["block_ids"], strict=True))
    await receiver.close()
    await server.stop(0)


# ---------------------------------------------------------------------------------------------- prefill parent


class _Child:
    def __init__(self, device: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_kv_transfer", "--role", "decode",
                                      "--device", device],
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
    """Seconds for ``in_flight`` concurrent transfers of ``len(dst)`` blocks, each open() -> wait(); the i-th
    in flight lands ``i * len(dst)`` blocks further (each decode block belongs to one transfer at a time)."""
    src = list(range(len(dst)))
    ids = [f"{name}-{next(_ids)}" for _ in range(in_flight)]
    dsts = [[b + i * len(dst) for b in dst] for i in range(in_flight)]
    child.send(cmd="expect", ids=ids, block_ids=dsts)
    await asyncio.to_thread(child.read)

    async def one(tid: str, dst: list[int]) -> None:
        handle = await sender.open(tid, prefill_pb2.KVDestination(kv_endpoint=child.info["kv_endpoint"]))
        for start in range(0, len(dst), blocks_per_push):
            handle.push(src[start : start + blocks_per_push], dst[start : start + blocks_per_push])
        handle.complete(0, None, 0)
        await handle.wait(60)

    start = time.perf_counter()
    await asyncio.gather(*(one(tid, d) for tid, d in zip(ids, dsts, strict=True)))
    return time.perf_counter() - start


async def _memcpy_once(dst: torch.Tensor, src: torch.Tensor) -> float:
    start = time.perf_counter()
    dst.copy_(src)
    if dst.is_cuda:
        torch.cuda.synchronize(dst.device)
    return time.perf_counter() - start


async def _bench_size(child: _Child, raw_pg: Any, senders: dict[str, KVSender], tokens: int,
                      iters: int) -> list[dict[str, Any]]:
    num_blocks = tokens // SPEC.block_size
    nbytes = num_blocks * BYTES_PER_BLOCK
    tensor = torch.randn(nbytes // 2).to(torch.bfloat16)
    device = senders[next(iter(senders))].kv_cache.data.device
    copy_src = tensor.to(device)
    copy_dst = torch.empty_like(copy_src)
    contiguous = list(range(num_blocks))
    every_other = list(range(0, 2 * num_blocks, 2))
    per_chunk = CHUNK_TOKENS // SPEC.block_size
    # (transport, case): (sends, transfers, timed)
    cases: dict[tuple[str, str], tuple[int, int, Callable[[], Awaitable[float]]]] = {
        ("-", "memcpy (copy_, 1 thread)"): (1, 1, lambda: _memcpy_once(copy_dst, copy_src)),
    }
    if device.type == "cpu":  # gloo moves CPU tensors only (on one GPU NCCL cannot pair at all)
        cases[("gloo", "raw pg.send/recv")] = (1, 1, lambda: _raw_once(child, raw_pg, tensor))
    for transport, sender in senders.items():
        kv = functools.partial(_kv_once, child, sender)
        cases |= {
            (transport, "contiguous"): (1, 1, functools.partial(kv, "c", contiguous, num_blocks)),
            (transport, f"chunked ({CHUNK_TOKENS} tok/push)"): (
                -(-num_blocks // per_chunk), 1, functools.partial(kv, "k", contiguous, per_chunk)),
            (transport, "fragmented (every other dst)"): (
                num_blocks, 1, functools.partial(kv, "f", every_other, num_blocks)),
            (transport, f"pipelined ({PIPELINE} in flight)"): (
                PIPELINE, PIPELINE, functools.partial(kv, "p", contiguous, num_blocks, PIPELINE)),
        }
    # Interleaved rounds, so every case sees the same machine weather; the first round warms up.
    times: dict[tuple[str, str], list[float]] = {key: [] for key in cases}
    for _ in range(iters + 1):
        for key, (_, _, timed) in cases.items():
            times[key].append(await timed())
    raw_times = times.get(("gloo", "raw pg.send/recv"))
    raw = statistics.median(raw_times[1:]) if raw_times else float("nan")
    memcpy = statistics.median(times[("-", "memcpy (copy_, 1 thread)")][1:])
    rows = []
    for (transport, name), (sends, transfers, _) in cases.items():
        samples = times[(transport, name)][1:]
        seconds = statistics.median(samples)
        low, high = (statistics.quantiles(samples, n=4)[i] for i in (0, 2)) if len(samples) > 1 else (seconds,) * 2
        gbps = transfers * nbytes / seconds / 1e9
        vs_raw, vs_memcpy = transfers * raw / seconds, transfers * memcpy / seconds
        print(f"| {tokens} | {num_blocks} | {nbytes / 1e6:.1f} | {transport} | {name} | {sends} | "
              f"{seconds * 1e3:.2f} | {low * 1e3:.2f}-{high * 1e3:.2f} | {gbps:.2f} | {vs_raw:.0%} | "
              f"{vs_memcpy:.0%} |", flush=True)
        rows.append({"tokens": tokens, "blocks": num_blocks, "bytes": nbytes, "transport": transport, "case": name,
                     "sends": sends, "median_ms": seconds * 1e3, "gb_s": gbps, "vs_raw": vs_raw,
                     "vs_memcpy": vs_memcpy})
    return rows


async def _bench(tokens_list: list[int], iters: int, transports: list[str], device: str) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    child = _Child(device)
    raw_pg = await asyncio.to_thread(_raw_group, child.info["raw_port"], 0)
    cache = KVCache(SPEC, NUM_BLOCKS, device)
    cache.data.copy_(torch.randn(cache.data.shape, dtype=torch.bfloat16))
    layout = make_layout(SPEC, "SmolLM2-135M-Instruct", "bench")
    senders = {t: KVSender(cache, layout, f"prefill-bench-{t}", transport=t) for t in transports}
    print(f"SmolLM2-135M KV: {BYTES_PER_BLOCK:,} bytes per block of {SPEC.block_size} tokens; 2 processes, "
          f"{iters} interleaved rounds; socket = gloo over loopback, shm = copy into the decode node's "
          f"shared-memory KV\n\nCPU: {cpu_name()}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
          f"flags: {' '.join(cpu_flags()) or 'unknown'}\n")
    print("| tokens | blocks | MB | transport | case | sends | median ms | p25-p75 ms | GB/s | vs raw gloo "
          "| vs memcpy |")
    print("|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for tokens in tokens_list:
        rows += await _bench_size(child, raw_pg, senders, tokens, iters)
    for sender in senders.values():
        await sender.close()
    assert child.proc.stdin is not None
    child.proc.stdin.close()
    child.proc.wait(30)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--tokens", default="128,1024,4096")
    parser.add_argument("--transports", default="socket,shm", help="comma-separated: socket, shm")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: both processes on one GPU, shm = CUDA IPC")
    parser.add_argument("--json", dest="json_path", help="also write the rows here as JSON")
    parser.add_argument("--role", choices=["prefill", "decode"], default="prefill", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "decode":
        asyncio.run(_decode_child(args.device))
    else:
        transports = args.transports.split(",")
        rows = asyncio.run(_bench([int(t) for t in args.tokens.split(",")], args.iters, transports, args.device))
        if args.json_path:
            Path(args.json_path).write_text(json.dumps({
                "model": "SmolLM2-135M-Instruct", "transports": transports, "bytes_per_block": BYTES_PER_BLOCK,
                "block_size": SPEC.block_size, "iters": args.iters, "device": args.device, "cpu": cpu_name(),
                "cpu_flags": cpu_flags(),
                "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

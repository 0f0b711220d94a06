"""Per-call latency of the tensor-parallel all-reduce on one host: gloo against shared memory (ShmComm).

    python -m benchmarks.bench_collectives [--world-size 2 3] [--iters N] [--max-bytes B] [--out FILE.json]

T ranks, each a spawned process with one torch thread, form a gloo group over loopback (GlooComm,
common/parallel/comm.py) and attach one ShmComm segment (common/parallel/shm_comm.py). Each rank then
all-reduces [1, 576], [8, 576], [64, 576] and [512, 576] (576: SmolLM2-135M's hidden size: one decode
token, a decode batch, a prefill chunk) in float32 and bfloat16 through both, after a warm-up, in
interleaved blocks of calls so every case sees the same machine weather. Every call is timed on every
rank (``all_reduce_`` alone: the tensor is refilled outside the timed region); since the ranks make the
same calls in the same order, call i's latency is the slowest rank's time for it, and the table gives the
median and 90th percentile of that in microseconds. With more ranks than idle cores the ranks share cores,
and the numbers mostly measure the scheduler: the report prints the cores and the load average.

Ranks report through JSON files in a temporary directory; only strings and ints cross the spawn.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.machine import cpu_name, load_average, machine_description
from common.parallel.comm import Communicator, GlooComm
from common.parallel.shm_comm import ShmComm
from common.parallel.spawn import run_ranks
from common.serving.port_reservation import reserve_port

SHAPES = [(1, 576), (8, 576), (64, 576), (512, 576)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BACKENDS = ("gloo", "shm")
WARMUP = 20  # calls per case before timing
BLOCK = 20  # timed calls per case per round
GROUP_TIMEOUT_S = 600.0


def _case_key(backend: str, shape: tuple[int, ...], dtype: str) -> str:
    return f"{backend}|{'x'.join(map(str, shape))}|{dtype}"


def _rank_main(rank: int, world_size: int, gloo_port: int, shm_name: str, iters: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    comms: dict[str, Communicator] = {"gloo": GlooComm(None, list(range(world_size))),
                                      "shm": ShmComm.attach(shm_name, rank, world_size, timeout_s=120.0)}
    cases = [(b, s, d) for s in SHAPES for d in DTYPES for b in BACKENDS]
    sources = {(s, d): torch.randn(s).to(dtype) for s in SHAPES for d, dtype in DTYPES.items()}
    tensors = {(s, d): x.clone() for (s, d), x in sources.items()}
    samples: dict[str, list[float]] = {_case_key(*case): [] for case in cases}
    for backend, shape, dtype in cases:
        for _ in range(WARMUP):
            comms[backend].all_reduce_(tensors[(shape, dtype)])
    while any(len(v) < iters for v in samples.values()):
        for backend, shape, dtype in cases:
            comm, tensor, source = comms[backend], tensors[(shape, dtype)], sources[(shape, dtype)]
            times = samples[_case_key(backend, shape, dtype)]
            for _ in range(min(BLOCK, iters - len(times))):
                tensor.copy_(source)  # the sum of T copies stays finite, whatever the number of calls
                start = time.perf_counter_ns()
                comm.all_reduce_(tensor)
                times.append((time.perf_counter_ns() - start) / 1e3)
    for comm in comms.values():
        comm.close()
    dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(samples))


def _bench_world(world_size: int, iters: int, max_bytes: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="tandem-collectives-") as out_dir, \
            ShmComm.create(world_size, max_bytes) as segment:
        port = reserve_port()
        codes = run_ranks(_rank_main, [(rank, world_size, port, segment.name, iters, out_dir)
                                       for rank in range(world_size)], GROUP_TIMEOUT_S)
        failed = [f"rank {rank}: exit code {code}" for rank, code in enumerate(codes) if code != 0]
        if failed:
            raise RuntimeError(f"T={world_size}: {', '.join(failed)}")
        per_rank = [json.loads(Path(out_dir, f"rank{rank}.json").read_text()) for rank in range(world_size)]
    rows = []
    for shape in SHAPES:
        for dtype, torch_dtype in DTYPES.items():
            for backend in BACKENDS:
                key = _case_key(backend, shape, dtype)
                slowest = [max(times) for times in zip(*(r[key] for r in per_rank), strict=True)]
                rows.append({"world_size": world_size, "shape": list(shape), "dtype": dtype, "backend": backend,
                             "bytes": torch.empty(shape, dtype=torch_dtype).nbytes,
                             "median_us": statistics.median(slowest),
                             "p90_us": statistics.quantiles(slowest, n=10)[8] if len(slowest) > 1 else slowest[0]})
    return rows


def markdown(result: dict[str, Any]) -> str:
    lines = [f"All-reduce latency per call, {result['iters']} timed calls per case (slowest rank's time per call); "
             "each rank one process with 1 torch thread", ""]
    lines += [f"- {line}" for line in result["machine"]]
    lines += [f"- CPU flags: {' '.join(result['cpu_flags']) or 'unknown'}",
              f"- load average at end (1/5/15 min): {result['load_average_end']}", "",
              "| T | shape | dtype | KiB | gloo median µs | gloo p90 µs | shm median µs | shm p90 µs | gloo / shm |",
              "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    by_case: dict[tuple[int, str, str], dict[str, dict[str, Any]]] = {}
    for row in result["rows"]:
        key = (row["world_size"], "x".join(map(str, row["shape"])), row["dtype"])
        by_case.setdefault(key, {})[row["backend"]] = row
    for (world_size, shape, dtype), rows in by_case.items():
        gloo, shm = rows["gloo"], rows["shm"]
        lines.append(f"| {world_size} | [{shape.replace('x', ', ')}] | {dtype} | {gloo['bytes'] / 1024:.1f} | "
                     f"{gloo['median_us']:.1f} | {gloo['p90_us']:.1f} | {shm['median_us']:.1f} | {shm['p90_us']:.1f} | "
                     f"{gloo['median_us'] / shm['median_us']:.1f}x |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every world size of ``args.world_size``; print the Markdown table, write ``args.out`` if set."""
    from benchmarks.bench_kv_transfer import cpu_flags  # on use: it imports the KV transfer stack

    if args.iters < 2 or any(t < 2 for t in args.world_size) or args.max_bytes < 1:
        raise ValueError("need --iters >= 2, every --world-size >= 2 and --max-bytes >= 1")
    machine = machine_description(1)
    rows = []
    for world_size in args.world_size:
        print(f"[collectives] T={world_size}: {args.iters} calls per case ...", file=sys.stderr, flush=True)
        rows += _bench_world(world_size, args.iters, args.max_bytes)
    result = {"benchmark": "collectives", "iters": args.iters, "world_sizes": args.world_size,
              "max_bytes": args.max_bytes, "cpu": cpu_name(), "cores": len(os.sched_getaffinity(0)),
              "cpu_flags": cpu_flags(), "machine": machine, "load_average_end": load_average(), "rows": rows}
    if getattr(args, "print_table", True):
        print(markdown(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=int, nargs="+", default=[2, 3], help="ranks per group, one run each [2 3]")
    p.add_argument("--iters", type=int, default=200, help="timed calls per case and world size [200]")
    p.add_argument("--max-bytes", type=int, default=4 << 20, help="ShmComm slot size; bigger tensors are chunked")
    p.add_argument("--out", help="also write the result here as JSON")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_collectives", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    try:
        run(parser.parse_args(argv))
    except ValueError as exc:
        print(f"bench collectives: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

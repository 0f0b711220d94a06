"""Serving benchmark: the disaggregated system and the colocated engine under the same load, over gRPC.

    tandem bench serve [--quick] [--num-requests N] [--rate R | --concurrency C] [--model M] [--dtype D]
    python -m benchmarks.bench_serve ...          (the same)

Both systems run as real processes on this machine, one after the other, each service pinned to its own
CPU cores with one torch thread per core (the launcher's placement, as `tandem up` does it):
- disaggregated: the gateway (not pinned: it runs no model), P prefill nodes and D decode nodes;
- colocated: P + D replicas of `tandem serve colocated` (the same public API over one engine that
  prefills and decodes, chunked prefill mixed into decode steps), so both systems get the same cores.
This process is the client: it sends the same seeded workload (benchmarks/serve_workload.py) to each
system, spreading requests over the colocated replicas (fewest outstanding requests first).

Load: Poisson arrivals at --rate requests/s (open loop: a system slower than the load builds a queue,
as in production), or --concurrency C requests in flight at all times (closed loop). Per request, on the
client's clock: TTFT (sent -> first token), TPOT ((last token - first token) / (tokens - 1)), ITL (gap
between consecutive streamed messages; a message carries several tokens when the client read slower than
the server produced), end-to-end latency. Throughput: over the run, first send to last token. Each system
first serves a few warm-up requests that are not measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.serve_workload import BenchRequest, Workload, log_uniform_mean

if TYPE_CHECKING:
    from tandem.v1.generate_pb2_grpc import TandemStub

SYSTEMS = ("disaggregated", "colocated")
DEFAULT_RATE = 1.0  # requests/s: near what one decode core sustains with SmolLM2 (README: the measured table)
QUICK = Workload(num_requests=12, prompt_len=(32, 256), output_len=(16, 64))


# ---- one request ---------------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """What the client saw of one request (``time.perf_counter`` seconds)."""

    index: int
    prompt_len: int
    expected_tokens: int
    target: str = ""
    sent: float = 0.0
    first: float | None = None  # the first message carrying tokens
    last: float | None = None
    num_tokens: int = 0
    num_messages: int = 0
    gaps: list[float] = field(default_factory=list)  # between consecutive token-carrying messages
    # The server's own account, from the last message's timings: admission to the start of the prefill
    # compute, and the KV transfer from prefill to decode node (0 when colocated).
    queue_s: float | None = None
    kv_transfer_s: float | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.first is not None


async def _send(stub: TandemStub, req: BenchRequest, record: RequestRecord, timeout_s: float) -> None:
    import grpc

    from tandem.v1 import common_pb2, generate_pb2

    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=req.prompt_token_ids),
        sampling=common_pb2.SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True),
        stream=generate_pb2.StreamOptions(include_token_ids=True, skip_text=True),
    )
    record.sent = time.perf_counter()
    try:
        async for response in stub.Generate(request, timeout=timeout_s):
            if response.HasField("timings"):
                record.queue_s = response.timings.queue_seconds
                record.kv_transfer_s = response.timings.kv_transfer_seconds
            n = len(response.token_ids)
            if not n:
                continue
            now = time.perf_counter()
            if record.last is not None:
                record.gaps.append(now - record.last)
            record.first = record.first or now
            record.last = now
            record.num_tokens += n
            record.num_messages += 1
    except grpc.aio.AioRpcError as exc:
        record.error = f"{exc.code().name}: {exc.details()}"


async def drive(targets: Sequence[str], requests: Sequence[BenchRequest], offsets: Sequence[float] | None,
                concurrency: int | None, timeout_s: float = 600.0) -> tuple[list[RequestRecord], float]:
    """Send ``requests`` at ``offsets`` (open loop) or ``concurrency`` at a time (closed loop); return the
    records and the run's duration (first send to last answer)."""
    import grpc

    from tandem.v1 import generate_pb2_grpc

    channels = [grpc.aio.insecure_channel(t) for t in targets]
    stubs = [generate_pb2_grpc.TandemStub(c) for c in channels]
    outstanding = [0] * len(targets)
    rotation = itertools.count()
    records = [RequestRecord(r.index, len(r.prompt_token_ids), r.output_len) for r in requests]

    async def one(i: int) -> None:
        # Fewest outstanding requests first; ties rotate, so an idle pair of replicas shares the load.
        start = next(rotation)
        k = min(range(len(targets)), key=lambda j: (outstanding[j], (j - start) % len(targets)))
        outstanding[k] += 1
        records[i].target = targets[k]
        try:
            await _send(stubs[k], requests[i], records[i], timeout_s)
        finally:
            outstanding[k] -= 1

    began = time.perf_counter()
    try:
        if concurrency is not None:
            pending = iter(range(len(requests)))

            async def worker() -> None:
                for i in pending:
                    await one(i)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            assert offsets is not None and len(offsets) == len(requests)

            async def at(i: int, offset: float) -> None:
                await asyncio.sleep(max(0.0, began + offset - time.perf_counter()))
                await one(i)

            await asyncio.gather(*(at(i, o) for i, o in enumerate(offsets)))
    finally:
        await asyncio.gather(*(c.close() for c in channels))
    return records, time.perf_counter() - began


# ---- statistics ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Distribution:
    mean: float
    p50: float
    p90: float
    p99: float

    @staticmethod
    def of(values: Sequence[float]) -> Distribution | None:
        if not values:
            return None
        import numpy as np

        p50, p90, p99 = (float(v) for v in np.percentile(values, [50, 90, 99]))
        return Distribution(float(np.mean(values)), p50, p90, p99)


@dataclass(frozen=True)
class Summary:
    system: str
    placement: str
    completed: int
    failed: int
    wrong_length: int  # completed with another number of tokens than asked (EOS is ignored: should be 0)
    duration_s: float
    input_tokens: int
    output_tokens: int
    ttft_s: Distribution | None
    tpot_s: Distribution | None
    itl_s: Distribution | None
    e2e_s: Distribution | None
    queue_s: Distribution | None  # server-side, see RequestRecord
    kv_transfer_s: Distribution | None
    tokens_per_message: float
    errors: tuple[str, ...] = ()

    @property
    def request_throughput(self) -> float:
        return self.completed / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0


def summarize(system: str, placement: str, records: Sequence[RequestRecord], duration_s: float) -> Summary:
    done = [r for r in records if r.ok]
    ttft = [r.first - r.sent for r in done if r.first is not None]
    tpot = [(r.last - r.first) / (r.num_tokens - 1) for r in done
            if r.first is not None and r.last is not None and r.num_tokens > 1]
    e2e = [r.last - r.sent for r in done if r.last is not None]
    messages = sum(r.num_messages for r in done)
    output_tokens = sum(r.num_tokens for r in done)
    return Summary(
        system=system, placement=placement, completed=len(done), failed=len(records) - len(done),
        wrong_length=sum(r.num_tokens != r.expected_tokens for r in done), duration_s=duration_s,
        input_tokens=sum(r.prompt_len for r in done), output_tokens=output_tokens,
        ttft_s=Distribution.of(ttft), tpot_s=Distribution.of(tpot),
        itl_s=Distribution.of([g for r in done for g in r.gaps]), e2e_s=Distribution.of(e2e),
        queue_s=Distribution.of([r.queue_s for r in done if r.queue_s is not None]),
        kv_transfer_s=Distribution.of([r.kv_transfer_s for r in done if r.kv_transfer_s is not None]),
        tokens_per_message=output_tokens / messages if messages else 0.0,
        errors=tuple(sorted({r.error for r in records if r.error}))[:5],
    )


def markdown_table(summaries: Sequence[Summary]) -> str:
    """The systems side by side, one metric per row."""
    rows: list[tuple[str, list[str]]] = [
        ("completed / failed", [f"{s.completed} / {s.failed}" for s in summaries]),
        ("duration (s)", [f"{s.duration_s:.1f}" for s in summaries]),
        ("requests/s", [f"{s.request_throughput:.3f}" for s in summaries]),
        ("output tokens/s", [f"{s.output_throughput:.1f}" for s in summaries]),
        ("total tokens/s (in + out)", [f"{(s.input_tokens + s.output_tokens) / s.duration_s:.1f}"
                                       if s.duration_s > 0 else "-" for s in summaries]),
    ]
    for label, attr, scale, unit, stats in (
            ("TTFT", "ttft_s", 1000, "ms", ("mean", "p50", "p90", "p99")),
            ("TPOT", "tpot_s", 1000, "ms", ("mean", "p50", "p90", "p99")),
            ("ITL", "itl_s", 1000, "ms", ("mean", "p50", "p90", "p99")),
            ("E2E latency", "e2e_s", 1, "s", ("mean", "p50", "p90", "p99")),
            ("server queue", "queue_s", 1000, "ms", ("p50", "p99")),  # parts of TTFT, as the server saw them
            ("KV transfer", "kv_transfer_s", 1000, "ms", ("p50", "p99"))):
        for stat in stats:
            values = []
            for s in summaries:
                dist: Distribution | None = getattr(s, attr)
                values.append("-" if dist is None else _fmt(getattr(dist, stat) * scale))
            rows.append((f"{label} {stat} ({unit})", values))
    rows.append(("tokens per streamed message", [f"{s.tokens_per_message:.2f}" for s in summaries]))
    rows.append(("outputs of the wrong length", [str(s.wrong_length) for s in summaries]))
    header = "| metric | " + " | ".join(s.system for s in summaries) + " |"
    lines = [header, "|---|" + "---:|" * len(summaries)]
    lines += [f"| {label} | " + " | ".join(values) + " |" for label, values in rows]
    return "\n".join(lines)


def _fmt(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


# ---- the systems ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def deployment(system: str, model_args: tuple[str, ...], num_prefill: int, num_decode: int,
               cpus: tuple[int, ...], log_dir: Path) -> Iterator[tuple[list[str], str]]:
    """Start ``system``; yield the client's targets and a description of where each service runs."""
    from tandem_cli.launcher import ColocatedTopology, Launcher, Topology

    topology: Topology | ColocatedTopology
    if system == "disaggregated":
        topology = Topology(num_prefill=num_prefill, num_decode=num_decode, free_ports=True,
                            model_args=model_args, cpus=cpus)
    else:
        topology = ColocatedTopology(replicas=num_prefill + num_decode, free_ports=True, model_args=model_args,
                                     cpus=cpus)
    launcher = Launcher(topology, log_dir=log_dir / system)
    with launcher:
        placement = ", ".join(f"{s.name} [cpu {','.join(map(str, s.cpus))}]" if s.cpus else f"{s.name} [unpinned]"
                              for s in launcher.specs)
        targets = [s.target for s in launcher.specs if s.role in ("gateway", "colocated")]
        yield targets, placement


def bench_system(system: str, args: argparse.Namespace, workload: Workload, vocab_size: int,
                 model_args: tuple[str, ...], log_dir: Path) -> Summary:
    requests = workload.requests(vocab_size)
    offsets = None if args.concurrency else workload.arrival_offsets(args.rate)
    started = time.perf_counter()
    with deployment(system, model_args, args.prefill_nodes, args.decode_nodes, args.cpus, log_dir) as (
            targets, placement):
        _progress(f"{system}: up in {time.perf_counter() - started:.1f} s ({placement}); warming up")
        warm = Workload(num_requests=2 * len(targets), prompt_len=(48, 256), output_len=(4, 8), seed=workload.seed + 1)
        warm_records, _ = asyncio.run(drive(targets, warm.requests(vocab_size), [0.0] * warm.num_requests, None))
        if failed := [r.error for r in warm_records if not r.ok]:
            raise RuntimeError(f"{system}: warm-up requests failed: {failed[0]}")
        _progress(f"{system}: sending {workload.num_requests} requests")
        records, duration = asyncio.run(drive(targets, requests, offsets, args.concurrency, args.timeout))
    summary = summarize(system, placement, records, duration)
    _progress(f"{system}: {summary.completed}/{len(records)} done in {duration:.1f} s, "
              f"{summary.output_throughput:.1f} output tokens/s")
    return summary


# ---- command line --------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="local Hugging Face directory or the bundled model's name [TANDEM_MODEL]")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help="[TANDEM_DTYPE, auto = bf16 on CPUs with AVX512-BF16/AMX, else fp32]")
    p.add_argument("--num-requests", type=int, help=f"requests per system [{Workload().num_requests}; "
                   f"--quick {QUICK.num_requests}]")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, help=f"Poisson arrivals, requests/s; inf = all at once [{DEFAULT_RATE}]")
    load.add_argument("--concurrency", type=int, help="closed loop: keep this many requests in flight instead")
    p.add_argument("--prompt-len", type=_length_range, help="prompt lengths LOW:HIGH, log-uniform "
                   f"[{_show(Workload().prompt_len)}; --quick {_show(QUICK.prompt_len)}]")
    p.add_argument("--output-len", type=_length_range, help="output lengths LOW:HIGH, log-uniform "
                   f"[{_show(Workload().output_len)}; --quick {_show(QUICK.output_len)}]")
    p.add_argument("--seed", type=int, default=0, help="workload seed [0]")
    p.add_argument("--quick", action="store_true", help="a smaller, shorter workload (about a minute)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {', '.join(SYSTEMS)}")
    p.add_argument("--prefill-nodes", type=int, default=1)
    p.add_argument("--decode-nodes", type=int, default=1)
    p.add_argument("--cpus", type=_cpu_list, help="cores to place the services on, e.g. 0-3 or 0,2 "
                   "[every core this process may use]")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request deadline, seconds [600]")
    p.add_argument("--log-dir", help="each service's log goes here [a temporary directory, printed]")
    p.add_argument("--json", dest="json_path", help="also write the results here as JSON")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark for ``args`` (from ``add_arguments``); print a Markdown report on stdout."""
    from common.config.model_config import ModelConfig
    from common.config.settings import ModelSettings, load_settings
    from common.model.model_store import resolve_model

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems or set(systems) - set(SYSTEMS):
        raise ValueError(f"--systems: choose from {', '.join(SYSTEMS)}, got {args.systems!r}")
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    base = QUICK if args.quick else Workload()
    workload = Workload(num_requests=args.num_requests or base.num_requests,
                        prompt_len=args.prompt_len or base.prompt_len, output_len=args.output_len or base.output_len,
                        seed=args.seed)
    if args.concurrency is None and args.rate is None:
        args.rate = DEFAULT_RATE
    args.cpus = args.cpus or tuple(sorted(os.sched_getaffinity(0)))
    settings = load_settings(ModelSettings, {"model": args.model, "dtype": args.dtype})
    model_dir = resolve_model(settings.model, settings.home, progress=True)
    dtype = _resolve_dtype(settings.dtype, settings.device)
    # Every process gets the same explicit model and dtype (the gateway then reports the dtype the nodes run).
    model_args = ("--model", str(model_dir), "--dtype", dtype)
    vocab_size = ModelConfig.from_pretrained(model_dir).vocab_size
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="tandem-bench-serve-"))

    summaries = [bench_system(system, args, workload, vocab_size, model_args, log_dir) for system in systems]
    print(report(summaries, workload, args, model_dir.name, dtype))
    _progress(f"service logs: {log_dir}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({
            "model": model_dir.name, "dtype": dtype, "workload": asdict(workload), "rate": args.rate,
            "concurrency": args.concurrency, "cpus": list(args.cpus),
            "systems": [{**asdict(s), "request_throughput": s.request_throughput,
                         "output_throughput": s.output_throughput} for s in summaries],
        }, indent=2))
    return 0 if all(s.failed == 0 for s in summaries) else 1


def report(summaries: Sequence[Summary], workload: Workload, args: argparse.Namespace, model: str,
           dtype: str) -> str:
    load = (f"closed loop, {args.concurrency} in flight" if args.concurrency
            else "all at once" if math.isinf(args.rate) else f"Poisson arrivals at {args.rate:g} requests/s")
    (plo, phi), (olo, ohi) = workload.prompt_len, workload.output_len
    lines = [
        f"### Serving benchmark: {model} ({dtype}), {workload.num_requests} requests, {load}",
        "",
        f"Workload (seed {workload.seed}): prompts {plo}-{phi} tokens (log-uniform, mean "
        f"{log_uniform_mean(plo, phi):.0f}), outputs {olo}-{ohi} tokens (mean {log_uniform_mean(olo, ohi):.0f}), "
        "random token ids, greedy, EOS ignored. Machine: " + _machine(),
        "",
        markdown_table(summaries),
        "",
    ]
    lines += [f"- {s.system}: {s.placement}" for s in summaries]
    for s in summaries:
        lines += [f"- {s.system} errors: {e}" for e in s.errors]
    return "\n".join(lines)


def _machine() -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model}, {os.cpu_count()} cores."


def _resolve_dtype(name: str, device: str) -> str:
    from common.model.loader import resolve_dtype

    return str(resolve_dtype(name, device)).removeprefix("torch.")


def _length_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        low, high = int(lo), int(hi if sep else lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW:HIGH token counts, got {text!r}") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"expected 1 <= LOW <= HIGH, got {text!r}")
    return low, high


def _cpu_list(text: str) -> tuple[int, ...]:
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected cores such as 0-3 or 0,2, got {text!r}") from None
    return tuple(sorted(cpus))


def _show(r: tuple[int, int]) -> str:
    return f"{r[0]}:{r[1]}"


def _progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except ValueError as exc:
        print(f"bench serve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

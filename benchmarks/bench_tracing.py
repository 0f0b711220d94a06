"""Tracing overhead: the disaggregated system's throughput with every span exported vs tracing off, same run.

    python -m benchmarks.bench_tracing [--model SmolLM2-135M-Instruct|tiny|DIR] [--requests N]
                                       [--concurrency C] [--max-tokens T] [--rounds R]

The real system (gateway, one prefill node, one decode node, as `tandem up` places them) runs once per
mode and round, in ABBA order (off, on, on, off, ...) so that drift of the machine hits both modes alike.
With tracing on, every service exports every span (sampler always_on) over OTLP/gRPC to a collector in
this process that decodes and counts them; the batch span processor flushes every second (its default is
5 s) so export work lands inside the measured window. Metrics endpoints are on in both modes.

Load: a closed loop of C concurrent clients over N seeded requests (prompts of 64-192 random token ids,
T greedy tokens each, EOS ignored: every request yields exactly T tokens). Throughput is generated tokens
over the wall time from the first send to the last token; each deployment serves a few warm-up requests
first. The table ends with the relative difference of the modes' throughput, median and mean over the
rounds, and of their CPU per request (all three services, from /proc). Goal: throughput within 3%.

The default model is the bundled SmolLM2-135M-Instruct (``--dtype float32`` unless told), where the goal
applies. ``--model tiny`` serves a random-weight 2-layer model with SmolLM2's tokenizer: a
forward takes a millisecond or two, so per-request costs such as spans (about 10 per request, each some
80-100 us of CPU to create and OTLP-encode in the Python SDK) weigh the most there: the worst case.
Run-to-run noise on a shared 2-core machine is large; compare the modes within one run, and read the CPU
per request beside the throughput.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

WARMUP_REQUESTS = 4


# ---- the collector ----------------------------------------------------------------------------------


class CountingCollector:
    """An OTLP/gRPC TraceService that decodes every export and counts the spans."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        collector = self
        self.num_spans = 0
        self._lock = threading.Lock()

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # type: ignore[no-untyped-def]
                n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
                with collector._lock:
                    collector.num_spans += n
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._server.stop(0)


# ---- the workload -----------------------------------------------------------------------------------


def workload(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40_000) for _ in range(rng.randrange(64, 193))] for _ in range(n)]


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds each process has used so far (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in pids.items():
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        out[name] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def run_load(target: str, prompts: list[list[int]], concurrency: int, max_tokens: int,
             pids: dict[str, int]) -> tuple[float, int, list[float], dict[str, float]]:
    """Wall seconds, tokens received, each request's time to first token, CPU seconds per service."""
    from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc

    params = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    stream = generate_pb2.StreamOptions(include_token_ids=True)
    with grpc.insecure_channel(target) as channel:
        stub = generate_pb2_grpc.TandemStub(channel)

        def one(ids: list[int]) -> tuple[int, float]:
            sent = time.perf_counter()
            first = None
            tokens = 0
            for msg in stub.Generate(generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=ids),
                                                                  sampling=params, stream=stream), timeout=300):
                if first is None and msg.token_ids:
                    first = time.perf_counter() - sent
                tokens += len(msg.token_ids)
            return tokens, first or 0.0

        with futures.ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, prompts[:WARMUP_REQUESTS]))
            cpu_before = cpu_seconds(pids)
            start = time.perf_counter()
            results = list(pool.map(one, prompts))
            wall = time.perf_counter() - start
            cpu_after = cpu_seconds(pids)
    cpu = {name: cpu_after[name] - cpu_before[name] for name in pids}
    return wall, sum(t for t, _ in results), [f for _, f in results], cpu


# ---- one deployment ---------------------------------------------------------------------------------


@dataclass
class Result:
    mode: str
    round: int
    wall_s: float
    tokens: int
    requests: int
    ttft_p50_s: float
    spans: int
    cpu_s: dict[str, float]  # CPU seconds each service used during the measured load

    @property
    def cpu_ms_per_request(self) -> float:
        return sum(self.cpu_s.values()) / self.requests * 1000

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def run_mode(traced: bool, rnd: int, model_dir: Path, args: argparse.Namespace, log_dir: Path) -> Result:
    from tandem_cli.launcher import Launcher, Topology

    collector = CountingCollector() if traced else None
    env = {"OTEL_SDK_DISABLED": "true"}
    if collector is not None:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "OTEL_TRACES_SAMPLER": "always_on",
               "OTEL_BSP_SCHEDULE_DELAY": "1000"}
    env["TANDEM_LOG_LEVEL"] = "WARNING"  # per-request log lines are not what is measured here
    for key in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        os.environ.pop(key, None)
    topology = Topology(free_ports=True, metrics_base_port=0,
                        model_args=("--model", str(model_dir), *(("--dtype", args.dtype) if args.dtype else ())),
                        # Short steps: a node's Stats answer waits for the step, and the gateway takes a node
                        # that has not answered within min(stats interval, 2 s) for down.
                        node_args=("--num-blocks", "1024", "--grace-s", "1", "--max-num-batched-tokens", "256"),
                        gateway_args=("--shutdown-grace-s", "1", "--stats-interval-s", "2"))
    prompts = workload(args.requests)
    mode = "tracing on (OTLP export)" if traced else "tracing off"
    try:
        with Launcher(topology, log_dir=log_dir / f"{'on' if traced else 'off'}-{rnd}", env=env) as launcher:
            pids = {name: proc.pid for name, proc in launcher.procs.items()}
            wall, tokens, ttfts, cpu = run_load(launcher.gateway.target, prompts, args.concurrency, args.max_tokens,
                                                pids)
        spans = collector.num_spans if collector else 0  # the launcher's stop flushed every service
    finally:
        if collector is not None:
            collector.stop()
    expected = args.requests * args.max_tokens
    if tokens != expected:
        raise RuntimeError(f"{mode}: got {tokens} tokens, expected {expected}")
    result = Result(mode, rnd, wall, tokens, len(prompts), statistics.median(ttfts), spans, cpu)
    per = " ".join(f"{k}={v / len(prompts) * 1000:.1f}" for k, v in sorted(cpu.items()))
    print(f"  round {rnd} {mode:26s} {result.tokens_per_s:8.1f} tok/s  ({wall:.2f} s, {spans} spans, "
          f"CPU ms/request {per})", file=sys.stderr, flush=True)
    return result


def resolve(model: str, tmp: Path) -> Path:
    if model == "tiny":
        return make_tiny_served_model(tmp / "tiny")
    from common.config.settings import ModelSettings, load_settings
    from common.model.model_store import resolve_model

    settings = load_settings(ModelSettings, {"model": model})
    return resolve_model(settings.model, settings.home, progress=True)


def make_tiny_served_model(directory: Path) -> Path:
    """A random-weight 2-layer Llama with the bundled model's vocabulary and tokenizer (as the e2e tests use)."""
    import shutil

    import torch
    import transformers

    from common.config.settings import ModelSettings, load_settings
    from common.model.model_store import prepare_default_model

    smollm2 = prepare_default_model(load_settings(ModelSettings).home, progress=True)
    torch.manual_seed(11)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    transformers.LlamaForCausalLM(config).float().save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (smollm2 / name).exists():
            shutil.copy(smollm2 / name, directory / name)
    return directory


def table(results: list[Result], args: argparse.Namespace, model: str) -> str:
    lines = [f"Tracing overhead: {model}, {args.requests} requests x {args.max_tokens} tokens, concurrency "
             f"{args.concurrency}, {args.rounds} rounds (ABBA), {os.cpu_count()} CPUs", "",
             "| mode | round | wall s | tokens/s | TTFT p50 ms | CPU ms / request (all services) | spans exported |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(results, key=lambda r: (r.mode, r.round)):
        lines.append(f"| {r.mode} | {r.round} | {r.wall_s:.2f} | {r.tokens_per_s:.1f} | {r.ttft_p50_s * 1000:.1f} "
                     f"| {r.cpu_ms_per_request:.1f} | {r.spans} |")
    medians, means, cpu = {}, {}, {}
    for mode in sorted({r.mode for r in results}):
        rows = [r for r in results if r.mode == mode]
        medians[mode] = statistics.median(r.tokens_per_s for r in rows)
        means[mode] = statistics.mean(r.tokens_per_s for r in rows)
        cpu[mode] = statistics.median(r.cpu_ms_per_request for r in rows)
        ttft = statistics.median(r.ttft_p50_s for r in rows)
        spans = sum(r.spans for r in rows) / sum(r.requests for r in rows)
        lines.append(f"| **{mode}, median** | | | **{medians[mode]:.1f}** (mean {means[mode]:.1f}) "
                     f"| {ttft * 1000:.1f} | {cpu[mode]:.1f} | {spans:.1f} / request |")
    off, on = "tracing off", "tracing on (OTLP export)"
    if off in medians and on in medians:
        def rel(d: dict[str, float]) -> str:
            return f"{(d[on] - d[off]) / d[off] * 100:+.2f}%"

        lines += ["", f"Tracing exported vs off: throughput {rel(medians)} (median of rounds; mean {rel(means)}), "
                      f"CPU per request {rel(cpu)}. Goal: throughput within 3%."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct",
                        help="the bundled model's name, a Hugging Face dir, or tiny (random weights: the worst case)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4, help="each round runs both modes (order alternates)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-tracing-") as tmp:
        model_dir = resolve(args.model, Path(tmp))
        results = []
        for rnd in range(args.rounds):
            order = (False, True) if rnd % 2 == 0 else (True, False)
            for traced in order:
                results.append(run_mode(traced, rnd, model_dir, args, Path(tmp) / "logs"))
    print(table(results, args, args.model))
    return 0


if __name__ == "__main__":
    sys.exit(main())

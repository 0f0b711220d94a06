"""Relay overhead of the gateway: streamed tokens/s through one gateway process, OpenAI HTTP SSE vs gRPC.

    python -m benchmarks.bench_http_relay [--quick] [--model M] [--streams N] [--tokens T] [--json PATH]

Three processes on loopback: scripted nodes (benchmarks/relay_nodes.py: a decode node that streams one
token per message as fast as it is read, no model), one gateway (``tandem serve gateway``, every prompt
"prefilled" on the decode node), and this client, which keeps ``--streams`` requests of ``--tokens`` tokens
each in flight, first over the HTTP API (streaming ``/v1/completions``, server-sent events read raw with
httpx, tokens counted from the final usage), then over gRPC ``Generate`` (text and token ids). Reported per
front: tokens/s over the run, and the gateway's own CPU time (from /proc) per 1000 tokens, which is what
the relay costs whatever the client's speed. The goal (issue 18): >= 5000 tokens/s over HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.machine import cpu_name
from common.serving.port_reservation import reserve_ports

GOAL_TOKENS_PER_S = 5000.0


@dataclass(frozen=True)
class RelayRow:
    api: str
    streams: int
    tokens_per_request: int
    tokens: int
    messages: int
    seconds: float
    gateway_cpu_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_ms_per_1k_tokens(self) -> float:
        return 1e6 * self.gateway_cpu_s / self.tokens if self.tokens else 0.0


def _cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (and its threads) from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _http_run(base_url: str, streams: int, tokens: int, requests: int) -> tuple[int, int]:
    import httpx

    from benchmarks.openai_client import served_model

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=streams), timeout=60.0) as client:
        model = await served_model(client, base_url)
        body = {"model": model, "prompt": [1, 2, 3, 4], "max_tokens": tokens, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        counts = [0, 0]  # tokens, messages
        pending = iter(range(requests))

        async def worker() -> None:
            for _ in pending:
                async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
                    response.raise_for_status()
                    async for line in response.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if usage := chunk.get("usage"):
                            counts[0] += int(usage["completion_tokens"])
                        elif chunk.get("choices"):
                            counts[1] += 1

        await asyncio.gather(*(worker() for _ in range(streams)))
        return counts[0], counts[1]


async def _grpc_run(target: str, streams: int, tokens: int, requests: int) -> tuple[int, int]:
    import grpc

    from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc

    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=[1, 2, 3, 4]), stream=generate_pb2.StreamOptions(include_token_ids=True),
        sampling=common_pb2.SamplingParams(max_tokens=tokens, ignore_eos=True))
    counts = [0, 0]
    pending = iter(range(requests))
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generate_pb2_grpc.TandemStub(channel)

        async def worker() -> None:
            for _ in pending:
                async for response in stub.Generate(request, timeout=60.0):
                    counts[0] += len(response.token_ids)
                    counts[1] += 1

        await asyncio.gather(*(worker() for _ in range(streams)))
    return counts[0], counts[1]


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with code {proc.returncode} during start-up")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the gateway was not ready within {timeout_s:.0f} s")


def bench(model_dir: Path, streams: int, tokens: int, requests: int, log_dir: Path) -> list[RelayRow]:
    """Start the scripted nodes and a gateway, drive both fronts in turn, stop everything."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log_dir.mkdir(parents=True, exist_ok=True)
    nodes = subprocess.Popen([sys.executable, "-m", "benchmarks.relay_nodes"], stdout=subprocess.PIPE,
                             stderr=(log_dir / "relay-nodes.log").open("wb"), env=env)
    gateway: subprocess.Popen[bytes] | None = None
    try:
        assert nodes.stdout is not None
        line = nodes.stdout.readline().decode().split()
        if len(line) != 3 or line[0] != "ready":
            raise RuntimeError(f"the scripted nodes did not start: {line}")
        prefill, decode = line[1], line[2]
        port, http_port = reserve_ports(2)
        gateway = subprocess.Popen(
            [sys.executable, "-m", "tandem_cli", "serve", "gateway", "--model", str(model_dir), "--port", str(port),
             "--http-port", str(http_port), "--prefill", prefill, "--decode", decode,
             "--local-prefill-max-tokens", "1000000", "--max-inflight", str(4 * streams)],
            stdout=(log_dir / "gateway.log").open("wb"), stderr=subprocess.STDOUT, env=env)
        base_url = f"http://127.0.0.1:{http_port}"
        _wait_ready(base_url, gateway)
        rows = []
        for api in ("openai", "grpc"):
            async def run(api: str = api, n: int = requests) -> tuple[int, int]:
                if api == "openai":
                    return await _http_run(base_url, streams, tokens, n)
                return await _grpc_run(f"127.0.0.1:{port}", streams, tokens, n)

            asyncio.run(run(n=streams))  # warm-up: connections, the tokenizer's caches
            cpu0, t0 = _cpu_seconds(gateway.pid), time.perf_counter()
            num_tokens, messages = asyncio.run(run())
            seconds, cpu = time.perf_counter() - t0, _cpu_seconds(gateway.pid) - cpu0
            rows.append(RelayRow(api, streams, tokens, num_tokens, messages, seconds, cpu))
            _progress(f"{api}: {rows[-1].tokens_per_s:,.0f} tokens/s")
        return rows
    finally:
        for proc in (gateway, nodes):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def report(rows: list[RelayRow]) -> str:
    lines = [f"### Gateway relay overhead (loopback, scripted nodes): {cpu_name()}, {os.cpu_count()} cores", "",
             "| front | streams | tokens/request | tokens | messages | tokens/s | gateway CPU ms / 1k tokens |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        name = "OpenAI HTTP (SSE)" if r.api == "openai" else "gRPC"
        lines.append(f"| {name} | {r.streams} | {r.tokens_per_request} | {r.tokens} | {r.messages} | "
                     f"{r.tokens_per_s:,.0f} | {r.cpu_ms_per_1k_tokens:.0f} |")
    http = next((r for r in rows if r.api == "openai"), None)
    if http is not None:
        verdict = "meets" if http.tokens_per_s >= GOAL_TOKENS_PER_S else "misses"
        lines += ["", f"HTTP {verdict} the goal of {GOAL_TOKENS_PER_S:,.0f} streamed tokens/s through one gateway "
                  "process (client, gateway and nodes share this machine's cores)."]
    return "\n".join(lines)


def rows_json(rows: list[RelayRow]) -> dict[str, object]:
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "goal_tokens_per_s": GOAL_TOKENS_PER_S,
            "rows": [{**asdict(r), "tokens_per_s": r.tokens_per_s, "cpu_ms_per_1k_tokens": r.cpu_ms_per_1k_tokens}
                     for r in rows]}


def _progress(message: str) -> None:
    print(f"[relay] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_http_relay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="the model whose tokenizer the gateway loads [the bundled model]")
    p.add_argument("--streams", type=int, help="requests in flight [32; --quick 8]")
    p.add_argument("--tokens", type=int, help="tokens per request [512; --quick 128]")
    p.add_argument("--requests", type=int, help="requests per front [4 x streams]")
    p.add_argument("--quick", action="store_true", help="a few seconds per front")
    p.add_argument("--log-dir", help="the gateway's and the nodes' logs [a temporary directory]")
    p.add_argument("--json", dest="json_path", help="also write the results here as JSON")
    args = p.parse_args(argv)
    import tempfile

    from common.config.settings import ModelSettings, load_settings
    from common.model.model_store import resolve_model

    settings = load_settings(ModelSettings, {"model": args.model})
    model_dir = resolve_model(settings.model, settings.home, progress=True)
    streams = args.streams or (8 if args.quick else 32)
    tokens = args.tokens or (128 if args.quick else 512)
    if streams < 1 or tokens < 1:
        print("bench_http_relay: error: --streams and --tokens must be >= 1", file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="tandem-bench-relay-"))
    rows = bench(model_dir, streams, tokens, args.requests or 4 * streams, log_dir)
    print(report(rows))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows_json(rows), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

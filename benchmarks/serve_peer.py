"""Serving against vLLM's own server, measured by vLLM's own client: ``tandem bench serve --peer vllm``.

Each system runs alone on the same cores, one after the other: ``vllm`` (vLLM's OpenAI server,
benchmarks/peers/vllm_server.py), ``colocated`` (one ``tandem serve colocated`` on every core),
``disaggregated`` and ``conditional`` (``tandem up``: one prefill and one decode node, each on its share of
the cores, and the gateway). Same model directory, same precision, same KV cache budget. Each is started,
timed to its first healthy answer (its time to ready), warmed up with a short run of the first workload
(vLLM compiles on its first requests too), then driven by ``vllm bench serve`` (the module, from the peer's
venv) over its OpenAI ``/v1/completions`` for every workload and rate; Tandem's own client
(benchmarks/serve_client.py) drives the same systems with the first workload's shape as a cross-check.

Workloads (``--peer-workloads``): ``random-384-128`` (the issue's shape), ``random-1024-64`` (prefill
heavy), ``random-128-256`` (decode heavy), ``chat`` (a chat-shaped length distribution shipped in
benchmarks/data/chat_lengths.jsonl) and ``shared-prefix`` (a 512-token prefix that every prompt shares).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.machine import cpu_name, vector_flags
from benchmarks.peers.registry import find_peer
from benchmarks.peers.vllm_server import ClientWorkload, VLLMServerConfig, run_vllm_client, vllm_server

REPO = Path(__file__).resolve().parents[1]
CHAT_LENGTHS = Path(__file__).resolve().parent / "data" / "chat_lengths.jsonl"
PEER_SYSTEMS = ("vllm", "colocated", "disaggregated", "conditional")
KV_CACHE_GIB = 1  # each system's KV budget: Tandem's node default (--kv-cache-memory-gb 1)


def client_workloads(num_prompts: int) -> dict[str, ClientWorkload]:
    """The named workloads, each with ``num_prompts`` requests and SLOs for its goodput."""
    random_args = ("--dataset-name", "random", "--random-range-ratio", "0")
    return {w.name: w for w in (
        ClientWorkload("random-384-128", (*random_args, "--random-input-len", "384", "--random-output-len", "128"),
                       num_prompts, ttft_slo_ms=5000, tpot_slo_ms=500),
        ClientWorkload("random-1024-64", (*random_args, "--random-input-len", "1024", "--random-output-len", "64"),
                       num_prompts, ttft_slo_ms=10000, tpot_slo_ms=500),
        ClientWorkload("random-128-256", (*random_args, "--random-input-len", "128", "--random-output-len", "256"),
                       num_prompts, ttft_slo_ms=3000, tpot_slo_ms=300),
        ClientWorkload("chat", ("--dataset-name", "custom", "--dataset-path", str(CHAT_LENGTHS),
                                "--skip-chat-template"), num_prompts, ttft_slo_ms=4000, tpot_slo_ms=300),
        ClientWorkload("shared-prefix", (*random_args, "--random-prefix-len", "512", "--random-input-len", "64",
                                         "--random-output-len", "64"), num_prompts, ttft_slo_ms=3000,
                       tpot_slo_ms=300),
    )}


@dataclass(frozen=True)
class Row:
    """One system x workload x rate, as vLLM's client (or Tandem's) measured it."""

    system: str
    workload: str
    rate: float
    client: str  # "vllm bench serve" | "tandem"
    result: dict[str, Any]  # vLLM's result keys (Tandem's client's figures mapped onto them)

    def get(self, key: str) -> float:
        return float(self.result.get(key) or 0.0)


@contextlib.contextmanager
def system_server(name: str, model_dir: Path, dtype: str, cpus: tuple[int, ...], log_dir: Path,
                  vllm_python: Path) -> Iterator[tuple[str, float]]:
    """Start ``name``; yield (the base URL of its OpenAI API, seconds to ready)."""
    if name == "vllm":
        # The longest workload fits in 4096 tokens; a model with fewer positions gets its own (vLLM refuses more).
        positions = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings", 4096)
        config = VLLMServerConfig(model_dir, model_dir.name, dtype, cpus, KV_CACHE_GIB,
                                  max_model_len=min(4096, int(positions)))
        with vllm_server(vllm_python, config, log_dir / "vllm.log") as served:
            yield served
        return
    from tandem_cli.launcher import ColocatedTopology, Launcher, Topology

    model_args = ("--model", str(model_dir), "--dtype", dtype)
    node_args = ("--kv-cache-memory-gb", str(KV_CACHE_GIB))
    topology: Topology | ColocatedTopology
    if name == "colocated":
        topology = ColocatedTopology(replicas=1, free_ports=True, model_args=model_args, node_args=node_args,
                                     cpus=cpus, serve_http=True)
    else:
        local = "256" if name == "conditional" else "0"
        topology = Topology(num_prefill=1, num_decode=1, free_ports=True, model_args=model_args,
                            node_args=node_args, gateway_args=("--local-prefill-max-tokens", local), cpus=cpus)
    start = time.monotonic()
    with Launcher(topology, log_dir=log_dir / name) as launcher:
        front = next(s for s in launcher.specs if s.role in ("gateway", "colocated"))
        yield f"http://127.0.0.1:{front.http_port}", time.monotonic() - start


def tandem_client_run(base_url: str, workload: str, num_prompts: int, rate: float, vocab_size: int,
                      seed: int) -> dict[str, Any]:
    """Tandem's client (token-id prompts over the same /v1/completions, the server's default temperature)
    with a random-IN-OUT workload's shape, its figures under vLLM's result keys."""
    from benchmarks.serve_client import Api, drive
    from benchmarks.serve_stats import Distribution, summarize
    from benchmarks.workloads import TimedRequest

    _, in_len, out_len = workload.split("-")
    rng = random.Random(seed)
    requests, t = [], 0.0
    for k in range(num_prompts):
        t += 0.0 if math.isinf(rate) else rng.expovariate(rate)
        prompt = tuple(rng.randrange(1000, vocab_size) for _ in range(int(in_len)))
        requests.append(TimedRequest(k, prompt, int(out_len), t, "random"))
    # No temperature, as vLLM's client sends none: both clients ask for the same (sampled) decoding.
    records, duration = asyncio.run(drive([base_url], requests, None, 3600.0, api=Api.OPENAI, temperature=None))
    s = summarize("tandem-client", "", records, duration, None)

    def ms(d: Distribution | None, q: str) -> float:
        return 1000 * float(getattr(d, q)) if d is not None else 0.0

    return {"completed": s.completed, "num_prompts": num_prompts, "duration": duration,
            "output_throughput": s.output_throughput, "request_throughput": s.request_throughput,
            **{f"{q}_{name}_ms": ms(getattr(s, f"{name}_s"), q) for name in ("ttft", "tpot", "itl")
               for q in ("p50", "p99")}}


def run(args: argparse.Namespace, model_dir: Path, dtype: str, vocab_size: int) -> int:
    """``tandem bench serve --peer vllm``: every system, workload and rate; a Markdown report on stdout."""
    peer, why = find_peer("vllm", REPO)
    if peer is None:
        raise ValueError(f"--peer vllm: {why}")
    systems = [s.strip() for s in (args.peer_systems or ",".join(PEER_SYSTEMS)).split(",") if s.strip()]
    if set(systems) - set(PEER_SYSTEMS):
        raise ValueError(f"--peer-systems: choose from {', '.join(PEER_SYSTEMS)}, got {args.peer_systems!r}")
    num_prompts = args.num_requests or (8 if args.quick else 48)
    named = client_workloads(num_prompts)
    workloads = [w.strip() for w in args.peer_workloads.split(",") if w.strip()]
    if not workloads or set(workloads) - set(named):
        raise ValueError(f"--peer-workloads: choose from {', '.join(named)}, got {args.peer_workloads!r}")
    rates: Sequence[float] = args.rate or ((math.inf,) if args.quick else (2.0, math.inf))
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="tandem-bench-peer-"))
    rows: list[Row] = []
    ready: dict[str, float | str] = {}
    for name in systems:
        _progress(f"{name}: starting")
        try:
            with system_server(name, model_dir, dtype, args.cpus, log_dir, peer.python) as (url, seconds):
                ready[name] = seconds
                _progress(f"{name}: ready in {seconds:.1f} s at {url}; warming up")
                warm = ClientWorkload("warm-up", named[workloads[0]].dataset_args, max(4, num_prompts // 4),
                                      1e9, 1e9)
                run_vllm_client(peer.python, url, model_dir.name, model_dir, warm, math.inf,
                                log_dir / f"{name}-warm-up.json", seed=1)
                for workload in workloads:
                    for k, rate in enumerate(rates):
                        _progress(f"{name}: {workload} at {_rate(rate)} req/s (vllm bench serve)")
                        result = run_vllm_client(peer.python, url, model_dir.name, model_dir, named[workload], rate,
                                                 log_dir / f"{name}-{workload}-{_rate(rate)}.json", seed=args.seed + k)
                        rows.append(Row(name, workload, rate, "vllm bench serve", result))
                if workloads[0].startswith("random-") and not args.no_tandem_client:
                    _progress(f"{name}: {workloads[0]} at {_rate(rates[-1])} req/s (Tandem's client)")
                    rows.append(Row(name, workloads[0], rates[-1], "tandem", tandem_client_run(
                        url, workloads[0], num_prompts, rates[-1], vocab_size, args.seed)))
        except RuntimeError as exc:
            _progress(f"{name}: failed: {exc}")
            ready.setdefault(name, f"failed: {str(exc).splitlines()[0]}")
    print(report(rows, ready, args, model_dir.name, dtype, peer.version))
    _progress(f"logs: {log_dir}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({
            "model": model_dir.name, "dtype": dtype, "cpus": list(args.cpus), "cpu": cpu_name(),
            "cpu_flags": vector_flags(), "vllm": peer.version, "kv_cache_gib": KV_CACHE_GIB,
            "time_to_ready_s": ready, "rows": [row.__dict__ | {"rate": _rate(row.rate)} for row in rows]}, indent=2))
    return 0 if rows and all(r.result.get("completed") == r.result.get("num_prompts", r.result.get("completed"))
                             for r in rows) else 1


# The chat workload's text: any English works; a prompt is its first N tokens (repeated as needed).
_PASSAGE = ("The river town woke slowly that spring. Boats came up from the coast with salt, cloth and news, "
            "and the market filled before the bells had finished ringing. Children ran between the stalls while "
            "their parents argued over the price of flour, the weather, and whether the new bridge would ever be "
            "finished. In the evenings the old ferryman told stories about floods and fires, about merchants who "
            "lost everything in a single night and about the year the river froze so hard that a whole fair was "
            "held on the ice. ")


def chat_lengths_rows(tokenizer_dir: Path, n: int = 200, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` chat-shaped requests for vLLM's custom dataset: prompt and output lengths drawn log-normally
    (medians 250 and 150 tokens, long tails clipped at 2,000 and 600), as chat traces such as ShareGPT
    spread them. Written once to benchmarks/data/chat_lengths.jsonl (``write_chat_lengths``)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    ids = tokenizer.encode(_PASSAGE * 40, add_special_tokens=False).ids
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt_len = min(2000, max(8, round(rng.lognormvariate(math.log(250), 0.8))))
        output_len = min(600, max(4, round(rng.lognormvariate(math.log(150), 0.7))))
        # A distinct opening per prompt: chats share no prefix, so no prefix cache serves one from another.
        opening = f"Note {rng.randrange(10**9)}, page {rng.randrange(10**4)}. "
        rows.append({"prompt": opening + tokenizer.decode(ids[:prompt_len]), "output_tokens": output_len})
    return rows


def write_chat_lengths(tokenizer_dir: Path, path: Path = CHAT_LENGTHS) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in chat_lengths_rows(tokenizer_dir)))


def _rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def report(rows: Sequence[Row], ready: dict[str, float | str], args: argparse.Namespace, model: str, dtype: str,
           vllm_version: str) -> str:
    lines = [f"# Serving against vLLM's server ({model}, {dtype}, cores {','.join(map(str, args.cpus))})", "",
             f"Machine: {cpu_name()}; CPU flags: {' '.join(vector_flags())}. vLLM {vllm_version}. "
             f"KV cache {KV_CACHE_GIB} GiB per system.", "",
             "| system | time to ready (s) |", "|---|---:|"]
    lines += [f"| {name} | {v:.1f} |" if isinstance(v, float) else f"| {name} | {v} |" for name, v in ready.items()]
    for workload in dict.fromkeys(r.workload for r in rows):
        lines += ["", f"## {workload}", "",
                  "| system | client | rate | done | output tok/s | vs vLLM | TTFT p50 / p99 (ms) | "
                  "TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) | goodput (req/s) |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for row in (r for r in rows if r.workload == workload):
            peer = next((r for r in rows if r.system == "vllm" and r.workload == workload and r.rate == row.rate
                         and r.client == row.client), None)
            ratio = f"{row.get('output_throughput') / peer.get('output_throughput'):.2f}x" if (
                peer is not None and peer.get("output_throughput")) else "-"
            goodput = row.result.get("request_goodput")
            lines.append(
                f"| {row.system} | {row.client} | {_rate(row.rate)} | {row.result.get('completed')}"
                f"/{row.result.get('num_prompts', row.result.get('completed'))} | {row.get('output_throughput'):.1f} | "
                f"{ratio} | {row.get('p50_ttft_ms'):,.0f} / {row.get('p99_ttft_ms'):,.0f} | "
                f"{row.get('p50_tpot_ms'):,.0f} / {row.get('p99_tpot_ms'):,.0f} | "
                f"{row.get('p50_itl_ms'):,.0f} / {row.get('p99_itl_ms'):,.0f} | "
                f"{'-' if goodput is None else f'{float(goodput):.2f}'} |")
    return "\n".join(lines)


def _progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)

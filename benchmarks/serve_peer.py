"""Serving against a peer's own server, measured by vLLM's own client: ``tandem bench serve --peer vllm``
and ``--peer llamacpp-server``.

Every system runs on the same cores: the peer, ``colocated`` (one ``tandem serve colocated`` on every core),
``disaggregated`` and ``conditional`` (``tandem up``: one prefill and one decode node, each on its share of the
cores, and the gateway). Each is started while the others are idle, timed to its first healthy answer (its time
to ready) and warmed up with a short run of the first workload (vLLM compiles on its first requests too); then
``vllm bench serve`` (the module, from the vllm peer's venv) drives one system at a time over its OpenAI
``/v1/completions``, the systems back to back at each workload and rate (``schedule``), so the machine's drift
(15-30% within minutes on shared machines) falls on every system alike; ``--rounds N`` runs the whole schedule N
times, each round starting with the next system, and the report adds each system's ratios to the peer's
figures of the same round (their median and range). Tandem's own client (benchmarks/serve_client.py) drives
the same systems with the first workload's shape as a cross-check.

The peers (``COMPARISONS``):
- ``vllm``: vLLM's OpenAI server (benchmarks/peers/vllm_server.py) against every Tandem system, on the same
  model directory, precision and KV cache budget, requests arriving at each rate with no cap in flight;
- ``llamacpp-server``: llama.cpp's ``llama-server`` (benchmarks/peers/llamacpp_server.py) on the bundled
  Q4_1 GGUF (or ``--peer-gguf``) with 8 slots, against ``colocated`` with ``--quantization int4``, 8 requests
  in flight at a time (the client's ``--max-concurrency``: issue 32 compares output throughput there).

Workloads (``--peer-workloads``): ``random-384-128`` (the issue's shape), ``random-1024-64`` (prefill
heavy), ``random-128-256`` (decode heavy), ``chat`` (a chat-shaped length distribution shipped in
benchmarks/data/chat_lengths.jsonl), ``mixed`` (``tandem bench serve``'s mixed workload for vLLM's client: short
chats with long outputs and, about one request in five, a 1-1.5k-token prompt with a short output, shipped in
benchmarks/data/mixed_lengths.jsonl; its SLOs are the mixed workload's) and ``shared-prefix`` (a 512-token prefix
that every prompt shares).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.machine import cpu_name, vector_flags
from benchmarks.peers.llamacpp_server import LlamaServerConfig, llama_server
from benchmarks.peers.registry import PeerPython, bundled_gguf, find_peer, find_peer_program
from benchmarks.peers.vllm_server import ClientWorkload, VLLMServerConfig, run_vllm_client, vllm_server
from benchmarks.workloads import MixedWorkload

REPO = Path(__file__).resolve().parents[1]
CHAT_LENGTHS = Path(__file__).resolve().parent / "data" / "chat_lengths.jsonl"
MIXED_LENGTHS = Path(__file__).resolve().parent / "data" / "mixed_lengths.jsonl"
TANDEM_SYSTEMS = ("colocated", "disaggregated", "conditional")
WARM_UP_SEEDS = 100_000  # a warm-up's seed: args.seed + this + the system's index (past any schedule's slots)
KV_CACHE_GIB = 1  # each system's KV budget: Tandem's node default (--kv-cache-memory-gb 1)
# The chat workload's clips (chat_lengths_rows); its prompts open with a note of a few more tokens.
CHAT_MAX_PROMPT, CHAT_MAX_OUTPUT, CHAT_OPENING = 2000, 600, 24
# The mixed workload's shapes (its defaults: shorts 32-128 -> 64-128 tokens, longs 1024-1536 -> 8-16), drawn
# for 200 requests in its order of arrival; vLLM's client shuffles them (seeded) and sends num_prompts.
MIXED = MixedWorkload(num_requests=200)
# A prompt's tokens as a server counts them may exceed the client's count: a BOS token, and the client's
# random text re-tokenized by the server.
PROMPT_SLACK = 32


@dataclass(frozen=True)
class Comparison:
    """What ``--peer NAME`` compares: the peer's server and Tandem's systems, Tandem at the peer's precision,
    under the same load."""

    peer: str  # --peer, and the peer's system name in the results
    title: str  # the report's heading: "Serving against <title>"
    label: str  # the ratio column's: "vs <label>"
    systems: tuple[str, ...]  # the default --peer-systems, the peer first
    quantization: str  # Tandem's --quantization
    workloads: str  # the default --peer-workloads
    rates: tuple[float, ...]  # the default --rate (--quick: inf)
    max_concurrency: int | None  # requests in flight at most (the clients' cap; llama-server's slots); None: none
    client_args: tuple[str, ...] = ()  # more arguments of vLLM's client, for every system alike
    note: str = ""  # for the report: how to read the peer's figures


COMPARISONS = {c.peer: c for c in (
    Comparison("vllm", "vLLM's server", "vLLM", ("vllm", *TANDEM_SYSTEMS), "none", "random-384-128",
               (2.0, math.inf), None),
    # Issue 32: int4 weights beside llama.cpp's Q4_1 GGUF, 8 streams at a time, a prefill-heavy and a
    # decode-heavy shape.
    # llama-server (cpp-httplib) closes kept-alive connections that vLLM's client (aiohttp) reuses at once:
    # about 1 request in 8 failed with "Server disconnected" at 8 in flight. A connection per request avoids it.
    Comparison("llamacpp-server", "llama.cpp's server", "llama-server", ("llamacpp-server", "colocated"), "int4",
               "random-384-128,random-128-256", (math.inf,), 8, ("--header", "Connection=close"),
               "llama-server sends its usage in the stream's last text chunk, which vLLM's client does not read: "
               "the client counts llama-server's output tokens by re-tokenizing the text (a few % fewer than it "
               "generated: with ignore_eos every request runs to its max_tokens), so its output tok/s reads low."),
)}
PeerServer = Callable[[Path], contextlib.AbstractContextManager[tuple[str, float]]]  # log dir -> (URL, s to ready)


def client_workloads(num_prompts: int) -> dict[str, ClientWorkload]:
    """The named workloads, each with ``num_prompts`` requests and SLOs for its goodput."""
    random_args = ("--dataset-name", "random", "--random-range-ratio", "0")
    # Each row's output_tokens: vLLM's client replaces them with --custom-output-len (default 256) unless it is -1.
    custom_args = ("--skip-chat-template", "--custom-output-len", "-1", "--dataset-name", "custom", "--dataset-path")
    return {w.name: w for w in (
        ClientWorkload("random-384-128", (*random_args, "--random-input-len", "384", "--random-output-len", "128"),
                       num_prompts, ttft_slo_ms=5000, tpot_slo_ms=500, max_request_tokens=384 + 128),
        ClientWorkload("random-1024-64", (*random_args, "--random-input-len", "1024", "--random-output-len", "64"),
                       num_prompts, ttft_slo_ms=10000, tpot_slo_ms=500, max_request_tokens=1024 + 64),
        ClientWorkload("random-128-256", (*random_args, "--random-input-len", "128", "--random-output-len", "256"),
                       num_prompts, ttft_slo_ms=3000, tpot_slo_ms=300, max_request_tokens=128 + 256),
        ClientWorkload("chat", (*custom_args, str(CHAT_LENGTHS)), num_prompts, ttft_slo_ms=4000, tpot_slo_ms=300,
                       max_request_tokens=CHAT_OPENING + CHAT_MAX_PROMPT + CHAT_MAX_OUTPUT),
        ClientWorkload("mixed", (*custom_args, str(MIXED_LENGTHS)), num_prompts, ttft_slo_ms=4000, tpot_slo_ms=200,
                       max_request_tokens=CHAT_OPENING + MIXED.max_total_len),
        ClientWorkload("shared-prefix", (*random_args, "--random-prefix-len", "512", "--random-input-len", "64",
                                         "--random-output-len", "64"), num_prompts, ttft_slo_ms=3000,
                       tpot_slo_ms=300, max_request_tokens=512 + 64 + 64),
    )}


@dataclass(frozen=True)
class Row:
    """One system x workload x rate, as vLLM's client (or Tandem's) measured it."""

    system: str
    workload: str
    rate: float
    client: str  # "vllm bench serve" | "tandem"
    result: dict[str, Any]  # vLLM's result keys (Tandem's client's figures mapped onto them)
    round: int = 0  # which pass of --rounds

    def get(self, key: str) -> float:
        return float(self.result.get(key) or 0.0)


@dataclass(frozen=True)
class Peer:
    """The peer's server of one comparison, ready to start."""

    start: PeerServer
    version: str
    details: str  # what the report says after its version: what it runs with
    gguf: Path | None = None  # the file it runs, when it runs a GGUF


def peer_of(comparison: Comparison, client: PeerPython, model_dir: Path, dtype: str, cpus: tuple[int, ...],
            workloads: Sequence[ClientWorkload], gguf: Path | None) -> Peer:
    """The comparison's peer, as every Tandem system runs: on ``cpus``, vLLM on the model directory in
    ``dtype`` with the same KV budget, llama-server on ``gguf`` with a slot per request in flight, each slot
    holding the longest request of ``workloads``. Both are named as the model directory, so the client
    sends every system the same model name. Raises ``ValueError`` when it cannot run."""
    if comparison.peer == "vllm":
        # The longest workload fits in 4096 tokens; a model with fewer positions gets its own (vLLM refuses more).
        positions = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings", 4096)
        config = VLLMServerConfig(model_dir, model_dir.name, dtype, cpus, KV_CACHE_GIB,
                                  max_model_len=min(4096, int(positions)))
        return Peer(lambda log_dir: vllm_server(client.python, config, log_dir / "vllm.log"), client.version,
                    f"; KV cache {KV_CACHE_GIB} GiB per system")
    program, why = find_peer_program(comparison.peer, REPO)
    if program is None:
        raise ValueError(f"--peer {comparison.peer}: {why}")
    if gguf is None or not gguf.is_file():
        raise ValueError(f"--peer {comparison.peer}: llama-server runs a GGUF file: --peer-gguf FILE, or the "
                         f"bundled model (its GGUF by default){'' if gguf is None else f'; {gguf} is no file'}")
    assert comparison.max_concurrency is not None  # llama-server's slots
    server = LlamaServerConfig(gguf, model_dir.name, cpus, comparison.max_concurrency,
                               ctx_per_slot=max(w.max_request_tokens for w in workloads) + PROMPT_SLACK)
    return Peer(lambda log_dir: llama_server(program.path, server, log_dir / "llamacpp-server.log"), program.version,
                f" on {gguf.name}, {server.slots} slots, --ctx-size {server.ctx_size}; vLLM's client "
                f"{client.version}; Tandem's KV cache {KV_CACHE_GIB} GiB", gguf)


def system_variant(name: str) -> tuple[str, dict[str, str]]:
    """``--peer-systems``' entry ``NAME`` or ``NAME/TANDEM_X=V/TANDEM_Y=W``: the system and the ``TANDEM_*``
    settings its processes get (a variant, run beside the plain system in the same schedule: an A/B under the
    same drift). Raises ``ValueError`` on a setting that is not ``TANDEM_*=VALUE``."""
    system, *assignments = name.split("/")
    env = {}
    for a in assignments:
        key, sep, value = a.partition("=")
        if not sep or not key.startswith("TANDEM_"):
            raise ValueError(f"--peer-systems: {name!r}: a system's settings are TANDEM_NAME=VALUE, got {a!r}")
        env[key] = value
    return system, env


def _file_stem(system: str) -> str:
    """A ``--peer-systems`` entry (a variant's settings included) as a file or directory name."""
    return system.replace("/", "-")


@contextlib.contextmanager
def tandem_server(name: str, model_dir: Path, dtype: str, quantization: str, cpus: tuple[int, ...],
                  log_dir: Path) -> Iterator[tuple[str, float]]:
    """Start Tandem's system ``name`` (``system_variant``); yield (the base URL of its OpenAI API, seconds to
    ready)."""
    from tandem_cli.launcher import ColocatedTopology, Launcher, Topology

    variant = name
    name, env = system_variant(variant)

    model_args = ("--model", str(model_dir), "--dtype", dtype, "--quantization", quantization)
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
    with Launcher(topology, log_dir=log_dir / _file_stem(variant), env=env) as launcher:
        front = next(s for s in launcher.specs if s.role in ("gateway", "colocated"))
        yield f"http://127.0.0.1:{front.http_port}", time.monotonic() - start


def tandem_client_run(base_url: str, workload: str, num_prompts: int, rate: float, vocab_size: int,
                      seed: int, max_concurrency: int | None = None) -> dict[str, Any]:
    """Tandem's client (token-id prompts over the same /v1/completions, the server's default temperature)
    with a random-IN-OUT workload's shape, at most ``max_concurrency`` in flight (None: open loop at
    ``rate``), its figures under vLLM's result keys."""
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
    records, duration = asyncio.run(drive([base_url], requests, max_concurrency, 3600.0, api=Api.OPENAI,
                                          temperature=None))
    s = summarize("tandem-client", "", records, duration, None)

    def ms(d: Distribution | None, q: str) -> float:
        return 1000 * float(getattr(d, q)) if d is not None else 0.0

    return {"completed": s.completed, "num_prompts": num_prompts, "duration": duration,
            "output_throughput": s.output_throughput, "request_throughput": s.request_throughput,
            **{f"{q}_{name}_ms": ms(getattr(s, f"{name}_s"), q) for name in ("ttft", "tpot", "itl")
               for q in ("p50", "p99")}}


def run(args: argparse.Namespace, model_dir: Path, dtype: str, vocab_size: int, bundled_model: bool = False) -> int:
    """``tandem bench serve --peer NAME``: every system, workload and rate; a Markdown report on stdout.
    ``bundled_model``: ``model_dir`` is the bundled GGUF converted, which llama-server then runs (without
    ``--peer-gguf``)."""
    comparison = COMPARISONS[args.peer]
    client, why = find_peer("vllm", REPO)  # vLLM's client drives every system
    if client is None:
        raise ValueError(f"--peer {comparison.peer}: {why}"
                         + ("" if comparison.peer == "vllm" else " (vLLM's benchmark client drives every system)"))
    choices = (comparison.peer, *TANDEM_SYSTEMS)
    systems = [s.strip() for s in (args.peer_systems or ",".join(comparison.systems)).split(",") if s.strip()]
    if not systems or {system_variant(s)[0] for s in systems} - set(choices) or len(set(systems)) < len(systems):
        raise ValueError(f"--peer-systems: choose from {', '.join(choices)} (a Tandem system may take TANDEM_* "
                         f"settings: colocated/TANDEM_X=1), each once, got {args.peer_systems!r}")
    num_prompts = args.num_requests or (8 if args.quick else 48)
    named = client_workloads(num_prompts)
    given = args.peer_workloads or comparison.workloads
    workloads = [w.strip() for w in given.split(",") if w.strip()]
    if not workloads or set(workloads) - set(named):
        raise ValueError(f"--peer-workloads: choose from {', '.join(named)}, got {given!r}")
    gguf = Path(args.peer_gguf) if args.peer_gguf else bundled_gguf() if bundled_model else None
    peer = peer_of(comparison, client, model_dir, dtype, args.cpus, [named[w] for w in workloads], gguf)
    rates: Sequence[float] = args.rate or ((math.inf,) if args.quick else comparison.rates)
    concurrency = comparison.max_concurrency
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="tandem-bench-peer-"))
    rounds = getattr(args, "rounds", 1) or 1
    rows: list[Row] = []
    ready: dict[str, float | str] = {}
    client_run = functools.partial(run_vllm_client, client.python, max_concurrency=concurrency,
                                   extra=comparison.client_args)
    # Slot i of the schedule (its workload, rate and round) takes seed args.seed + i for every system: the same
    # requests for each, and no two runs of one server alike (vLLM's random dataset gives request i of two runs
    # with one seed the same first tokens, which a prefix cache would serve from the run before). The warm-up
    # runs take seeds past the schedule's (vLLM's client wants them in [0, 2**32)).
    urls: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        for i, name in enumerate(systems):
            _progress(f"{name}: starting")
            server = peer.start(log_dir) if name == comparison.peer else tandem_server(
                name, model_dir, dtype, comparison.quantization, args.cpus, log_dir)
            try:
                url, seconds = stack.enter_context(server)
                ready[name] = seconds
                _progress(f"{name}: ready in {seconds:.1f} s at {url}; warming up")
                warm = dataclasses.replace(named[workloads[0]], name="warm-up", num_prompts=max(4, num_prompts // 4),
                                           ttft_slo_ms=1e9, tpot_slo_ms=1e9)
                client_run(url, model_dir.name, model_dir, warm, math.inf,
                           log_dir / f"{_file_stem(name)}-warm-up.json", seed=args.seed + WARM_UP_SEEDS + i)
                urls[name] = url
            except RuntimeError as exc:
                _progress(f"{name}: failed: {exc}")
                ready.setdefault(name, f"failed: {str(exc).splitlines()[0]}")
        slots = schedule(list(urls), workloads, list(rates), rounds)
        for seed, (r, workload, rate, order) in enumerate(slots, start=args.seed):
            for name in order:
                if name not in urls:
                    continue  # failed in an earlier slot
                _progress(f"{name}: {workload} at {_rate(rate)} req/s (vllm bench serve"
                          f"{f', round {r + 1} of {rounds}' if rounds > 1 else ''})")
                try:
                    result = client_run(urls[name], model_dir.name, model_dir, named[workload], rate,
                                        log_dir / f"{_file_stem(name)}-{workload}-{_rate(rate)}-r{r}.json", seed=seed)
                except RuntimeError as exc:
                    _progress(f"{name}: failed: {exc}")
                    ready[name] = f"failed: {str(exc).splitlines()[0]}"
                    del urls[name]
                    continue
                rows.append(Row(name, workload, rate, "vllm bench serve", result, r))
        if workloads[0].startswith("random-") and not args.no_tandem_client:
            for name, url in urls.items():
                _progress(f"{name}: {workloads[0]} at {_rate(rates[-1])} req/s (Tandem's client)")
                rows.append(Row(name, workloads[0], rates[-1], "tandem", tandem_client_run(
                    url, workloads[0], num_prompts, rates[-1], vocab_size, args.seed, concurrency)))
    print(report(rows, ready, args, model_dir.name, dtype, peer.version, comparison, peer.details))
    _progress(f"logs: {log_dir}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({
            "model": model_dir.name, "dtype": dtype, "cpus": list(args.cpus), "cpu": cpu_name(),
            "cpu_flags": vector_flags(), "peer": comparison.peer, "peer_version": peer.version,
            "vllm": client.version, "quantization": comparison.quantization, "max_concurrency": concurrency,
            "gguf": None if peer.gguf is None else str(peer.gguf), "kv_cache_gib": KV_CACHE_GIB,
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
    spread them. Written once to benchmarks/data/chat_lengths.jsonl (``write_peer_datasets``)."""
    rng = random.Random(seed)
    shapes = []
    for _ in range(n):
        prompt_len = min(CHAT_MAX_PROMPT, max(8, round(rng.lognormvariate(math.log(250), 0.8))))
        output_len = min(CHAT_MAX_OUTPUT, max(4, round(rng.lognormvariate(math.log(150), 0.7))))
        shapes.append((_opening(rng), prompt_len, output_len))
    return _text_rows(tokenizer_dir, shapes)


def mixed_lengths_rows(tokenizer_dir: Path, workload: MixedWorkload = MIXED) -> list[dict[str, Any]]:
    """``workload``'s requests (lengths and kinds, in order of arrival) as rows of vLLM's custom dataset.
    Written once to benchmarks/data/mixed_lengths.jsonl (``write_peer_datasets``)."""
    rng = random.Random(workload.seed)
    return _text_rows(tokenizer_dir, [(_opening(rng), len(r.prompt_token_ids), r.output_len)
                                      for r in workload.requests(vocab_size=2, rate=1.0)])


def _opening(rng: random.Random) -> str:
    # A distinct opening per prompt: the prompts share no prefix, so no prefix cache serves one from another.
    return f"Note {rng.randrange(10**9)}, page {rng.randrange(10**4)}. "


def _text_rows(tokenizer_dir: Path, shapes: Sequence[tuple[str, int, int]]) -> list[dict[str, Any]]:
    """A row per (opening, prompt tokens, output tokens): the opening, the passage's first tokens, and the
    output length."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    ids = tokenizer.encode(_PASSAGE * 40, add_special_tokens=False).ids
    assert len(ids) >= max(n for _, n, _ in shapes), "the passage repeated is shorter than a prompt"
    return [{"prompt": opening + tokenizer.decode(ids[:prompt_len]), "output_tokens": output_len}
            for opening, prompt_len, output_len in shapes]


def write_peer_datasets(tokenizer_dir: Path) -> None:
    """(Re)write the shipped datasets of vLLM's client: chat_lengths.jsonl and mixed_lengths.jsonl."""
    for path, rows in ((CHAT_LENGTHS, chat_lengths_rows(tokenizer_dir)), (MIXED_LENGTHS,
                                                                           mixed_lengths_rows(tokenizer_dir))):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def schedule(systems: Sequence[str], workloads: Sequence[str], rates: Sequence[float], rounds: int = 1,
             ) -> list[tuple[int, str, float, list[str]]]:
    """The order of the client's runs: (round, workload, rate, the systems in the order they run), round by
    round, each workload's rates in order. At each workload and rate every system runs back to back, so what the
    machine does meanwhile falls on all of them alike; round r starts with system r (mod their number), so none
    always runs first or right after another."""
    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    out = []
    for r in range(rounds):
        k = r % len(systems) if systems else 0
        order = [*systems[k:], *systems[:k]]
        out += [(r, w, rate, order) for w in workloads for rate in rates]
    return out


def _rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def report(rows: Sequence[Row], ready: dict[str, float | str], args: argparse.Namespace, model: str, dtype: str,
           peer_version: str, comparison: Comparison = COMPARISONS["vllm"], details: str = "") -> str:
    """The Markdown report; ``details``: what else to say after the peer's version."""
    weights = "" if comparison.quantization == "none" else f", Tandem --quantization {comparison.quantization}"
    load = ("" if comparison.max_concurrency is None else
            f" At most {comparison.max_concurrency} requests in flight (every client).")
    lines = [f"# Serving against {comparison.title} ({model}, {dtype}{weights}, cores "
             f"{','.join(map(str, args.cpus))})", "",
             f"Machine: {cpu_name()}; CPU flags: {' '.join(vector_flags())}. {comparison.label} {peer_version}"
             f"{details}.{load}", *(("", comparison.note) if comparison.note else ()), "",
             "| system | time to ready (s) |", "|---|---:|"]
    lines += [f"| {name} | {v:.1f} |" if isinstance(v, float) else f"| {name} | {v} |" for name, v in ready.items()]
    rounds = max((r.round for r in rows), default=0) + 1
    if rounds > 1:
        lines += ["", f"Each system ran {rounds} times at each workload and rate, back to back with the others; "
                  f"a ratio is to {comparison.label}'s run of the same round."]
    for workload in dict.fromkeys(r.workload for r in rows):
        lines += ["", f"## {workload}", "",
                  f"| system | client | rate |{' round |' if rounds > 1 else ''} done | output tok/s | "
                  f"vs {comparison.label} | TTFT p50 / p99 (ms) | "
                  "TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) | goodput (req/s) | output tokens |",
                  f"|---|---|---:|{'---:|' if rounds > 1 else ''}---:|---:|---:|---:|---:|---:|---:|---:|"]
        for row in sorted((r for r in rows if r.workload == workload),
                          key=lambda r: (r.client != "vllm bench serve", r.system, r.rate, r.round)):
            peer = _peer_row(rows, row, comparison.peer)
            ratio = f"{row.get('output_throughput') / peer.get('output_throughput'):.2f}x" if (
                peer is not None and peer.get("output_throughput")) else "-"
            goodput = row.result.get("request_goodput")
            lines.append(
                f"| {row.system} | {row.client} | {_rate(row.rate)} |{f' {row.round + 1} |' if rounds > 1 else ''}"
                f" {row.result.get('completed')}"
                f"/{row.result.get('num_prompts', row.result.get('completed'))} | {row.get('output_throughput'):.1f} | "
                f"{ratio} | {row.get('p50_ttft_ms'):,.0f} / {row.get('p99_ttft_ms'):,.0f} | "
                f"{row.get('p50_tpot_ms'):,.0f} / {row.get('p99_tpot_ms'):,.0f} | "
                f"{row.get('p50_itl_ms'):,.0f} / {row.get('p99_itl_ms'):,.0f} | "
                f"{'-' if goodput is None else f'{float(goodput):.2f}'} | "
                f"{row.result.get('total_output_tokens', '-')} |")
        if rounds > 1:
            lines += _paired(rows, workload, comparison)
    return "\n".join(lines)


def _peer_row(rows: Sequence[Row], row: Row, peer: str) -> Row | None:
    """The peer's run beside ``row``: same workload, rate, client and round."""
    return next((r for r in rows if r.system == peer and r.workload == row.workload and r.rate == row.rate
                 and r.client == row.client and r.round == row.round), None)


# The paired summary's columns: (heading, vLLM's result key); a ratio above 1 is more of it than the peer's.
_PAIRED = (("output tok/s", "output_throughput"), ("TTFT p50", "p50_ttft_ms"), ("TTFT p99", "p99_ttft_ms"),
           ("TPOT p50", "p50_tpot_ms"), ("TPOT p99", "p99_tpot_ms"), ("goodput", "request_goodput"))


def _paired(rows: Sequence[Row], workload: str, comparison: Comparison) -> list[str]:
    """Each system's figures over the peer's of the same round, per rate: the median ratio [lowest-highest]."""
    lines = ["", f"Over {comparison.label}'s figures of the same round (median [lowest-highest] of the rounds; "
             "output and goodput: higher is better, TTFT and TPOT: lower is better):", "",
             f"| system | rate | {' | '.join(h for h, _ in _PAIRED)} |", "|---|---:|" + "---:|" * len(_PAIRED)]
    mine = [r for r in rows
            if r.workload == workload and r.client == "vllm bench serve" and r.system != comparison.peer]
    for system, rate in dict.fromkeys((r.system, r.rate) for r in mine):
        cells = []
        for _, key in _PAIRED:
            ratios = sorted(r.get(key) / p.get(key) for r in mine if r.system == system and r.rate == rate
                            for p in [_peer_row(rows, r, comparison.peer)] if p is not None and p.get(key))
            cells.append("-" if not ratios else
                         f"{statistics.median(ratios):.2f}x [{ratios[0]:.2f}-{ratios[-1]:.2f}]")
        lines.append(f"| {system} | {_rate(rate)} | {' | '.join(cells)} |")
    return lines


def _progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)

"""Serving benchmark: the disaggregated system and the colocated engine under the same load, over gRPC.

    tandem bench serve [--quick] [--workload W] [--num-requests N] [--rate R | --concurrency C] [--model M]
                       [--systems S,...] [--api grpc,openai] [--goodput ttft:MS,tpot:MS]
                       [--local-prefill-max-tokens N]
    python -m benchmarks.bench_serve ...          (the same)

The systems run as real processes on this machine, one after the other, each service pinned to its own
CPU cores with one torch thread per core (the launcher's placement, as `tandem up` does it):
- disaggregated: the gateway (not pinned: it runs no model), P prefill nodes and D decode nodes;
- conditional: the same, with the gateway's ``--local-prefill-max-tokens N`` (``--local-prefill-max-tokens``
  here, default 256): prompts up to N tokens are prefilled by the decode node itself;
- colocated: P + D replicas of `tandem serve colocated` (the same public API over one engine that
  prefills and decodes, chunked prefill mixed into decode steps), so both systems get the same cores;
- disaggregated-nocache, colocated-nocache: the same with prefix caching off, to see what it saves.
This process is the client (benchmarks/serve_client.py): it sends the same seeded workload
(benchmarks/workloads.py: serving, shared-prefix or mixed) to each system, spreading requests over the
colocated replicas (fewest outstanding requests first). A system that fails to start (or to serve its
warm-up) is reported as failed to start, every request counted as failed, and the others still run.

Fronts (``--api``): the client speaks the gateway's gRPC API (``grpc``, the default) or its OpenAI HTTP API
(``openai``: streaming ``/v1/completions`` of the same token ids, read as server-sent events, as
``vllm bench serve`` does); with ``--api grpc,openai`` each system is started once and sent the workload
over each front in turn, one result column per system and front ("disaggregated/openai").

Load: Poisson arrivals at --rate requests/s (open loop: a system slower than the load builds a queue,
as in production), or --concurrency C requests in flight at all times (closed loop). Per request, on the
client's clock: TTFT (sent -> first token), TPOT ((last token - first token) / (tokens - 1)), ITL (gap
between consecutive streamed messages; a message carries several tokens when the client read slower than
the server produced), end-to-end latency; per kind of request too when a workload has several. Throughput:
over the run, first send to last token. Each system first serves a few warm-up requests, not measured.

Goodput (DistServe): requests/s that meet both latency SLOs, TTFT <= the TTFT SLO and TPOT <= the TPOT
SLO, over the run's duration; SLO attainment: the share of all requests (failed ones miss) meeting both,
and each alone (benchmarks/slo.py). ``--rate 1,2.5,4`` sweeps the load (each system started once runs every
rate in turn, a column per system and rate) and adds DistServe's per-system figure: the highest rate whose
attainment is >= 90%. At a light load every system meets its SLOs and the per-run goodput is the arrival
rate for all of them; the sweep shows which one keeps meeting them as the load grows.
``--goodput ttft:MS,tpot:MS`` sets the SLOs; without it each workload has its own (benchmarks/workloads.py):
serving ttft:2500,tpot:200; shared-prefix ttft:1500,tpot:200; mixed ttft:4000,tpot:200.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.machine import cpu_name
from benchmarks.serve_client import Api, RequestRecord, drive
from benchmarks.serve_stats import (
    CAPACITY_ATTAINMENT,
    Summary,
    capacities,
    capacity_table,
    kind_table,
    markdown_table,
    not_started,
    summarize,
    system_json,
)
from benchmarks.slo import SLO, parse_slo
from benchmarks.workloads import (
    LOWEST_ORDINARY_ID,
    WORKLOADS,
    MultiTurnWorkload,
    ServingWorkload,
    TimedRequest,
    Workload,
)
from gateway.prefill_policy import DEFAULT_LOCAL_PREFILL_MAX_TOKENS


@dataclass(frozen=True)
class System:
    """One of the systems under test: how its services are laid out, and whether they cache prefixes."""

    name: str
    disaggregated: bool
    prefix_caching: bool = True
    # The gateway prefills short prompts on the decode node (conditional disaggregation, --local-prefill-max-tokens).
    local_prefill: bool = False
    # The KV offload tier under each node's pool (a "+cpu" / "+disk" suffix on the system's name in --systems).
    kv_offload: str = "none"

    @property
    def node_args(self) -> tuple[str, ...]:
        # Explicit both ways: a TANDEM_ENABLE_PREFIX_CACHING or TANDEM_KV_OFFLOAD in the caller's environment
        # cannot relabel a system.
        caching = ("--enable-prefix-caching",) if self.prefix_caching else ("--no-enable-prefix-caching",)
        return (*caching, "--kv-offload", self.kv_offload)

    def gateway_args(self, local_prefill_max_tokens: int) -> tuple[str, ...]:
        # Explicit both ways too: the gateway's default is conditional (DEFAULT_LOCAL_PREFILL_MAX_TOKENS).
        return ("--local-prefill-max-tokens", str(local_prefill_max_tokens if self.local_prefill else 0))


SYSTEMS: Mapping[str, System] = {s.name: s for s in (
    System("disaggregated", disaggregated=True), System("colocated", disaggregated=False),
    System("conditional", disaggregated=True, local_prefill=True),
    System("disaggregated-nocache", disaggregated=True, prefix_caching=False),
    System("colocated-nocache", disaggregated=False, prefix_caching=False),
)}
DEFAULT_SYSTEMS = ("disaggregated", "colocated")
TIER_SUFFIXES = ("cpu", "disk", "shared")  # --systems NAME+cpu: the system with that offload tier under every node's
# pool; +shared: one directory of block files (a fresh temporary one per run) that all the system's nodes share
STATS_POLL_S = 1.5  # a gateway polls its nodes' Stats every second (gateway/settings.py stats_interval_s)
DEFAULT_BLOCK_SIZE = 16  # the nodes' --block-size default (common/config/engine_config.py)


def system_named(name: str) -> System:
    """``NAME`` or ``NAME+TIER`` (a system of SYSTEMS with the KV offload tier TIER under each node's pool)."""
    base, sep, tier = name.partition("+")
    if base not in SYSTEMS or (sep and tier not in TIER_SUFFIXES):
        raise ValueError(f"--systems: choose from {', '.join(SYSTEMS)}, each optionally +cpu, +disk or +shared (an "
                         f"offload tier), got {name!r}")
    if sep and not SYSTEMS[base].prefix_caching:
        raise ValueError(f"--systems: {name!r}: an offload tier is indexed by the prefix cache, which {base} turns off")
    return dataclasses.replace(SYSTEMS[base], name=name, kv_offload=tier or "none")
DEFAULT_RATE = 1.0  # requests/s: near what one decode core sustains with SmolLM2 (README: the measured table)
SERVING = ServingWorkload()  # the defaults the help text names for the per-length flags


# ---- the systems ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def deployment(system: System, model_args: tuple[str, ...], num_prefill: int, num_decode: int,
               cpus: tuple[int, ...], log_dir: Path, local_prefill_max_tokens: int = DEFAULT_LOCAL_PREFILL_MAX_TOKENS,
               pool_args: tuple[str, ...] = (), role_pool_args: Mapping[str, tuple[str, ...]] | None = None,
               cpu_lending: bool = True) -> Iterator[tuple[dict[Api, list[str]], str]]:
    """Start ``system``; yield the client's targets per front and a description of where each service runs.
    ``pool_args``: node flags sizing every node's KV (``--num-blocks``, ``--kv-offload-gb``); ``role_pool_args``:
    per role (prefill, decode) of a disaggregated system, flags after them (so they override); ``cpu_lending``:
    a disaggregated system's prefill node runs on its decode node's cores too while that one is idle, as
    ``tandem up`` does."""
    from tandem_cli.launcher import ColocatedTopology, Launcher, Topology

    topology: Topology | ColocatedTopology
    node_args = (*system.node_args, *pool_args)
    shared = None
    if system.kv_offload == "shared":  # one directory for every node of this system, gone with the run
        shared = tempfile.TemporaryDirectory(prefix="tandem-kv-shared-")
        node_args += ("--kv-offload-dir", shared.name)
    if system.disaggregated:
        roles = role_pool_args or {}
        topology = Topology(num_prefill=num_prefill, num_decode=num_decode, free_ports=True,
                            model_args=model_args, node_args=node_args, prefill_args=roles.get("prefill", ()),
                            decode_args=roles.get("decode", ()),
                            gateway_args=system.gateway_args(local_prefill_max_tokens), cpus=cpus,
                            cpu_lending=cpu_lending)
    else:
        topology = ColocatedTopology(replicas=num_prefill + num_decode, free_ports=True, model_args=model_args,
                                     node_args=node_args, cpus=cpus, serve_http=True)
    launcher = Launcher(topology, log_dir=log_dir / system.name)
    with contextlib.ExitStack() as stack:
        if shared is not None:
            stack.enter_context(shared)  # removed after the launcher (entered next) has stopped the nodes
        stack.enter_context(launcher)
        placement = ", ".join(
            (f"{s.name} [cpu {','.join(map(str, s.cpus))}"
             + (f", borrows {','.join(map(str, s.borrow_cpus))} while idle]" if s.borrow_cpus else "]"))
            if s.cpus else f"{s.name} [unpinned]" for s in launcher.specs)
        fronts = [s for s in launcher.specs if s.role in ("gateway", "colocated")]
        yield {Api.GRPC: [s.target for s in fronts],
               Api.OPENAI: [f"http://127.0.0.1:{s.http_port}" for s in fronts if s.http_port]}, placement


def bench_system(system: System, args: argparse.Namespace, workload: Workload, vocab_size: int,
                 model_args: tuple[str, ...], log_dir: Path, slo: SLO | None = None,
                 apis: Sequence[Api] = (Api.GRPC,)) -> list[tuple[Summary, list[RequestRecord]]]:
    """Start ``system``, warm it up, send it ``workload`` over each front of ``apis`` in turn (one result
    each); a system that fails to start or to serve its warm-up gets ``not_started`` summaries (no records)
    instead of an exception."""
    # A closed loop ignores the arrival times but keeps their order (the same at every rate).
    rates: tuple[float, ...] = (math.inf,) if args.concurrency else rates_of(args)
    legs = [(api, rate) for api in apis for rate in rates]
    names = {(api, rate): column_name(system.name, api, rate, len(apis) > 1 or api is not Api.GRPC, len(rates) > 1)
             for api, rate in legs}
    num_requests = workload.num_requests
    started = time.perf_counter()
    measuring = False
    runs: list[tuple[tuple[Api, float], list[RequestRecord], float, dict[str, int]]] = []
    try:
        with deployment(system, model_args, args.prefill_nodes, args.decode_nodes, args.cpus, log_dir,
                        args.local_prefill_max_tokens, pool_args(args), role_pool_args(args),
                        cpu_lending=args.cpu_lending) as (targets, placement):
            _progress(f"{system.name}: up in {time.perf_counter() - started:.1f} s ({placement}); warming up")
            for api in apis:
                warm = ServingWorkload(num_requests=2 * len(targets[api]), prompt_len=(48, 256), output_len=(4, 8),
                                       seed=workload.seed + 1)
                warm_records, _ = asyncio.run(drive(targets[api], warm.requests(vocab_size, math.inf), None,
                                                    api=api))
                if failed := [r.error for r in warm_records if not r.ok]:
                    raise RuntimeError(f"warm-up requests over {api.value} failed: {failed[0]}")
            for k, (api, rate) in enumerate(legs):
                requests = workload.requests(vocab_size, rate)
                _progress(f"{names[api, rate]}: sending {len(requests)} requests")
                measuring = True
                before = cache_counters(targets[Api.GRPC])
                records, duration = asyncio.run(drive(targets[api], shifted(requests, k, vocab_size),
                                                      args.concurrency, args.timeout, api=api))
                time.sleep(STATS_POLL_S)  # a gateway reports its nodes' counters as its last Stats poll saw them
                after = cache_counters(targets[Api.GRPC])
                runs.append(((api, rate), records, duration, {k: after[k] - before[k] for k in after}))
    except (RuntimeError, TimeoutError, OSError) as exc:
        if measuring:
            raise
        _progress(f"{system.name}: failed to start: {exc}")
        return [(dataclasses.replace(not_started(names[leg], num_requests, f"failed to start: {exc}", slo),
                                     rate=_finite(leg[1])), []) for leg in legs]
    results = []
    for leg, records, duration, cache in runs:
        summary = dataclasses.replace(summarize(names[leg], placement, records, duration, slo), rate=_finite(leg[1]),
                                      cache=cache)
        _progress(f"{names[leg]}: {summary.completed}/{len(records)} done in {duration:.1f} s, "
                  f"{summary.output_throughput:.1f} output tokens/s")
        results.append((summary, records))
    return results


def cache_counters(fronts: Sequence[str]) -> dict[str, int]:
    """Prompt tokens every node behind ``fronts`` looked up in its prefix cache, found there (pool or offload tier)
    and restored from its offload tier, since it started (GetLoads: a gateway's nodes, or a colocated server)."""
    import grpc

    from tandem.v1 import generate_pb2, generate_pb2_grpc

    nodes: dict[str, tuple[int, int, int]] = {}
    for front in fronts:
        with grpc.insecure_channel(front) as channel:
            loads = generate_pb2_grpc.TandemStub(channel).GetLoads(generate_pb2.GetLoadsRequest(), timeout=10)
        for n in loads.nodes:
            nodes[n.node_id or n.target] = (n.prefix_cache_queries, n.prefix_cache_hits, n.offload_hits)
    return {key: sum(v[i] for v in nodes.values()) for i, key in enumerate(("queries", "hits", "offload_hits"))}


def _finite(rate: float) -> float | None:
    return None if math.isinf(rate) else rate


def column_name(system: str, api: Api, rate: float, by_api: bool, by_rate: bool) -> str:
    """A result column: the system, "/front" when several fronts (or only OpenAI's), " @ R/s" when several rates."""
    name = f"{system}/{api.value}" if by_api else system
    return f"{name} @ {rate:g}/s" if by_rate else name


def rates_of(args: argparse.Namespace) -> tuple[float, ...]:
    """The arrival rates to run, in order (``--rate`` takes a list; tests and callers may set one float)."""
    rate = args.rate if args.rate is not None else DEFAULT_RATE
    return tuple(rate) if isinstance(rate, (tuple, list)) else (float(rate),)


def parse_rates(text: str) -> tuple[float, ...]:
    """``--rate``: one arrival rate or a comma-separated increasing list (requests/s, inf = all at once)."""
    try:
        rates = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected requests/s such as 1 or 1,2.5,4, got {text!r}") from None
    if not rates or any(not r > 0 for r in rates) or list(rates) != sorted(set(rates)):
        raise argparse.ArgumentTypeError(f"expected rates > 0 in increasing order, each once, got {text!r}")
    return rates


def shifted(requests: Sequence[TimedRequest], k: int, vocab_size: int) -> list[TimedRequest]:
    """The ``k``-th front's copy of the workload: every token id moved by the same offset, so lengths, arrival
    times and which prompts share prefixes are unchanged, but nothing is in the prefix cache from the fronts
    measured before it (the same prompts again would all hit it)."""
    low = min(LOWEST_ORDINARY_ID, vocab_size // 2)  # ids stay in the workloads' range (no special tokens)
    span, offset = vocab_size - low, 7919 * k
    return [dataclasses.replace(r, prompt_token_ids=tuple(low + (t - low + offset) % span for t in r.prompt_token_ids))
            for r in requests]


def parse_apis(text: str) -> tuple[Api, ...]:
    """``--api``: a comma-separated list of fronts, each once, in the order given."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    known = {api.value: api for api in Api}
    if not names or any(name not in known for name in names) or len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(f"expected a list of {', '.join(known)} (each once), got {text!r}")
    return tuple(known[name] for name in names)


# ---- command line --------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="local Hugging Face directory or the bundled model's name [TANDEM_MODEL]")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help="[TANDEM_DTYPE, auto = the faster dtype here, measured once and cached]")
    p.add_argument("--workload", choices=list(WORKLOADS), default="serving",
                   help="serving: independent chats; shared-prefix: one system prompt before short questions; "
                   "mixed: long prompts arriving while short chats decode [serving]")
    p.add_argument("--num-requests", type=int, help="requests per system [" + ", ".join(
        f"{name} {w.full.num_requests}" for name, w in WORKLOADS.items()) + "; --quick " + ", ".join(
        str(w.quick.num_requests) for w in WORKLOADS.values()) + "]")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=parse_rates, help="Poisson arrivals, requests/s (mixed: the short requests'; "
                      "the long ones come at a fraction of it); inf = all at once; a list (1,2.5,4) sweeps: each "
                      "system started once runs every rate in turn, and the report gives each system's highest "
                      f"rate with >= {CAPACITY_ATTAINMENT:.0%}% SLO attainment (DistServe's goodput) [{DEFAULT_RATE}]")
    load.add_argument("--concurrency", type=int, help="closed loop: keep this many requests in flight instead")
    p.add_argument("--prompt-len", type=_length_range, help="serving: prompt lengths LOW:HIGH, log-uniform "
                   f"[{_show(SERVING.prompt_len)}, shorter with --quick]")
    p.add_argument("--output-len", type=_length_range, help="serving, shared-prefix: output lengths LOW:HIGH, "
                   f"log-uniform [serving {_show(SERVING.output_len)}]")
    turns = MultiTurnWorkload()
    p.add_argument("--conversations", dest="num_conversations", type=int,
                   help=f"multi-turn: conversations [{turns.num_conversations}]")
    p.add_argument("--turns", type=int, help=f"multi-turn: turns per conversation [{turns.turns}]")
    p.add_argument("--think-s", type=float, help=f"multi-turn: mean think time between turns, s [{turns.think_s:g}]")
    p.add_argument("--message-len", type=_length_range,
                   help=f"multi-turn: user message lengths LOW:HIGH [{_show(turns.message_len)}]")
    p.add_argument("--system-len", type=int, help=f"multi-turn: the shared system prompt's tokens [{turns.system_len}]")
    p.add_argument("--num-blocks", type=int, help="KV blocks of every node's pool [the nodes' default]")
    p.add_argument("--prefill-num-blocks", type=int, help="a disaggregated system's prefill nodes' pool, in place of "
                   "--num-blocks (the same KV memory split otherwise between the roles) [--num-blocks]")
    p.add_argument("--decode-num-blocks", type=int, help="a disaggregated system's decode nodes' pool, in place of "
                   "--num-blocks [--num-blocks]")
    p.add_argument("--kv-offload-gb", type=float, help="GiB of the offload tier of a NAME+cpu / NAME+disk system "
                   "[the nodes' default]")
    p.add_argument("--seed", type=int, default=0, help="workload seed [0]")
    p.add_argument("--quick", action="store_true", help="a smaller, shorter workload (about a minute)")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"comma-separated subset of {', '.join(SYSTEMS)}, each optionally NAME+cpu or NAME+disk (with "
                   f"that KV offload tier under every node's pool) [{','.join(DEFAULT_SYSTEMS)}]")
    p.add_argument("--api", type=parse_apis, default=(Api.GRPC,), metavar="grpc,openai",
                   help="the fronts the client drives: grpc (the Tandem API), openai (streaming /v1/completions over "
                   "HTTP); a list runs each system once and measures it over every front in turn [grpc]")
    p.add_argument("--goodput", type=parse_slo, metavar="ttft:MS,tpot:MS",
                   help="the latency SLOs goodput and SLO attainment are judged by [per workload: " + "; ".join(
                       f"{name} {preset.slo.flag}" for name, preset in WORKLOADS.items()) + "]")
    p.add_argument("--cpu-lending", action=argparse.BooleanOptionalAction, default=True,
                   help="a disaggregated system's prefill node runs its layers on its decode node's cores too while "
                        "that node is idle, as tandem up does (default: on)")
    p.add_argument("--local-prefill-max-tokens", type=int, default=DEFAULT_LOCAL_PREFILL_MAX_TOKENS,
                   help="the conditional system's gateway prefills prompts up to this many tokens on the decode "
                   f"node [{DEFAULT_LOCAL_PREFILL_MAX_TOKENS}]")
    p.add_argument("--prefill-nodes", type=int, default=1)
    p.add_argument("--decode-nodes", type=int, default=1)
    p.add_argument("--cpus", type=cpu_list, help="cores to place the services on, e.g. 0-3 or 0,2 "
                   "[every core this process may use]")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request deadline, seconds [600]")
    p.add_argument("--log-dir", help="each service's log goes here [a temporary directory, printed]")
    p.add_argument("--json", dest="json_path", help="also write the results here as JSON")
    peer = p.add_argument_group("against a peer's own server (vLLM's, llama.cpp's), measured by vLLM's own client "
                                "(benchmarks/serve_peer.py)")
    peer.add_argument("--peer", choices=["vllm", "llamacpp-server"], help="run the peer comparison instead: every "
                      "--peer-systems system, --peer-workloads workload and --rate rate, driven by `vllm bench serve` "
                      "(llamacpp-server: Tandem with --quantization int4, 8 requests in flight)")
    peer.add_argument("--peer-systems", help="the peer, colocated, disaggregated, conditional [vllm: all four; "
                      "llamacpp-server: llamacpp-server,colocated]")
    peer.add_argument("--peer-workloads", help="from random-384-128, random-1024-64, random-128-256, chat, "
                      "shared-prefix [vllm: random-384-128; llamacpp-server: random-384-128,random-128-256]")
    peer.add_argument("--peer-gguf", help="the GGUF file llama-server runs [the bundled model's Q4_1 GGUF, when "
                      "--model is the bundled model]")
    peer.add_argument("--rounds", type=int, default=1, help="run every workload and rate this many times, the "
                      "systems back to back each time (the report adds each system's ratios to the peer's run of "
                      "the same round) [1]")
    peer.add_argument("--no-tandem-client", action="store_true",
                      help="skip the cross-check run of Tandem's own client on each system")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark for ``args`` (from ``add_arguments``); print a Markdown report on stdout."""
    from common.config.model_config import ModelConfig
    from common.config.settings import ModelSettings, load_settings
    from common.model.model_store import DEFAULT_MODEL_ALIASES, resolve_model

    if getattr(args, "peer", None):
        from benchmarks import serve_peer

        args.cpus = args.cpus or tuple(sorted(os.sched_getaffinity(0)))
        settings = load_settings(ModelSettings, {"model": args.model, "dtype": args.dtype})
        model_dir = resolve_model(settings.model, settings.home, progress=True)
        vocab_size = ModelConfig.from_pretrained(model_dir).vocab_size
        return serve_peer.run(args, model_dir, resolve_dtype_name(settings.dtype, settings.device), vocab_size,
                              bundled_model=settings.model in DEFAULT_MODEL_ALIASES)
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not names or len(set(names)) < len(names):
        raise ValueError(f"--systems: choose from {', '.join(SYSTEMS)} (each once), got {args.systems!r}")
    systems = [system_named(name) for name in names]
    if getattr(args, "num_blocks", None) is not None and args.num_blocks < 1:
        raise ValueError(f"--num-blocks must be >= 1, got {args.num_blocks}")
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.local_prefill_max_tokens < 0:
        raise ValueError(f"--local-prefill-max-tokens must be >= 0, got {args.local_prefill_max_tokens}")
    workload = configure_workload(args)
    slo = slo_of(args)
    if args.concurrency is None and args.rate is None:
        args.rate = (DEFAULT_RATE,)
    args.cpus = args.cpus or tuple(sorted(os.sched_getaffinity(0)))
    settings = load_settings(ModelSettings, {"model": args.model, "dtype": args.dtype})
    model_dir = resolve_model(settings.model, settings.home, progress=True)
    dtype = resolve_dtype_name(settings.dtype, settings.device)
    config = ModelConfig.from_pretrained(model_dir)
    if workload.max_total_len > config.max_position_embeddings:
        raise ValueError(f"the {workload.name} workload has requests of up to {workload.max_total_len} tokens "
                         f"(prompt + output), past the model's {config.max_position_embeddings}: use --quick "
                         "or shorter lengths")
    # Every process gets the same explicit model and dtype (the gateway then reports the dtype the nodes run).
    model_args = ("--model", str(model_dir), "--dtype", dtype)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="tandem-bench-serve-"))

    results = [result for system in systems for result in bench_system(
        system, args, workload, config.vocab_size, model_args, log_dir, slo, args.api)]
    summaries = [summary for summary, _ in results]
    text = report(summaries, workload, args, model_dir.name, dtype)
    if pool := pool_args(args):
        text += f"\n- every node: {' '.join(pool)}"
        if isinstance(workload, MultiTurnWorkload) and args.num_blocks:
            history = workload.history_blocks(DEFAULT_BLOCK_SIZE)
            text += (f" (the pool: {args.num_blocks / history:.0%} of the conversations' whole histories, "
                     f"{history} blocks of {DEFAULT_BLOCK_SIZE} tokens)")
    if roles := role_pool_args(args):
        text += "\n- disaggregated systems' nodes, in place of that: " + "; ".join(
            f"{role} {' '.join(flags)}" for role, flags in roles.items())
    if len(results) > 1:
        text += "\n" + same_outputs(results)
    print(text)
    _progress(f"service logs: {log_dir}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results_json(results, workload, args, model_dir.name, dtype),
                                                   indent=2))
    return 0 if all(s.failed == 0 for s in summaries) else 1


def same_outputs(results: Sequence[tuple[Summary, Sequence[RequestRecord]]]) -> str:
    """Whether each system generated the first one's tokens, request by request (greedy: it should, up to
    floating-point ties; a multi-turn conversation's later prompts carry its earlier answers)."""
    first, reference = results[0][0].system, {r.index: r.output_ids for r in results[0][1] if r.ok}
    lines = []
    for summary, records in results[1:]:
        both = [r for r in records if r.ok and r.index in reference]
        same = sum(tuple(r.output_ids) == tuple(reference[r.index]) for r in both)
        lines.append(f"- {summary.system}: {same} of {len(both)} requests generated {first}'s tokens")
    return "\n".join(lines)


def role_pool_args(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    """``--prefill-num-blocks`` / ``--decode-num-blocks``: a disaggregated system's pools per role."""
    out: dict[str, tuple[str, ...]] = {}
    for role in ("prefill", "decode"):
        if (blocks := getattr(args, f"{role}_num_blocks", None)) is not None:
            out[role] = ("--num-blocks", str(blocks))
    return out


def pool_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The node flags that size every system's KV pool and offload tier (``--num-blocks``, ``--kv-offload-gb``)."""
    out: tuple[str, ...] = ()
    if getattr(args, "num_blocks", None) is not None:
        out += ("--num-blocks", str(args.num_blocks))
    if getattr(args, "kv_offload_gb", None) is not None:
        out += ("--kv-offload-gb", f"{args.kv_offload_gb:g}")
    return out


def slo_of(args: argparse.Namespace) -> SLO:
    """``--goodput``, or the workload's default SLO."""
    given: SLO | None = getattr(args, "goodput", None)
    return given or WORKLOADS[args.workload].slo


def configure_workload(args: argparse.Namespace) -> Workload:
    """``--workload`` (``--quick``: its smaller variant) with the flags given for its fields."""
    preset = WORKLOADS[args.workload]
    base = preset.quick if args.quick else preset.full
    flags = {name: "--" + name.replace("_", "-") for name in (
        "num_requests", "prompt_len", "output_len", "turns", "think_s", "message_len", "system_len")}
    flags["num_conversations"] = "--conversations"
    given = {name: value for name in flags if (value := getattr(args, name, None)) is not None}
    fields = {f.name for f in dataclasses.fields(base)}
    if unknown := [name for name in given if name not in fields]:
        raise ValueError(f"{flags[unknown[0]]} does not apply to the {base.name} workload")
    return dataclasses.replace(base, **given, seed=args.seed)


def results_json(results: Sequence[tuple[Summary, Sequence[RequestRecord]]], workload: Workload,
                 args: argparse.Namespace, model: str, dtype: str) -> dict[str, Any]:
    """``--json``'s document (its schema is what tests/benchmarks/test_serve_stats.py checks)."""
    return {
        "model": model, "dtype": dtype, "workload": {"name": workload.name, **dataclasses.asdict(workload)},
        "rate": None if args.concurrency else rates_of(args)[0],
        "rates": [] if args.concurrency else list(rates_of(args)), "concurrency": args.concurrency,
        "cpus": list(args.cpus),
        "slo": dataclasses.asdict(slo_of(args)),
        "apis": [api.value for api in getattr(args, "api", (Api.GRPC,))],
        "local_prefill_max_tokens": getattr(args, "local_prefill_max_tokens", DEFAULT_LOCAL_PREFILL_MAX_TOKENS),
        "systems": [system_json(summary, records) for summary, records in results],
        "capacity": capacities([summary for summary, _ in results]),
        "capacity_attainment": CAPACITY_ATTAINMENT,
    }


def report(summaries: Sequence[Summary], workload: Workload, args: argparse.Namespace, model: str,
           dtype: str) -> str:
    rates = rates_of(args)
    load = (f"closed loop, {args.concurrency} in flight" if args.concurrency
            else "all at once" if math.isinf(rates[0]) else
            f"Poisson arrivals at {', '.join(f'{r:g}' for r in rates)} requests/s")
    lines = [
        f"### Serving benchmark: {model} ({dtype}), {workload.name} workload, {workload.num_requests} requests, "
        f"{load}",
        "",
        f"Workload {workload.name} (seed {workload.seed}): {workload.describe()}; random token ids, greedy, "
        f"EOS ignored. Machine: {cpu_name()}, {os.cpu_count()} cores. Fronts: "
        f"{', '.join(_FRONTS[api] for api in getattr(args, 'api', (Api.GRPC,)))}.",
        "",
        f"Goodput: requests/s meeting both SLOs ({slo_of(args).describe()}) over the run's duration; SLO "
        "attainment: % of all requests sent (failed ones miss) meeting both SLOs, and each alone."
        + (f" Over the rate sweep, a system's goodput in DistServe's sense is its highest rate with >= "
           f"{CAPACITY_ATTAINMENT:.0%} attainment (last table)." if len(rates) > 1 else ""),
        "",
        markdown_table(summaries),
        "",
    ]
    if (by_kind := kind_table(summaries)) is not None:
        lines += [by_kind, ""]
    if caps := capacities(summaries):
        lines += [capacity_table(summaries, caps), ""]
    lines += [f"- {s.system}: {s.placement}" for s in summaries]
    lines += [f"- {s.system}: prefix caches found {s.cache['hits']:,} of {s.cache['queries']:,} prompt tokens "
              f"looked up, {s.cache['offload_hits']:,} of them restored from the offload tier"
              for s in summaries if s.cache]
    for s in summaries:
        lines += [f"- {s.system} errors: {e}" for e in s.errors]
    return "\n".join(lines)


_FRONTS = {Api.GRPC: "gRPC Generate", Api.OPENAI: "OpenAI HTTP (streaming /v1/completions, columns /openai)"}


def resolve_dtype_name(name: str, device: str) -> str:
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


def cpu_list(text: str) -> tuple[int, ...]:
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

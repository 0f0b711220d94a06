"""`tandem plan`: recommend how to lay out N nodes for a workload and its latency SLOs.

    tandem plan --workload mixed --slo ttft:4000,tpot:200 --nodes 2 [--rate R] [--quick] [--refit] [--validate]

1. The cost model (benchmarks/planner/cost_model.py): one engine step's time as a function of what it
   computes, fitted once by least squares from ~60 timed steps of the model on this machine, with the
   threads each node gets when N nodes share this machine's cores (as `tandem up` and `bench serve`
   place them), plus the KV transfer cost per token; stored in TANDEM_HOME/planner/cost_models.json
   keyed by model, dtype, threads and CPU, and reused (``--refit`` measures again). With it, what a serving
   node spends per token it streams (the engine's output hand-off, protobuf, gRPC), measured on one real
   colocated server (benchmarks/planner/serving_overhead.py) and added to every simulated step.
2. Every candidate layout of the N nodes is simulated on the workload's requests (the same seeded
   requests `bench serve` sends; benchmarks/planner/simulator.py, where each node runs the engine's own
   scheduler with a serving node's settings and KV cache size): colocated (N replicas), and each
   prefill:decode split, without and with local prefill of prompts up to each ``--thresholds`` value.
3. The table gives predicted TTFT/TPOT p50/p99, goodput and SLO attainment per candidate; the
   recommendation is the highest goodput, and among candidates within 2% of it the one with the most
   headroom under the SLOs (the lower of p99 / SLO for TTFT and TPOT, whichever is worse).

``--validate [CONFIG]`` then runs the recommended configuration (or CONFIG: colocated, 1P:1D,
1P:1D@256) with the real `bench serve` machinery on the same workload and prints predicted vs measured
TTFT/TPOT p50 (the goal: within 25%).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.planner.cost_model import CostKey, CostModel, CostModelStore, fit
from benchmarks.planner.simulator import Deployment, SimResult, simulate
from benchmarks.serve_stats import Distribution
from benchmarks.slo import SLO, parse_slo
from benchmarks.workloads import WORKLOADS, Workload
from common.config.settings import DTYPES

if TYPE_CHECKING:
    from common.config.engine_config import CacheConfig, SchedulerConfig
    from common.config.model_config import ModelConfig
    from common.config.settings import NodeSettings

DEFAULT_THRESHOLDS = (64, 128, 256, 512, 1024)
DEFAULT_RATE = 1.0  # bench serve's


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One simulated configuration, judged by the SLO."""

    result: SimResult
    slo: SLO

    @property
    def ttft(self) -> Distribution:
        dist = Distribution.of([t.ttft_s for t in self.result.timings])
        assert dist is not None
        return dist

    @property
    def tpot(self) -> Distribution | None:
        return Distribution.of([t.tpot_s for t in self.result.timings if t.tpot_s is not None])

    @property
    def headroom(self) -> float:
        """The worse of p99 TTFT / its SLO and p99 TPOT / its SLO (lower is better; > 1: the p99 misses)."""
        tpot = self.tpot
        return max(self.ttft.p99 / self.slo.ttft_s, 0.0 if tpot is None else tpot.p99 / self.slo.tpot_s)

    def row(self) -> list[str]:
        a = self.result.attainment(self.slo)
        tpot = self.tpot
        ms = [f"{1e3 * v:.0f}" for v in (self.ttft.p50, self.ttft.p99)]
        ms += ["-", "-"] if tpot is None else [f"{1e3 * v:.0f}" for v in (tpot.p50, tpot.p99)]
        return [self.result.deployment.name, *ms, f"{a.goodput:.3f}", f"{100 * a.both:.0f}"]


def candidates(nodes: int, thresholds: Sequence[int]) -> list[Deployment]:
    """Colocated, then each prefill:decode split without and with each local-prefill threshold."""
    out = [Deployment(0, nodes)]
    for p in range(1, nodes):
        out += [Deployment(p, nodes - p, t) for t in (0, *thresholds)]
    return out


GOODPUT_TIE = 0.02  # goodputs this close (relative) are a tie: a run's duration moves them by that much


def recommend(results: Sequence[Candidate]) -> Candidate:
    """The highest goodput; among those within ``GOODPUT_TIE`` of it, the most headroom (the lowest of
    p99 TTFT / TTFT SLO and p99 TPOT / TPOT SLO, the worse of the two); then the fewest prefill nodes."""
    best = max(c.result.attainment(c.slo).goodput for c in results)
    tied = [c for c in results if c.result.attainment(c.slo).goodput >= (1 - GOODPUT_TIE) * best]
    return min(tied, key=lambda c: (c.headroom, c.result.deployment.num_prefill))


def parse_deployment(text: str, nodes: int) -> Deployment:
    """``colocated`` (``nodes`` replicas), ``PP:DD`` or ``PP:DD@T`` (local prefill up to T tokens)."""
    if text == "colocated":
        return Deployment(0, nodes)
    match = re.fullmatch(r"(\d+)P:(\d+)D(?:@(\d+))?", text)
    if match is None:
        raise ValueError(f"--validate: expected colocated, PP:DD or PP:DD@T (e.g. 1P:1D@256), got {text!r}")
    p, d, t = match.groups()
    return Deployment(int(p), int(d), int(t or 0))


def threads_per_node(nodes: int, cpus: Sequence[int]) -> int:
    """What the launcher gives each of ``nodes`` nodes on ``cpus`` (tandem_cli.launcher.split_cores)."""
    return max(1, len(cpus) // nodes)


def cost_model(model_dir: Path, dtype: str, threads: int, home: Path, refit: bool,
               cpus: Sequence[int]) -> tuple[CostModel, CostKey, bool]:
    """The stored fit for this model, dtype, threads and CPU, or a new one (then stored); True when fitted now."""
    from benchmarks.machine import cpu_name

    key = CostKey(model_dir.name, dtype, threads, cpu_name())
    store = CostModelStore(home)
    if not refit and (stored := store.load(key)) is not None:
        return stored, key, False
    import torch

    from benchmarks.planner.serving_overhead import measure_per_streamed_token_s
    from benchmarks.planner.step_timing import kv_transfer_per_token_s, time_steps
    from common.model.loader import load_model

    torch.set_num_threads(threads)
    model = load_model(model_dir, dtype, "cpu")
    cfg = model.config
    bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize
    started = time.perf_counter()
    samples = time_steps(model)
    fitted = fit(samples, kv_transfer_per_token_s(bytes_per_token))
    del model  # the probe server loads its own copy
    fitted = dataclasses.replace(fitted, per_streamed_token_s=measure_per_streamed_token_s(
        model_dir, dtype, cpus[:threads], fitted, cfg.vocab_size))
    _progress(f"fitted the cost model from {len(samples)} steps in {time.perf_counter() - started:.0f} s")
    store.save(key, fitted, samples)
    return fitted, key, True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=list(WORKLOADS), default="mixed", help="as bench serve's [mixed]")
    p.add_argument("--quick", action="store_true", help="the workload's smaller variant")
    p.add_argument("--num-requests", type=int, help="requests in the workload [its preset's]")
    p.add_argument("--rate", type=float, default=DEFAULT_RATE, help=f"Poisson arrivals, requests/s [{DEFAULT_RATE}]")
    p.add_argument("--seed", type=int, default=0, help="workload seed [0]")
    p.add_argument("--slo", type=parse_slo, metavar="ttft:MS,tpot:MS", help="[the workload's: " + "; ".join(
        f"{name} {preset.slo.flag}" for name, preset in WORKLOADS.items()) + "]")
    p.add_argument("--nodes", type=int, default=2, help="nodes to lay out (each gets cores / nodes threads) [2]")
    p.add_argument("--thresholds", default=",".join(map(str, DEFAULT_THRESHOLDS)),
                   help=f"local-prefill thresholds to try, tokens [{','.join(map(str, DEFAULT_THRESHOLDS))}]")
    p.add_argument("--model", help="local Hugging Face directory or the bundled model's name [TANDEM_MODEL]")
    p.add_argument("--dtype", choices=DTYPES, help="[TANDEM_DTYPE]")
    p.add_argument("--cpus", help="cores the deployment would use, e.g. 0-3 [every core this process may use]")
    p.add_argument("--refit", action="store_true", help="measure the cost model again, even if one is stored")
    p.add_argument("--validate", nargs="?", const="recommended", metavar="CONFIG",
                   help="run the recommendation (or CONFIG: colocated, 1P:1D, 1P:1D@256) with bench serve and "
                   "compare predicted with measured TTFT/TPOT p50")
    p.add_argument("--json", dest="json_path", help="also write the plan here as JSON")
    ray = p.add_argument_group("applying the plan to a Tandem deployment on Ray (docs/multi-machine.md)")
    ray.add_argument("--apply", action="store_true", help="scale the Ray deployment --name at --address to the "
                     "recommended prefill and decode node counts, chosen among the prefill:decode splits only (`tandem "
                     "ray scale`'s path: new nodes serve before it returns, removed ones are drained first)")
    ray.add_argument("--address", help="the Ray cluster's head, host:port (with --apply)")
    ray.add_argument("--name", default="tandem", help="the Ray deployment's name (with --apply) [tandem]")
    p.set_defaults(prompt_len=None, output_len=None)


def run(args: argparse.Namespace) -> int:
    from benchmarks.bench_serve import configure_workload, cpu_list, resolve_dtype_name
    from common.config.model_config import ModelConfig
    from common.config.settings import ModelSettings, NodeSettings, load_settings
    from common.model.model_store import resolve_model

    if args.nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {args.nodes}")
    if getattr(args, "apply", False) and not args.address:
        raise ValueError("--apply needs --address (the Ray cluster's head, host:port) and --name (the deployment)")
    thresholds = [int(t) for t in args.thresholds.split(",") if t.strip()]
    workload = configure_workload(args)
    slo = args.slo or WORKLOADS[args.workload].slo
    cpus = cpu_list(args.cpus) if args.cpus else tuple(sorted(os.sched_getaffinity(0)))
    settings = load_settings(ModelSettings, {"model": args.model, "dtype": args.dtype})
    model_dir = resolve_model(settings.model, settings.home, progress=True)
    dtype = resolve_dtype_name(settings.dtype, settings.device)
    threads = threads_per_node(args.nodes, cpus)
    cost, key, fitted = cost_model(model_dir, dtype, threads, settings.home, args.refit, cpus)
    model_config = ModelConfig.from_pretrained(model_dir)
    # Every simulated node schedules as a serving node would, over a KV cache of a serving node's size.
    cache, scheduler = node_configs(load_settings(NodeSettings), settings.device, model_config, dtype)

    requests = workload.requests(model_config.vocab_size, args.rate)
    if any(r.follows is not None for r in requests):
        raise ValueError(f"--workload {workload.name}: the planner's simulator sends independent requests; it does "
                         f"not model conversations whose turns wait for each other")
    # A Ray deployment runs prefill and decode nodes: --apply chooses among those layouts only.
    layouts = [d for d in candidates(args.nodes, thresholds) if not (getattr(args, "apply", False) and d.colocated)]
    if not layouts:
        raise ValueError("--apply: with --nodes 1 there is no prefill:decode split to apply (a Ray deployment has at "
                         "least one of each)")
    results = [Candidate(simulate(requests, d, cost, scheduler, cache), slo) for d in layouts]
    best = recommend(results)
    print(plan_report(results, best, workload, args, slo, cost, key, fitted))
    document: dict[str, Any] = {
        "workload": {"name": workload.name, **dataclasses.asdict(workload)}, "rate": args.rate,
        "slo": dataclasses.asdict(slo), "nodes": args.nodes, "cost_key": dataclasses.asdict(key),
        "cost_model": dataclasses.asdict(cost), "recommended": best.result.deployment.name,
        "candidates": [_candidate_json(c) for c in results]}
    if args.validate:
        target = best if args.validate == "recommended" else Candidate(
            simulate(requests, parse_deployment(args.validate, args.nodes), cost, scheduler, cache), slo)
        document["validation"] = validate(target, args, model_dir, dtype, cpus)
    if getattr(args, "apply", False):
        document["applied"] = apply_on_ray(best.result.deployment, args.address, args.name)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(document, indent=2))
    return 0


def apply_on_ray(d: Deployment, address: str, name: str) -> dict[str, Any]:
    """Scale the Ray deployment ``name`` to ``d``'s node counts (tandem_cli.ray_command.apply_scale). A colocated
    recommendation cannot be applied to a Ray deployment (its nodes are prefill and decode nodes): refused."""
    if d.colocated:
        raise ValueError(f"--apply: the recommendation is {d.name} (colocated replicas); a Tandem deployment on Ray "
                         "runs prefill and decode nodes, so it is left as it is")
    from tandem_cli.ray_cluster import RayDeployment, connect, load_spec
    from tandem_cli.ray_command import apply_scale

    connect(address)
    deployment = RayDeployment(load_spec(name))
    result = apply_scale(deployment, d.num_prefill, d.num_decode)
    note = ""
    if d.local_prefill_max_tokens:
        note = (f"; its local-prefill threshold ({d.local_prefill_max_tokens} tokens) is the gateway's "
                "--local-prefill-max-tokens, set when the deployment starts (`tandem ray up --gateway-arg=...`)")
    print(f"applied {d.name} to the Ray deployment {name}: {d.num_prefill} prefill + {d.num_decode} decode nodes "
          f"(added {', '.join(result['added']) or 'none'}; removed {', '.join(result['removed']) or 'none'}){note}",
          file=sys.stderr)
    return {"deployment": name, "prefill": d.num_prefill, "decode": d.num_decode, **result}


def plan_report(results: Sequence[Candidate], best: Candidate, workload: Workload, args: argparse.Namespace,
                slo: SLO, cost: CostModel, key: CostKey, fitted: bool) -> str:
    header = ["configuration", "TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)", "TPOT p99 (ms)",
              "goodput (req/s)", "SLO attainment (%)"]
    lines = [f"### Plan: {workload.name} workload on {args.nodes} node{'s' if args.nodes != 1 else ''}, "
             f"{args.rate:g} requests/s, {slo.describe()}", "",
             f"Workload (seed {workload.seed}): {workload.describe()}.",
             f"Cost model ({'fitted now' if fitted else 'stored'}; {key.model}, {key.dtype}, {key.threads} "
             f"thread{'s' if key.threads != 1 else ''} per node, {key.cpu}): {cost.describe()}.", "",
             "| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    lines += ["| " + " | ".join(c.row()) + " |" for c in results]
    d = best.result.deployment
    how = (f"{d.num_decode} colocated replicas (`tandem bench serve --systems colocated`)" if d.colocated else
           f"{d.num_prefill} prefill node{'s' if d.num_prefill != 1 else ''} and {d.num_decode} decode "
           f"node{'s' if d.num_decode != 1 else ''}, gateway --local-prefill-max-tokens "
           f"{d.local_prefill_max_tokens}" + (" (off)" if not d.local_prefill_max_tokens else ""))
    return "\n".join([*lines, "", f"**Recommended: {d.name}** — {how}."])


def validate(target: Candidate, args: argparse.Namespace, model_dir: Path, dtype: str,
             cpus: Sequence[int]) -> dict[str, Any]:
    """Run ``target``'s deployment with bench serve on the same workload; print predicted vs measured p50s."""
    from benchmarks import bench_serve

    d = target.result.deployment
    system = "colocated" if d.colocated else "conditional" if d.local_prefill_max_tokens else "disaggregated"
    nodes = ["--prefill-nodes", str(d.num_decode - 1), "--decode-nodes", "1"] if d.colocated else [
        "--prefill-nodes", str(d.num_prefill), "--decode-nodes", str(d.num_decode)]
    with tempfile.TemporaryDirectory(prefix="tandem-plan-") as tmp:
        out = Path(tmp) / "serve.json"
        argv = ["--model", str(model_dir), "--dtype", dtype, "--workload", args.workload, "--rate", str(args.rate),
                "--seed", str(args.seed), "--systems", system, *nodes, "--cpus", ",".join(map(str, cpus)),
                "--local-prefill-max-tokens", str(d.local_prefill_max_tokens), "--goodput", target.slo.flag,
                "--json", str(out), *(["--quick"] if args.quick else []),
                *(["--num-requests", str(args.num_requests)] if args.num_requests else [])]
        _progress(f"validating {d.name}: tandem bench serve {' '.join(argv)}")
        parser = argparse.ArgumentParser()
        bench_serve.add_arguments(parser)
        bench_serve.run(parser.parse_args(argv))
        measured = json.loads(out.read_text())["systems"][0]
    lines = [f"### Validation: {d.name}, predicted vs measured", "", "| metric | predicted (ms) | measured (ms) | "
             "error |", "|---|---:|---:|---:|"]
    rows: list[dict[str, Any]] = []
    predicted = {"ttft_s": target.ttft.p50, "tpot_s": None if target.tpot is None else target.tpot.p50}
    for label, name in (("TTFT p50", "ttft_s"), ("TPOT p50", "tpot_s")):
        pred: float | None = predicted[name]
        got: float | None = (measured.get(name) or {}).get("p50")
        error = None if pred is None or not got else (pred - got) / got
        rows.append({"metric": label, "predicted_s": pred, "measured_s": got, "error": error})
        lines.append(f"| {label} | {_ms(pred)} | {_ms(got)} | {_percent(error)} |")
    print("\n" + "\n".join(lines))
    return {"configuration": d.name, "rows": rows, "measured_failed": measured["failed"]}


def _candidate_json(c: Candidate) -> dict[str, Any]:
    a = c.result.attainment(c.slo)
    return {"configuration": c.result.deployment.name, **dataclasses.asdict(c.result.deployment),
            "ttft_s": dataclasses.asdict(c.ttft), "tpot_s": None if c.tpot is None else dataclasses.asdict(c.tpot),
            "goodput": a.goodput, "attainment": {"both": a.both, "ttft": a.ttft, "tpot": a.tpot},
            "duration_s": c.result.duration_s}


def _percent(error: float | None) -> str:
    return "-" if error is None else f"{100 * error:+.0f}%"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.0f}"


def node_configs(node: NodeSettings, device: str, model: ModelConfig,
                 dtype: str) -> tuple[CacheConfig, SchedulerConfig]:
    """A serving node's engine configs (``node_setup.engine_configs``), its number of KV blocks and
    ``max_model_len`` resolved as ``EngineCore`` resolves them for ``model`` in ``dtype``."""
    from common.engine.node_setup import engine_configs
    from common.kv.kv_cache import KVCacheSpec

    cache, scheduler = engine_configs(node, device)
    spec = KVCacheSpec(model.num_layers, model.num_kv_heads, model.head_dim, cache.block_size, dtype)
    cache = dataclasses.replace(cache, num_blocks=cache.resolve_num_blocks(
        spec.bytes_per_block(_KV_ELEMENT_BYTES[dtype])))
    return cache, dataclasses.replace(scheduler, max_model_len=scheduler.max_model_len or model.max_position_embeddings)


_KV_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # the KV cache is in the activations' dtype


def _progress(message: str) -> None:
    print(f"[plan] {message}", file=sys.stderr, flush=True)


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        return run(args)
    except ValueError as exc:
        print(f"tandem plan: error: {exc}", file=sys.stderr)
        return 2


def add_parser(sub: Any) -> None:
    """Add ``plan`` to the ``tandem`` subparsers ``sub`` (the ``tandem.commands`` entry point's target)."""
    parser = sub.add_parser("plan", help="recommend a prefill:decode split for a workload and its SLOs",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=cmd_plan)

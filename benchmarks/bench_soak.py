"""Soak: a mixed load with cancellations for M minutes, one node killed and restarted in the middle.

    tandem bench soak --minutes M [--prefill-nodes P] [--decode-nodes D] [--concurrency C]
                      [--cancel-fraction F] [--restart-node NAME] [--out-dir DIR] [--model M]
                      [--num-blocks N] [--kv-offload none|cpu|disk|shared] [--kv-offload-gb G]
    python -m benchmarks.bench_soak ...          (the same)

The deployment runs as ``tandem up`` runs it (tandem_cli.launcher: 1 gateway, P prefill, D decode nodes,
each pinned to its cores, supervised with a RestartPolicy). C client threads keep requests in flight for M
minutes: random prompts (half of them continuing one of 8 shared prefixes) and output lengths, greedy and
sampled, some with stop strings and ``n`` = 2, and a
share (``--cancel-fraction``) cancelled by the client at a random moment (queued, prefilling, transferring or
decoding). Halfway, ``--restart-node`` is killed with SIGKILL; the launcher restarts it and the run records
when it serves again. Every process's RSS (``VmRSS``) is sampled throughout (benchmarks/rss.py).

Reported (soak.json, soak.md, soak.png under ``--out-dir``): requests completed / cancelled / failed (the
failures while the killed node was down listed apart: its in-flight requests are expected to fail), the
restart, RSS per process after warm-up (start, end, peak, growth; the goal is flat within 10%), and each
node's used blocks and queued requests after the load (the goal: 0 leaked), and the KV events' drift: a prefix
index (benchmarks/kv_drift.py, the gateway's own code) follows every node's events, has its connections cut
at a quarter of the run, and is compared with each node's cached blocks at the end (the goal: 0 drift,
exact). Every node runs with the KV offload tier (``--kv-offload``, default cpu): its prefix-cache hits and tier
restores are reported, and with ``disk`` or ``shared`` no tier file may be left once the nodes are gone (the
killed one's included: a disk tier's file is unlinked once mapped; a shared tier's files of a killed writer are
removed by the next node on the directory, common/kv/shared_tier.py). Exit status 1 on a leak, drift, a tier
file left, a failure outside the restart window, or a killed node that never served again.

The KV cache tensor is allocated zeroed and its pages become resident when a block is first written, so a
node's RSS climbs until the load has touched every block (faster with a smaller ``--num-blocks``): choose
``--warmup-fraction`` to cover that before judging growth.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.rss import FLAT_WITHIN_PCT, RssSample, RssSampler, rss_growth

RESTART_SLACK_S = 3.0  # failures up to this long after the restarted node serves again still count as its


@dataclass(frozen=True)
class SoakRequest:
    """What the client saw of one request (seconds since the load started)."""

    sent_s: float
    ended_s: float
    code: str  # "OK" or the gRPC status name
    cancelled_by_client: bool
    num_tokens: int

    @property
    def failed(self) -> bool:
        return self.code != "OK" and not (self.code == "CANCELLED" and self.cancelled_by_client)


@dataclass
class Restart:
    node: str
    killed_at_s: float | None = None
    serving_again_at_s: float | None = None

    def covers(self, r: SoakRequest) -> bool:
        """Whether ``r`` ran while the node was down (or just after it came back)."""
        if self.killed_at_s is None:
            return False
        back = self.serving_again_at_s if self.serving_again_at_s is not None else float("inf")
        return r.ended_s >= self.killed_at_s and r.sent_s <= back + RESTART_SLACK_S


class SoakLoad:
    """``concurrency`` threads sending a seeded mixed load to ``target`` until ``stop``."""

    def __init__(self, target: str, vocab_size: int, concurrency: int, cancel_fraction: float, seed: int) -> None:
        import grpc

        self.channel = grpc.insecure_channel(target)
        self.vocab_size = vocab_size
        # Half the prompts continue one of these (conversations, shared system prompts): prefix-cache hits, and
        # with a small pool, blocks evicted into the offload tier and restored from it.
        shared = random.Random(seed)
        self.prefixes = [[shared.randrange(3, vocab_size) for _ in range(shared.randrange(64, 256))]
                         for _ in range(8)]
        self.concurrency = concurrency
        self.cancel_fraction = cancel_fraction
        self._durations: collections.deque[float] = collections.deque(maxlen=50)  # completed requests' lengths, s
        self.seed = seed
        self.records: list[SoakRequest] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._t0 = 0.0

    def start(self) -> SoakLoad:
        self._t0 = time.monotonic()
        self._threads = [threading.Thread(target=self._worker, args=(random.Random(self.seed * 1000 + i),),
                                          name=f"soak-client-{i}", daemon=True) for i in range(self.concurrency)]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> list[SoakRequest]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)
        self.channel.close()
        return self.records

    def _request(self, rng: random.Random) -> Any:
        from tandem.v1 import common_pb2, generate_pb2

        ids = [rng.randrange(3, self.vocab_size) for _ in range(int(rng.lognormvariate(3.5, 0.8)) % 400 + 4)]
        if rng.random() < 0.5:
            ids = rng.choice(self.prefixes) + ids[:64]
        sampling = common_pb2.SamplingParams(max_tokens=rng.randint(4, 64), ignore_eos=rng.random() < 0.7,
                                             temperature=rng.choice([0.0, 0.0, 0.8]))
        if sampling.temperature:
            sampling.seed = rng.randrange(2**31)
        req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=ids), sampling=sampling,
                                           stream=generate_pb2.StreamOptions(include_token_ids=True))
        if rng.random() < 0.1:
            req.stop.append("the")
        if rng.random() < 0.1:
            req.n = 2
        return req

    def _worker(self, rng: random.Random) -> None:
        import grpc

        from tandem.v1 import generate_pb2_grpc

        stub = generate_pb2_grpc.TandemStub(self.channel)
        while not self._stop.is_set():
            req = self._request(rng)
            cancel = rng.random() < self.cancel_fraction
            sent = time.monotonic() - self._t0
            call = stub.Generate(req, timeout=120)
            timer = threading.Timer(rng.uniform(0.0, self._cancel_scale()), call.cancel) if cancel else None
            if timer is not None:
                timer.start()
            code, tokens = "OK", 0
            try:
                for response in call:
                    tokens += len(response.token_ids)
            except grpc.RpcError as exc:
                code = exc.code().name
                if code == "UNAVAILABLE":
                    time.sleep(0.2)  # a node is down: do not spin
            finally:
                if timer is not None:
                    timer.cancel()
            with self._lock:
                self.records.append(SoakRequest(round(sent, 3), round(time.monotonic() - self._t0, 3), code,
                                                cancel, tokens))
                if code == "OK":
                    self._durations.append(time.monotonic() - self._t0 - sent)

    def _cancel_scale(self) -> float:
        """How late a cancellation may come: 1.5x the median length of the last 50 completed requests (2 s before
        any), so that it lands while the request is queued, prefilling, transferring or decoding whatever the model's
        speed, not after it ended (a tiny model's requests take a tenth of a second)."""
        with self._lock:
            recent = sorted(self._durations)
        return 1.5 * recent[len(recent) // 2] if recent else 2.0


def node_stats(launcher: Any) -> dict[str, dict[str, int]]:
    """Each live node's used blocks and requests (waiting + running), from its Stats."""
    import grpc

    from tandem.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

    out = {}
    for spec in launcher.specs:
        if spec.role == "gateway" or launcher.procs[spec.name].poll() is not None:
            continue
        stub = prefill_pb2_grpc.PrefillStub if spec.role == "prefill" else decode_pb2_grpc.DecodeStub
        with grpc.insecure_channel(spec.target) as channel:
            stats = stub(channel).Stats(common_pb2.StatsRequest(), timeout=10)
        out[spec.name] = {"used_blocks": stats.used_blocks, "requests": stats.num_waiting + stats.num_running,
                          "prefix_cache_hits": stats.prefix_cache_hits, "offload_hits": stats.offload_hits,
                          "offload_blocks": stats.offload_blocks}
    return out


def settle(launcher: Any, timeout_s: float) -> dict[str, dict[str, int]]:
    """Node stats once nothing is held any more, or at ``timeout_s`` (what is left then is a leak)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = node_stats(launcher)
        if not any(v["used_blocks"] or v["requests"] for v in stats.values()) or time.monotonic() > deadline:
            return stats
        time.sleep(0.5)


def kill_and_wait(launcher: Any, restart: Restart, t0: float, give_up_s: float) -> None:
    """SIGKILL ``restart.node``; return once the launcher restarted it and it serves (or at ``give_up_s``)."""
    from tandem_cli.launcher import is_serving

    restart.killed_at_s = round(time.monotonic() - t0, 3)
    _progress(f"killing {restart.node} (SIGKILL)")
    os.kill(launcher.procs[restart.node].pid, signal.SIGKILL)
    spec = next(s for s in launcher.specs if s.name == restart.node)
    while time.monotonic() - t0 < give_up_s:
        if launcher.restarts.get(spec.name) and launcher.procs[spec.name].poll() is None \
                and is_serving(spec.target, 1.0):
            restart.serving_again_at_s = round(time.monotonic() - t0, 3)
            return
        time.sleep(0.5)


def summarize(records: list[SoakRequest], restart: Restart) -> dict[str, Any]:
    failed = [r for r in records if r.failed]
    outside = [r for r in failed if not restart.covers(r)]
    return {"total": len(records), "ok": sum(r.code == "OK" for r in records),
            "cancelled": sum(r.code == "CANCELLED" and r.cancelled_by_client for r in records),
            "failed": len(failed), "failed_outside_restart": len(outside),
            "failed_codes": dict(Counter(r.code for r in failed)),
            "output_tokens": sum(r.num_tokens for r in records)}


def markdown(result: dict[str, Any]) -> str:
    req, restart, cfg = result["requests"], result["restart"], result["config"]
    back = restart["serving_again_at_s"]
    lines = [f"# Soak: {cfg['minutes']:g} min, {cfg['prefill_nodes']} prefill + {cfg['decode_nodes']} decode, "
             f"{cfg['concurrency']} clients, {cfg['cancel_fraction']:.0%} cancelled ({cfg['model']})", "",
             f"Requests: {req['total']} ({req['ok']} completed, {req['cancelled']} cancelled by the client, "
             f"{req['failed']} failed: {req['failed_outside_restart']} outside the restart window; "
             f"codes {req['failed_codes'] or '{}'}), {req['output_tokens']} output tokens.", ""]
    if restart["killed_at_s"] is not None:
        lines += [f"Restart: {restart['node']} killed (SIGKILL) at {restart['killed_at_s']:.0f} s, "
                  + (f"serving again at {back:.0f} s." if back is not None else "**not serving again**."), ""]
    lines += ["| process | pid | samples | RSS start (MiB) | RSS end (MiB) | peak (MiB) | growth | "
              f"flat within {FLAT_WITHIN_PCT:g}% | own (RssAnon) start -> end | shared KV (RssShmem) start -> end |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for g in result["rss"]:
        lines.append(f"| {g['process']} | {g['pid']} | {g['num_samples']} | {g['start_mib']:.0f} | "
                     f"{g['end_mib']:.0f} | {g['peak_mib']:.0f} | {g['growth_pct']:+.1f}% | "
                     f"{'yes' if g['flat'] else '**no**'} | {g.get('anon_start_mib', 0):.0f} -> "
                     f"{g.get('anon_end_mib', 0):.0f} | {g.get('shmem_start_mib', 0):.0f} -> "
                     f"{g.get('shmem_end_mib', 0):.0f} |")
    lines += ["", "| node | used blocks after the load | requests left | prefix-cache hits (tokens) | of them from the "
              "offload tier | tier blocks |", "|---|---|---|---|---|---|"]
    lines += [f"| {name} | {v['used_blocks']} | {v['requests']} | {v.get('prefix_cache_hits', 0)} | "
              f"{v.get('offload_hits', 0)} | {v.get('offload_blocks', 0)} |"
              for name, v in result["nodes_after"].items()]
    if cfg.get("kv_offload", "none") != "none":
        left = result.get("tier_files_left", [])
        lines += ["", f"Offload tier: `--kv-offload {cfg['kv_offload']}`, {cfg['kv_offload_gb']:g} GiB per node; "
                  f"tier files left after the nodes stopped: {', '.join(left) if left else 'none'}."]
    kv = result.get("kv_events")
    if kv is not None:  # a prefix index that followed every node, its connections cut at a quarter of the run
        verdict = "exact" if kv["exact"] else "**not exact**"
        lines += ["", f"KV events: drift {kv['drift_blocks']} blocks at the end ({verdict}); resyncs "
                  f"{kv['resyncs'] or '{}'}.", "",
                  "| node | cached blocks | index's view | drift (blocks) | exact after (s) |", "|---|---|---|---|---|"]
        lines += [f"| {name} | {n['blocks']} | {n['view_blocks']} | {n['drift_blocks']} | {n['seconds_to_exact']} |"
                  for name, n in kv["nodes"].items()]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], samples: list[RssSample], path: Path) -> Path | None:
    try:
        from benchmarks import plots
    except ImportError:  # no matplotlib: JSON and Markdown only
        return None
    series = {name: [(s.t_s / 60, s.rss_kib / 1024) for s in samples if s.process == name]
              for name in sorted({s.process for s in samples})}
    killed = result["restart"]["killed_at_s"]
    return plots.rss_over_time(series, None if killed is None else (killed + result["load_started_s"]) / 60, path)


def run(args: argparse.Namespace) -> int:
    from benchmarks.bench_serve import resolve_dtype_name
    from benchmarks.kv_drift import KvDriftWatch
    from common.config.model_config import ModelConfig
    from common.config.settings import ModelSettings, load_settings
    from common.model.model_store import resolve_model
    from tandem_cli.launcher import Launcher, RestartPolicy, Topology

    if args.minutes <= 0 or args.concurrency < 1 or not 0 <= args.cancel_fraction <= 1 or args.num_blocks < 0:
        raise ValueError("need --minutes > 0, --concurrency >= 1, --cancel-fraction in [0, 1] and --num-blocks >= 0")
    settings = load_settings(ModelSettings, {"model": args.model, "dtype": args.dtype})
    model_dir = resolve_model(settings.model, settings.home, progress=True)
    dtype = resolve_dtype_name(settings.dtype, settings.device)
    vocab_size = ModelConfig.from_pretrained(model_dir).vocab_size
    out_dir = Path(args.out_dir) if args.out_dir else Path(tempfile.mkdtemp(prefix="tandem-soak-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    tier_dir = out_dir / "kv-offload"  # the disk or shared tier's files: none may be left once the nodes are gone
    tier_args = ("--kv-offload", args.kv_offload, "--kv-offload-gb", f"{args.kv_offload_gb:g}",
                 "--kv-offload-dir", str(tier_dir)) if args.kv_offload != "none" else ("--kv-offload", "none")
    topology = Topology(num_prefill=args.prefill_nodes, num_decode=args.decode_nodes, free_ports=True,
                        http_port=None, model_args=("--model", str(model_dir), "--dtype", dtype),
                        node_args=("--kv-timeout-s", "20", "--grace-s", "1", *tier_args,
                                   *(("--num-blocks", str(args.num_blocks)) if args.num_blocks else ())),
                        gateway_args=("--stats-interval-s", "0.5", "--shutdown-grace-s", "1"),
                        cpus=args.cpus or tuple(sorted(os.sched_getaffinity(0))), cpu_lending=True)
    launcher = Launcher(topology, log_dir=out_dir / "logs", restart=RestartPolicy(initial_backoff_s=1.0),
                        on_event=lambda m: _progress(m))
    if args.restart_node and args.restart_node not in {s.name for s in launcher.specs}:
        raise ValueError(f"--restart-node: no process {args.restart_node!r} in {[s.name for s in launcher.specs]}")
    duration_s = args.minutes * 60
    restart = Restart(args.restart_node)
    watch: KvDriftWatch | None = None
    sampler = RssSampler(lambda: {name: p.pid for name, p in launcher.procs.items() if p.poll() is None},
                         args.sample_interval_s).start()
    try:
        with launcher:
            load_started_s = time.monotonic() - sampler.started_at
            _progress(f"up; soaking for {args.minutes:g} min with {args.concurrency} clients "
                      f"(logs: {out_dir / 'logs'})")
            watch = KvDriftWatch({s.name: (s.role, s.target) for s in launcher.specs if s.role != "gateway"})
            watch.start()
            load = SoakLoad(launcher.gateway.target, vocab_size, args.concurrency, args.cancel_fraction,
                            args.seed).start()
            t0 = time.monotonic()
            time.sleep(duration_s / 4)
            _progress("cutting the KV-event subscriber's connections")
            watch.cut()  # a subscriber killed and reconnected mid-run: it must be exact again at the end
            if args.restart_node:
                time.sleep(max(0.0, duration_s / 2 - (time.monotonic() - t0)))
                kill_and_wait(launcher, restart, t0, give_up_s=duration_s + 120)
            time.sleep(max(0.0, duration_s - (time.monotonic() - t0)))
            records = load.stop()
            nodes_after = settle(launcher, timeout_s=30.0)
            kv_events = watch.report()
    finally:
        if watch is not None:
            watch.stop()
        samples = sampler.stop()
    growth = rss_growth(samples, warmup_s=args.warmup_fraction * duration_s)
    tier_files_left = sorted(str(p.relative_to(tier_dir)) for p in tier_dir.rglob("*") if not p.is_dir())
    result: dict[str, Any] = {
        "config": {"minutes": args.minutes, "prefill_nodes": args.prefill_nodes, "decode_nodes": args.decode_nodes,
                   "concurrency": args.concurrency, "cancel_fraction": args.cancel_fraction, "model": model_dir.name,
                   "dtype": dtype, "seed": args.seed, "restart_node": args.restart_node,
                   "kv_offload": args.kv_offload, "kv_offload_gb": args.kv_offload_gb, "num_blocks": args.num_blocks},
        "load_started_s": load_started_s,
        "requests": summarize(records, restart),
        "restart": asdict(restart),
        "rss": [{**asdict(g), "growth_pct": g.growth_pct, "flat": g.flat()} for g in growth],
        "nodes_after": nodes_after,
        "leaked_blocks": sum(v["used_blocks"] for v in nodes_after.values()),
        "leaked_requests": sum(v["requests"] for v in nodes_after.values()),
        "offload_hits": sum(v["offload_hits"] for v in nodes_after.values()),
        "tier_files_left": tier_files_left,
        "kv_events": kv_events,
        "samples": [asdict(s) for s in samples],
    }
    (out_dir / "soak.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (out_dir / "soak.md").write_text(text)
    png = plot(result, samples, out_dir / "soak.png")
    print(text)
    _progress(f"wrote {out_dir / 'soak.json'}, {out_dir / 'soak.md'}" + (f", {png}" if png else ""))
    clean = not (result["leaked_blocks"] or result["leaked_requests"] or result["requests"]["failed_outside_restart"]
                 or kv_events["drift_blocks"] or not kv_events["exact"] or tier_files_left)
    return 0 if clean and (not args.restart_node or restart.serving_again_at_s is not None) else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    from benchmarks.bench_serve import cpu_list

    p.add_argument("--minutes", type=float, default=30.0, help="how long the load runs [30]")
    p.add_argument("--model", help="local Hugging Face directory or the bundled model's name [TANDEM_MODEL]")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help="[TANDEM_DTYPE]")
    p.add_argument("--prefill-nodes", type=int, default=2)
    p.add_argument("--decode-nodes", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=8, help="client threads, each with one request in flight [8]")
    p.add_argument("--cancel-fraction", type=float, default=0.25,
                   help="share of requests the client cancels at a random moment of their expected length "
                   "(up to 1.5x the recent median) [0.25]")
    p.add_argument("--restart-node", default="decode-0",
                   help="the process killed (SIGKILL) halfway and restarted by the launcher; '' = none [decode-0]")
    p.add_argument("--num-blocks", type=int, default=0, help="KV blocks per node; 0: the node's default [0]")
    p.add_argument("--kv-offload", choices=["none", "cpu", "disk", "shared"], default="cpu",
                   help="the KV offload tier under every node's pool (its files, disk or shared, under "
                   "OUT_DIR/kv-offload: none may be left at the end) [cpu]")
    p.add_argument("--kv-offload-gb", type=float, default=0.25, help="GiB of each node's tier [0.25]")
    p.add_argument("--sample-interval-s", type=float, default=5.0, help="RSS sampling period [5]")
    p.add_argument("--warmup-fraction", type=float, default=0.2,
                   help="share of the run before RSS growth is judged [0.2]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpus", type=cpu_list, help="cores to place the services on [every core this process may use]")
    p.add_argument("--out-dir", help="soak.json, soak.md, soak.png and the service logs [a temporary directory]")


def _progress(message: str) -> None:
    print(f"[soak] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except ValueError as exc:
        print(f"bench soak: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

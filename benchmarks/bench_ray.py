"""Tandem on Ray against `tandem up` on the same box and workload: issue 34's goal, throughput >= 0.95x.

    python -m benchmarks.bench_ray [--model M] [--dtype D] [--num-requests N] [--concurrency C] [--json F]

Both systems are 1 prefill + 1 decode node and a gateway. `tandem up`'s launcher pins the prefill node to
core 0 and the decode node to core 1; on Ray the nodes are placed on two raylets of a loopback cluster started
here (a head and a worker, each with its own custom resource standing for a machine: host_a, host_b) and are
not pinned (Ray places processes, not cores). The same seeded serving workload goes to each, closed loop with
``--concurrency`` requests in flight, through Tandem's client (benchmarks/serve_client.py), after a warm-up.
Reported: output tokens/s, TTFT and TPOT, the ratio Ray / `tandem up`, and each system's time to ready.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.machine import cpu_summary
from common.serving.port_reservation import reserve_ports

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = ROOT / "scripts" / "ray-loopback.sh"


@contextlib.contextmanager
def loopback_cluster(hosts: tuple[str, ...], units: int = 1) -> Iterator[tuple[str, dict[str, str], Path]]:
    """A Ray cluster of ``len(hosts)`` raylets on 127.0.0.1 (scripts/ray-loopback.sh), raylet i holding
    ``units`` of the custom resource ``hosts[i]``; yields its address, the environment to run ``tandem ray``
    with, and Ray's temporary directory (its session logs). Stopped (``ray stop --force``) on the way out."""
    temp_dir = Path(tempfile.mkdtemp(prefix="bray-", dir="/tmp"))  # Ray's socket paths must stay short
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHON": sys.executable}
    (port,) = reserve_ports(1)
    address = f"127.0.0.1:{port}"
    # Ray's worker processes on random (ephemeral) ports: its default range, 10002-19999, lies where
    # common.serving.port_reservation reserves Tandem's ports and this cluster's head port.
    common = ("--node-ip-address", "127.0.0.1", "--num-cpus", "2", "--object-store-memory", "80000000",
              "--min-worker-port", "0", "--max-worker-port", "0")

    def ray(*args: str) -> None:
        out = subprocess.run(["bash", str(LOOPBACK), *args], env=env, capture_output=True, text=True, timeout=120)
        if out.returncode:
            raise RuntimeError(f"ray {args[0]} failed: {out.stderr[-2000:]}")

    try:
        ray("start", "--head", "--port", str(port), "--temp-dir", str(temp_dir), "--include-dashboard", "false",
            "--disable-usage-stats", "--resources", json.dumps({hosts[0]: units}), *common)
        for host in hosts[1:]:
            ray("start", "--address", address, "--resources", json.dumps({host: units}), *common)
        yield address, env, temp_dir
    finally:
        subprocess.run(["bash", str(LOOPBACK), "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp_dir, ignore_errors=True)


@contextlib.contextmanager
def on_ray(model_args: tuple[str, ...], node_args: tuple[str, ...]) -> Iterator[str]:
    with loopback_cluster(("host_a", "host_b")) as (address, env, _):
        port, internal = reserve_ports(2)
        up = subprocess.run([sys.executable, "-m", "tandem_cli", "ray", "up", "--address", address, "--name", "bench",
                             "--prefill-resources", '{"host_a": 1}', "--decode-resources", '{"host_b": 1}',
                             "--port", str(port), "--internal-port", str(internal), *model_args,
                             *(f"--node-arg={a}" for a in node_args),
                             "--gateway-arg=--local-prefill-max-tokens", "--gateway-arg=0"],
                            env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
        if up.returncode:
            raise RuntimeError(f"tandem ray up failed: {up.stderr[-3000:]}")
        try:
            yield f"127.0.0.1:{port}"
        finally:
            subprocess.run([sys.executable, "-m", "tandem_cli", "ray", "down", "--address", address, "--name", "bench"],
                           env=env, capture_output=True, timeout=300, cwd=ROOT)


@contextlib.contextmanager
def tandem_up(model_args: tuple[str, ...], node_args: tuple[str, ...], log_dir: Path) -> Iterator[str]:
    from tandem_cli.launcher import Launcher, Topology

    topology = Topology(num_prefill=1, num_decode=1, free_ports=True, http_port=None, model_args=model_args,
                        node_args=node_args, gateway_args=("--local-prefill-max-tokens", "0"),
                        cpus=tuple(sorted(os.sched_getaffinity(0))))
    with Launcher(topology, log_dir=log_dir) as launcher:
        yield launcher.gateway.target


def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.bench_serve import resolve_dtype_name
    from benchmarks.serve_client import drive
    from benchmarks.serve_stats import summarize
    from benchmarks.workloads import ServingWorkload
    from common.config.model_config import ModelConfig
    from common.config.settings import ModelSettings, load_settings
    from common.model.model_store import resolve_model

    settings = load_settings(ModelSettings, {"model": args.model, "dtype": args.dtype})
    model_dir = resolve_model(settings.model, settings.home, progress=True)
    dtype = resolve_dtype_name(settings.dtype, settings.device)
    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    model_args = ("--model", str(model_dir), "--dtype", dtype)
    node_args = ("--enable-prefix-caching",)
    workload = ServingWorkload(num_requests=args.num_requests, prompt_len=(32, 256), output_len=(32, 128),
                               seed=args.seed)
    warm = ServingWorkload(num_requests=4, prompt_len=(48, 128), output_len=(4, 8), seed=args.seed + 1)
    log_dir = Path(tempfile.mkdtemp(prefix="tandem-bench-ray-"))
    systems = {"tandem up": lambda: tandem_up(model_args, node_args, log_dir),
               "ray": lambda: on_ray(model_args, node_args)}
    out: dict[str, Any] = {"model": model_dir.name, "dtype": dtype, "num_requests": args.num_requests,
                           "concurrency": args.concurrency, "workload": workload.describe(), "systems": {}}
    for name, start in systems.items():
        began = time.perf_counter()
        with start() as target:
            ready_s = time.perf_counter() - began
            asyncio.run(drive([target], warm.requests(vocab, float("inf")), None))
            records, duration = asyncio.run(drive([target], workload.requests(vocab, float("inf")),
                                                  args.concurrency))
        s = summarize(name, target, records, duration)
        out["systems"][name] = {"ready_s": ready_s, "completed": s.completed, "failed": s.failed,
                                "duration_s": duration, "output_tok_s": s.output_throughput,
                                "ttft_p50_ms": s.ttft_s.p50 * 1e3 if s.ttft_s else None,
                                "tpot_p50_ms": s.tpot_s.p50 * 1e3 if s.tpot_s else None}
        print(f"[bench] {name}: {s.completed}/{len(records)} in {duration:.1f} s, {s.output_throughput:.1f} tok/s",
              file=sys.stderr, flush=True)
    up, ray = out["systems"]["tandem up"], out["systems"]["ray"]
    out["ratio"] = ray["output_tok_s"] / up["output_tok_s"] if up["output_tok_s"] else None
    return out


def markdown(r: dict[str, Any]) -> str:
    rows = ["| system | ready (s) | completed / failed | output tok/s | TTFT p50 (ms) | TPOT p50 (ms) |",
            "|---|---:|---:|---:|---:|---:|"]
    for name, s in r["systems"].items():
        rows.append(f"| {name} | {s['ready_s']:.1f} | {s['completed']} / {s['failed']} | {s['output_tok_s']:.1f} | "
                    f"{s['ttft_p50_ms']:.0f} | {s['tpot_p50_ms']:.1f} |")
    ratio = r["ratio"]
    return "\n".join([
        f"{r['model']} ({r['dtype']}), {r['num_requests']} requests, {r['concurrency']} in flight: {r['workload']}. "
        f"CPU: {r['cpu']}.", "", *rows, "",
        f"Ray / `tandem up` output throughput: {ratio:.2f}x (goal >= 0.95x: {'met' if ratio >= 0.95 else 'not met'})."])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model directory (default: the bundled SmolLM2)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        import ray  # noqa: F401
    except ImportError:
        print("bench ray: needs Ray (make test-ray installs it: pip install -e '.[ray]')", file=sys.stderr)
        return 2
    result = run(args)
    result["cpu"] = cpu_summary()
    print(markdown(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`tandem up`: the whole system on this machine (the launcher, supervised), and its `--demo`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from common.config.settings import ModelSettings, SecuritySettings, env_name, flag_name, is_set, load_settings
from common.telemetry.settings import TelemetrySettings


def node_model_args(args: argparse.Namespace) -> tuple[str, ...]:
    """Model flags forwarded from ``tandem up`` to every process."""
    out: list[str] = []
    for name in ("model", "dtype", "attention_backend", "home", "quantization", "quantization_group_size",
                 "quantization_kernel", "parallel_collective"):
        value = getattr(args, name, None)
        if value is not None:
            out += ["--" + name.replace("_", "-"), str(value)]
    return tuple(out)


def add_role_layout_flags(up: argparse.ArgumentParser) -> None:
    g = up.add_argument_group("parallel nodes (each node's model over T x P rank processes; --tensor-parallel-size "
                              "and --pipeline-parallel-size set both roles)")
    for role in ("prefill", "decode"):
        g.add_argument(f"--{role}-tensor-parallel-size", type=int, default=None, help=f"T of {role} nodes")
        g.add_argument(f"--{role}-pipeline-parallel-size", type=int, default=None, help=f"P of {role} nodes")
    up.add_argument("--cpu-lending", action=argparse.BooleanOptionalAction, default=True,
                    help="prefill node i runs its layers on decode node i's cores too while that node is idle (CPU "
                         "nodes, each on cores of its own; default: on)")


def parallel_args(args: argparse.Namespace, role: str) -> tuple[str, ...]:
    """A role's layout: --{role}-tensor/pipeline-parallel-size, else --tensor/pipeline-parallel-size."""
    out: list[str] = []
    for kind in ("tensor", "pipeline"):
        value = getattr(args, f"{role}_{kind}_parallel_size", None) or getattr(args, f"{kind}_parallel_size", None)
        if value is not None:
            out += [f"--{kind}-parallel-size", str(value)]
    return tuple(out)


def settings_args(args: argparse.Namespace, cls: type) -> tuple[str, ...]:
    """The flags of ``cls``'s fields that were given to this command, as argv for a child process (fields
    not given stay unset there too: the child reads the same TANDEM_* variables)."""
    import dataclasses

    out: list[str] = []
    for f in dataclasses.fields(cls):
        value = getattr(args, f.name, None)
        flag = flag_name(f.name)
        if value is None:
            continue
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return tuple(out)


def cpu_lending(args: argparse.Namespace) -> bool:
    """``--cpu-lending`` (on unless ``--no-cpu-lending``) where the nodes can honour it: CPU nodes whose prefill
    model runs in the node's own process (common/engine/core_lending.py)."""
    flags = parallel_args(args, "prefill")
    layout = {flag.removeprefix("--").replace("-", "_"): int(value)
              for flag, value in zip(flags[::2], flags[1::2], strict=True)}
    prefill = load_settings(ModelSettings, {"device": getattr(args, "device", None), **layout})
    return bool(getattr(args, "cpu_lending", True)) and prefill.device == "cpu" and not prefill.parallel


def decode_args(args: argparse.Namespace) -> tuple[str, ...]:
    from common.config.settings import SpeculativeSettings

    return (*parallel_args(args, "decode"), *settings_args(args, SpeculativeSettings))


def cmd_up(args: argparse.Namespace) -> int:
    import signal
    import subprocess

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM stops the services as Ctrl-C does

    signal.signal(signal.SIGTERM, on_term)
    from tandem_cli.launcher import Launcher, RestartPolicy, Topology

    topology = Topology(num_prefill=args.prefill_nodes, num_decode=args.decode_nodes, gateway_port=args.port,
                        http_port=args.http_port or None, model_args=node_model_args(args),
                        decode_args=decode_args(args),
                        prefill_args=parallel_args(args, "prefill"),
                        metrics_base_port=args.metrics_base_port, cpu_lending=cpu_lending(args))
    # Services log to files (the terminal shows only what `tandem up` says, and the demo's text); with
    # --log-dir - they log to this terminal, in the key=value form that reads better there than JSON.
    to_terminal = args.log_dir == "-"
    home = load_settings(ModelSettings, {"home": getattr(args, "home", None)}).home
    log_dir = None if to_terminal else Path(args.log_dir) if args.log_dir else home / "logs"
    env = ({env_name("log_format", TelemetrySettings): "text"}
           if to_terminal and not is_set(TelemetrySettings, "log_format") else {})
    launcher = Launcher(topology, log_dir=log_dir, env=env, restart=RestartPolicy())
    # The CPU kernels once, here, rather than by every node under the launcher's health deadline (a cold
    # build takes minutes; built, this costs the few seconds of importing torch).
    subprocess.run([sys.executable, "-m", "common.kernels.prebuild"], check=False, stdout=sys.stderr)
    print(f"starting {args.prefill_nodes} prefill + {args.decode_nodes} decode nodes and the gateway...",
          file=sys.stderr)
    if log_dir is not None:
        names = ",".join(s.name for s in launcher.specs)
        print(f"service logs: {log_dir}/{{{names}}}.log", file=sys.stderr)
    with launcher:
        print(f"Tandem is up: gateway on {launcher.gateway.target} (Ctrl-C stops everything; a process that "
              f"exits is restarted)", file=sys.stderr)
        if launcher.gateway.http_port:
            scheme = "https" if load_settings(SecuritySettings).tls_cert else "http"
            print(f"  OpenAI-compatible HTTP API on {scheme}://127.0.0.1:{launcher.gateway.http_port}/v1",
                  file=sys.stderr)
        for spec in launcher.specs:
            metrics = f"  metrics=http://127.0.0.1:{spec.metrics_port}/metrics" if spec.metrics_port else ""
            print(f"  {spec.name:10s} {spec.target}  cpus={list(spec.cpus) or 'any'}{metrics}", file=sys.stderr)
        if args.demo:
            return _demo(launcher.gateway.target)
        try:
            while True:  # the launcher's supervisor restarts what exits; only a signal ends the deployment
                time.sleep(0.5)
        except KeyboardInterrupt:
            print("\nstopping...", file=sys.stderr)
            return 0


DEMO_PROMPTS = [
    "Write a haiku about two GPUs working in tandem.",
    "Explain in two sentences why prefill and decode are served by different machines.",
    "List three uses of a key-value cache.",
]


def _demo(target: str) -> int:
    from tandem_cli.client import ClientSecurity, build_request, stream_generate

    security = load_settings(ClientSecurity)  # TANDEM_API_KEY / TANDEM_TLS_*, as the services were given
    for prompt in DEMO_PROMPTS:
        print(f"\n>>> {prompt}", flush=True)
        result = stream_generate(target, build_request(prompt, True, 96, 0.0, 1.0, None, None),
                                 api_key=security.api_key, credentials=security.channel_credentials())
        print(f"\n[{result.num_tokens} tokens, finish {result.finish_reason}, time to first token "
              f"{result.ttft_s * 1000:.0f} ms, {result.num_tokens / max(result.total_s, 1e-9):.1f} tokens/s "
              f"end to end]", flush=True)
    return 0

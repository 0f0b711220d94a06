"""The ``tandem`` command line: ``tandem model prepare``, ``tandem generate``, ``tandem serve``, ``tandem drain``.

Flags and ``TANDEM_*`` environment variables fill the same settings fields (common.config.settings);
a flag that is given wins over the environment, which wins over the default.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.config.settings import (
    DTYPES,
    PARALLEL_COLLECTIVES,
    QUANTIZATION_METHODS,
    SPECULATIVE_METHODS,
    ModelSettings,
    NodeSettings,
    SecuritySettings,
    SpeculativeSettings,
    env_name,
    flag_name,
    load_settings,
)
from common.errors import EXIT_ADDRESS_IN_USE, AddressInUseError
from common.quant.config import INT4_GROUP_SIZES

if TYPE_CHECKING:
    from common.config.engine_config import SpeculativeConfig
    from common.telemetry.settings import TelemetrySettings
    from tandem_cli.client import ClientSecurity


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (flags override TANDEM_* environment variables)")
    g.add_argument("--model", help="local Hugging Face directory or the bundled model's name "
                   "[TANDEM_MODEL, default SmolLM2-135M-Instruct]")
    g.add_argument("--dtype", choices=DTYPES, help="[TANDEM_DTYPE, auto]")
    g.add_argument("--device", help="torch device [TANDEM_DEVICE, cpu]")
    g.add_argument("--attention-backend", dest="attention_backend", help="torch | triton | flash_attn | flashinfer "
                   "[TANDEM_ATTENTION_BACKEND, torch]")
    g.add_argument("--home", type=Path, help="Tandem's cache directory [TANDEM_HOME, ~/.cache/tandem]")
    g.add_argument("--threads", dest="num_threads", type=int, help="torch threads [TANDEM_NUM_THREADS]")
    g.add_argument("--quantization", choices=QUANTIZATION_METHODS,
                   help="packed weights; auto: a GGUF source keeps its own [TANDEM_QUANTIZATION, none]")
    g.add_argument("--quantization-group-size", dest="quantization_group_size", type=int, choices=INT4_GROUP_SIZES,
                   help="int4 weights per scale/zero group [TANDEM_QUANTIZATION_GROUP_SIZE, 32]")
    g.add_argument("--quantization-kernel", dest="quantization_kernel",
                   help="auto | tandem_cpu | torch | int_mm | triton | scaled_mm | reference "
                   "[TANDEM_QUANTIZATION_KERNEL, auto]")
    g.add_argument("--tensor-parallel-size", "-tp", dest="tensor_parallel_size", type=int,
                   help="split each layer over T rank processes [TANDEM_TENSOR_PARALLEL_SIZE, 1]")
    g.add_argument("--pipeline-parallel-size", "-pp", dest="pipeline_parallel_size", type=int,
                   help="split the layer stack into P stages [TANDEM_PIPELINE_PARALLEL_SIZE, 1]")
    g.add_argument("--expert-parallel", dest="expert_parallel", action="store_true", default=None,
                   help="a mixture of experts: whole experts split over the tensor-parallel ranks, not each "
                   "expert's columns [TANDEM_EXPERT_PARALLEL, off]")
    g.add_argument("--parallel-collective", dest="parallel_collective", choices=PARALLEL_COLLECTIVES,
                   help="tensor-parallel all-reduce between ranks on one host [TANDEM_PARALLEL_COLLECTIVE, shm]")


def _model_settings(args: argparse.Namespace) -> ModelSettings:
    keys = ("model", "dtype", "device", "attention_backend", "home", "num_threads", "quantization",
            "quantization_group_size", "quantization_kernel", "tensor_parallel_size", "pipeline_parallel_size",
            "expert_parallel", "parallel_collective")
    return load_settings(ModelSettings, {k: getattr(args, k, None) for k in keys})


def _client_security(args: argparse.Namespace) -> ClientSecurity:
    from tandem_cli.client import ClientSecurity

    return load_settings(ClientSecurity, _pick(args, ClientSecurity))


def cmd_model_prepare(args: argparse.Namespace) -> int:
    from common.model.model_store import prepare_default_model

    settings = _model_settings(args)
    path = prepare_default_model(settings.home, progress=True)
    print(path)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    if args.n < 1:
        raise ValueError(f"--n must be >= 1, got {args.n}")
    if args.url:
        from tandem_cli.client import build_request, stream_generate, stream_generate_http

        request = build_request(args.prompt, args.chat, args.max_tokens, args.temperature, args.top_p,
                                args.top_k, args.seed, args.stop, args.ignore_eos, args.n)
        import grpc

        security = _client_security(args)
        try:
            if args.url.startswith(("http://", "https://")):
                result = stream_generate_http(args.url, request, api_key=security.api_key,
                                              tls=security.ssl_context())
            else:
                result = stream_generate(args.url, request, api_key=security.api_key,
                                         credentials=security.channel_credentials())
        except grpc.RpcError as exc:  # the server's status, not a traceback (UNAUTHENTICATED: see --api-key)
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            print(f"\ntandem: {args.url}: {code.name if code else 'error'}: {details}", file=sys.stderr)
            return 1
        print(f"\n[{result.num_tokens} tokens, finish {result.finish_reason}, time to first token "
              f"{result.ttft_s * 1000:.0f} ms, cached prompt tokens {result.usage.cached_tokens}]", file=sys.stderr)
        return 0
    from tandem_cli.triton_import import block_unused_triton

    settings = _model_settings(args)
    block_unused_triton(settings)  # before torch loads
    import torch

    from common.engine.llm import LLM
    from common.sampling.params import SamplingParams

    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    spec = _speculative(args)
    llm = LLM(settings.model, dtype=settings.dtype, device=settings.device,
              attention_backend=settings.attention_backend, quantization=settings.quantization,
              quantization_group_size=settings.quantization_group_size,
              quantization_kernel=settings.quantization_kernel, speculative=spec if spec.enabled else None,
              tensor_parallel_size=settings.tensor_parallel_size,
              pipeline_parallel_size=settings.pipeline_parallel_size,
              expert_parallel=settings.expert_parallel, parallel_collective=settings.parallel_collective)
    # n samples: one prompt each, seeds seed + i (as the servers do), sample 0 streamed, the others after.
    params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                             seed=None if args.seed is None else args.seed + i, max_tokens=args.max_tokens,
                             ignore_eos=args.ignore_eos) for i in range(args.n)]
    prompt_ids = llm.encode(args.prompt, chat=args.chat)
    if not args.chat:
        sys.stdout.write(args.prompt)
    start = time.perf_counter()
    first: float | None = None
    count = 0
    others: list[list[str]] = [[] for _ in range(args.n)]
    with llm:  # a T x P engine stops its ranks at the end
        for delta in llm.stream([prompt_ids] * args.n, params):
            first = first or time.perf_counter()
            count += len(delta.token_ids)
            if delta.index:
                others[delta.index].append(delta.text)
                continue
            sys.stdout.write(delta.text)
            sys.stdout.flush()
    end = time.perf_counter()
    for i in range(1, args.n):
        sys.stdout.write(f"\n[sample {i}]\n{''.join(others[i])}")
    sys.stdout.write("\n")
    decode_rate = (count - 1) / (end - first) if first and count > 1 else 0.0
    print(f"[{count} tokens, prompt {len(prompt_ids)} tokens, time to first token "
          f"{((first or end) - start) * 1000:.0f} ms, decode {decode_rate:.1f} tokens/s, "
          f"dtype {llm.model.dtype}, quantization {settings.quantization}, "
          f"{getattr(llm.engine.runner, 'weight_bytes', llm.model.weight_bytes) / 1e6:.0f} MB of weights"
          + (f", tensor parallel {settings.tensor_parallel_size} x pipeline {settings.pipeline_parallel_size}"
             if settings.parallel else "") + "]", file=sys.stderr)
    return 0


def add_settings_flags(p: argparse.ArgumentParser, cls: type, title: str, skip: tuple[str, ...] = (),
                       helps: dict[str, str] | None = None) -> None:
    """One flag per settings field (``--kv-timeout-s`` for ``kv_timeout_s``), default None so that
    TANDEM_* variables and the field defaults apply when a flag is not given. Its help: ``helps``'s text or
    the field's own (``help`` in its metadata, as the engine configs' knobs carry it), its choices, then its
    variable's name."""
    import dataclasses
    import types
    import typing

    hints = typing.get_type_hints(cls)
    group = p.add_argument_group(title)
    for f in dataclasses.fields(cls):
        flag = flag_name(f.name)
        if f.name in skip:
            continue
        hint = hints[f.name]
        if isinstance(hint, types.UnionType):  # X | None: the flag takes an X
            hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
        text = (helps or {}).get(f.name) or f.metadata.get("help", "")
        help_text = f"{text} [{env_name(f.name, cls)}{_default_text(f)}]".lstrip()
        choices = f.metadata.get("choices") or None
        kwargs: dict[str, Any] = ({"action": argparse.BooleanOptionalAction} if hint is bool
                                  else {"type": hint, "choices": choices} if hint in (int, float)
                                  else {"choices": choices})
        try:
            group.add_argument(flag, dest=f.name, default=None, help=help_text, **kwargs)
        except argparse.ArgumentError:  # a field two settings classes share: its first flag serves both
            continue


def _default_text(f: Any) -> str:
    """A field's default as ``--help`` shows it after its variable (nothing for an empty or unset one)."""
    import dataclasses

    if f.metadata.get("by_device"):
        return ", by device"
    if f.default is dataclasses.MISSING or f.default in (None, ""):
        return ""
    if isinstance(f.default, bool):
        return ", on" if f.default else ", off"
    return f", {f.default}"


def _pick(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    import dataclasses

    return {f.name: getattr(args, f.name, None) for f in dataclasses.fields(cls)}


def cmd_serve(args: argparse.Namespace) -> int:
    from common.telemetry.settings import TelemetrySettings
    from common.telemetry.tracing import shutdown_tracing

    telemetry = load_settings(TelemetrySettings, _pick(args, TelemetrySettings))
    security = load_settings(SecuritySettings, _pick(args, SecuritySettings))
    if args.role == "gateway":
        from common.model.model_store import resolve_model
        from gateway.server import run_gateway
        from gateway.settings import GatewaySettings

        overrides = _pick(args, GatewaySettings)
        overrides["prefill_targets"] = args.prefill
        overrides["decode_targets"] = args.decode
        if overrides.get("model_dir") is None:
            settings = _model_settings(args)
            overrides["model_dir"] = str(resolve_model(settings.model, settings.home, progress=False))
        gateway = load_settings(GatewaySettings, overrides)
        _start_telemetry(telemetry, "gateway", "gateway")
        try:
            run_gateway(gateway, security)
        finally:
            shutdown_tracing()  # after the graceful stop (SIGTERM included): export what is queued
        return 0
    node = load_settings(NodeSettings, _pick(args, NodeSettings))
    from tandem_cli.triton_import import block_unused_triton

    block_unused_triton(_model_settings(args))  # before torch loads: no nanobind leak reports at exit
    _start_telemetry(telemetry, args.role, node.node_id or args.role)
    try:
        if args.role == "prefill":
            from prefill_service.server import run_prefill

            run_prefill(_model_settings(args), node, security)
        elif args.role == "colocated":
            from tandem_cli.colocated_server import run_colocated

            run_colocated(_model_settings(args), node, _colocated_public_settings(args), _speculative(args), security)
        else:
            from decode_service.server import run_decode

            run_decode(_model_settings(args), node, _speculative(args), security)
    finally:
        shutdown_tracing()
    return 0


def _start_telemetry(telemetry: TelemetrySettings, role: str, node_id: str) -> None:
    """Structured logs and (when the OTEL_* variables or --trace-console ask) tracing, before any server starts."""
    from common.telemetry.logs import configure_logging
    from common.telemetry.tracing import setup_tracing

    configure_logging(telemetry, service=node_id)
    setup_tracing(role, node_id, telemetry)


def _colocated_public_settings(args: argparse.Namespace) -> Any:
    """The public side of ``serve colocated``: the process is its own (only) prefill and decode node."""
    import dataclasses

    from common.model.model_store import resolve_model
    from gateway.settings import GatewaySettings

    overrides = _pick(args, GatewaySettings)
    settings = _model_settings(args)
    overrides["model_dir"] = str(resolve_model(settings.model, settings.home, progress=False))  # the engine's model
    overrides["prefill_targets"] = overrides["decode_targets"] = "colocated:0"  # replaced below
    public = load_settings(GatewaySettings, overrides)
    return dataclasses.replace(public, prefill_targets=(public.address,), decode_targets=(public.address,))


def cmd_health(args: argparse.Namespace) -> int:
    from common.serving.security import channel_credentials
    from tandem_cli.launcher import check_health

    credentials = channel_credentials(load_settings(SecuritySettings, _pick(args, SecuritySettings)))
    status = check_health(args.target, args.timeout, args.service, credentials)
    print(f"{args.target}: {status}")
    return 0 if status == "SERVING" else 1


def cmd_drain(args: argparse.Namespace) -> int:
    import asyncio

    import grpc

    from common.serving.security import ChannelFactory
    from tandem.v1 import membership_pb2, membership_pb2_grpc

    security = load_settings(SecuritySettings, _pick(args, SecuritySettings))

    async def drain() -> membership_pb2.DrainResponse:
        async with ChannelFactory(security)(args.gateway) as channel:
            request = membership_pb2.DrainRequest(node_id=args.node_id, timeout_seconds=args.timeout)
            return await membership_pb2_grpc.MembershipStub(channel).Drain(request, timeout=args.timeout + 10.0)

    try:
        reply = asyncio.run(drain())
    except grpc.aio.AioRpcError as exc:
        print(f"tandem: error: drain {args.node_id}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(f"node {args.node_id} ({reply.address}) drained in {reply.seconds:.1f} s and deregistered")
    return 0


def kernel_settings_help() -> str:
    """The CPU kernel settings (``KernelSettings``: environment variables only), for ``tandem --help``."""
    import dataclasses

    from common.config.settings import CPU_ISAS, KERNEL_MODES, KernelSettings

    lines = ["CPU kernel settings (environment variables; docs/cpu-kernels.md):"]
    for f in dataclasses.fields(KernelSettings):
        if f.type in (bool, "bool"):
            choices = "1|0"
        elif f.name == "cpu_isa":
            choices = "|".join(CPU_ISAS)
        else:
            choices = "|".join(KERNEL_MODES)
        default = "1" if f.default is True else (f.default or "the CPU's widest")
        lines.append(f"  {env_name(f.name)}={choices} (default {default})")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem: disaggregated LLM serving",
                                     epilog=kernel_settings_help(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="manage models")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    prepare = model_sub.add_parser("prepare", help="convert the bundled SmolLM2 GGUF into Tandem's cache")
    _add_model_flags(prepare)
    prepare.set_defaults(func=cmd_model_prepare)

    gen = sub.add_parser("generate", help="stream a generation, offline (no server) or from a server (--url)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable; with --url)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens "
                     "(exactly --max-tokens tokens, unless a stop string ends it)")
    gen.add_argument("--n", type=int, default=1, help="samples of the prompt (they share its KV through the prefix "
                     "cache on a server)")
    gen.add_argument("--url", help="stream from a running server instead of running offline: host:port (gRPC) or "
                     "http(s)://host:port (the OpenAI-compatible HTTP API)")
    from tandem_cli.client import ClientSecurity

    add_settings_flags(gen, ClientSecurity, "with --url: the server's credentials (docs/security.md)")
    _add_model_flags(gen)
    _add_speculative_flags(gen)
    gen.set_defaults(func=cmd_generate)

    from common.telemetry.settings import TelemetrySettings
    from gateway.settings import GatewaySettings

    serve = sub.add_parser("serve", help="run one service")
    serve_sub = serve.add_subparsers(dest="role", required=True)
    for role in ("prefill", "decode"):
        p = serve_sub.add_parser(role, help=f"a {role} node")
        _add_model_flags(p)
        add_settings_flags(p, NodeSettings, "node (flags override TANDEM_* environment variables)")
        if role == "decode":
            _add_speculative_flags(p)
        add_settings_flags(p, SecuritySettings, _SECURITY_FLAGS)
        add_settings_flags(p, TelemetrySettings, _TELEMETRY_FLAGS)
        p.set_defaults(func=cmd_serve)
    gw = serve_sub.add_parser("gateway", help="the public gRPC gateway (no torch)")
    _add_model_flags(gw)
    add_settings_flags(gw, GatewaySettings, "gateway (flags override TANDEM_* environment variables)",
                       skip=("prefill_targets", "decode_targets", "dtype"))
    gw.add_argument("--prefill", help="comma-separated host:port of the prefill nodes [TANDEM_PREFILL_TARGETS]")
    gw.add_argument("--decode", help="comma-separated host:port of the decode nodes [TANDEM_DECODE_TARGETS]")
    add_settings_flags(gw, SecuritySettings, _SECURITY_FLAGS)
    add_settings_flags(gw, TelemetrySettings, _TELEMETRY_FLAGS)
    gw.set_defaults(func=cmd_serve)
    colo = serve_sub.add_parser("colocated", help="the public API over one engine that prefills and decodes "
                                "(small deployments; the benchmark's baseline)")
    _add_model_flags(colo)
    add_settings_flags(colo, GatewaySettings, "public API (flags override TANDEM_* environment variables)",
                       skip=("model_dir", "prefill_targets", "decode_targets", "dtype", "kv_timeout_s",
                             "stats_interval_s", "affinity_capacity", "affinity_load_slack", "internal_port",
                             "node_drop_after_s"))
    add_settings_flags(colo, NodeSettings, "engine (flags override TANDEM_* environment variables)",
                       skip=("kv_store_port", "advertise_host", "kv_timeout_s", "grace_s", "gateway",
                             "register_interval_s", "host_id"))
    _add_speculative_flags(colo)
    add_settings_flags(colo, SecuritySettings, _SECURITY_FLAGS, skip=("internal_token",))
    add_settings_flags(colo, TelemetrySettings, _TELEMETRY_FLAGS)
    colo.set_defaults(func=cmd_serve)

    health = sub.add_parser("health", help="gRPC health check of a service: exit 0 when it is SERVING, else 1")
    health.add_argument("--target", required=True, help="host:port of the service")
    health.add_argument("--service", default="", help="service name to ask about (default: the whole server)")
    health.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    add_settings_flags(health, SecuritySettings, "TLS (a node with --tls-ca also wants a client certificate)",
                       skip=("internal_token",))
    health.set_defaults(func=cmd_health)

    drain = sub.add_parser("drain", help="take a registered node out of a running gateway: no new requests, its "
                           "in-flight ones finish, its KV blocks are released, then it is deregistered")
    drain.add_argument("node_id", metavar="NODE_ID", help="the node's id (--node-id; default <role>-<port>)")
    drain.add_argument("--gateway", default=os.environ.get(env_name("gateway")) or None,
                       required=not os.environ.get(env_name("gateway")),
                       help="host:port of the gateway's internal port (its --internal-port) [TANDEM_GATEWAY]")
    drain.add_argument("--timeout", type=float, default=300.0,
                       help="seconds the node gets to finish its requests (the gateway routes it again after them)")
    add_settings_flags(drain, SecuritySettings, "security: the cluster's TLS and token (the internal port "
                       "asks for them as the nodes' services do)")
    drain.set_defaults(func=cmd_drain)

    from tandem_cli.plugins import add_plugin_commands

    add_plugin_commands(sub)

    up = sub.add_parser("up", help="start gateway + prefill + decode nodes as local processes")
    up.add_argument("--prefill-nodes", type=int, default=1)
    up.add_argument("--decode-nodes", type=int, default=1)
    up.add_argument("--port", type=int, default=50051, help="the gateway's port")
    up.add_argument("--http-port", type=int, default=8000, help="the gateway's OpenAI-compatible HTTP API (0: off)")
    up.add_argument("--log-dir", help="write each service's log here (default: $TANDEM_HOME/logs; '-': this "
                    "terminal)")
    up.add_argument("--demo", action="store_true", help="stream a few generations through the gateway, then stop")
    up.add_argument("--metrics-base-port", type=int, default=None,
                    help="serve /metrics: the gateway on this port, then each prefill and decode node on the next ones")
    _add_model_flags(up)
    from tandem_cli.up_command import add_role_layout_flags, cmd_up

    add_role_layout_flags(up)
    _add_speculative_flags(up)

    up.set_defaults(func=cmd_up)

    from tandem_cli.ray_command import add_ray_parser

    add_ray_parser(sub, _add_model_flags, _add_speculative_flags)
    return parser


_SECURITY_FLAGS = ("security: TLS / mutual TLS and the cluster token, all off by default (docs/security.md); "
                   "flags override TANDEM_* environment variables")

_TELEMETRY_FLAGS = ("telemetry: traces export when OTEL_EXPORTER_OTLP_ENDPOINT is set (and the other OTEL_* "
                    "variables); /metrics with --metrics-port")


def _speculative(args: argparse.Namespace) -> SpeculativeConfig:
    """The speculative-decoding settings (flags over ``TANDEM_*`` variables) as the engine's config."""
    return load_settings(SpeculativeSettings, _pick(args, SpeculativeSettings)).config()


_SPECULATIVE_HELP = {
    "speculative": f"{' | '.join(SPECULATIVE_METHODS)}",
    "draft_model": "draft_model: a Llama-family directory with the target's tokenizer, or the bundled model's name "
                   "(with --draft-quantization int4: the target as its draft)",
    "speculative_ngram_first": "draft_model: n-gram lookup in the request's own tokens first, the draft model "
                               "where it finds nothing",
    "speculative_ngram_max_tokens": "with --speculative-ngram-first: the lookup's own limit (0: "
                                    "--num-speculative-tokens)",
}


def _add_speculative_flags(p: argparse.ArgumentParser) -> None:
    add_settings_flags(p, SpeculativeSettings, "speculative decoding (decode nodes; flags override TANDEM_* "
                       "environment variables)", helps=_SPECULATIVE_HELP)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result: Any = args.func(args)
    except ValueError as exc:  # caller mistakes: say what and exit 2, no traceback
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2
    except AddressInUseError as exc:  # a launcher that chose the port may choose another (tandem_cli/launcher.py)
        print(f"tandem: error: {exc}", file=sys.stderr)
        return EXIT_ADDRESS_IN_USE
    return int(result)


if __name__ == "__main__":
    sys.exit(main())

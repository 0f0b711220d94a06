"""``tandem ray up | scale | down | status``: a Tandem deployment on a Ray cluster (docs/multi-machine.md).

Needs the ``ray`` extra (``pip install 'tandem-serve[ray]'``); the rest of Tandem never imports Ray.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any


def _failing_clearly(func: Any) -> Any:
    """A start, scale or stop that could not finish: one line on stderr, exit 1 (ValueError: the caller's
    mistake, exit 2 through ``main``)."""
    import functools

    @functools.wraps(func)
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return int(func(args))
        except (TimeoutError, RuntimeError) as exc:
            print(f"tandem: error: {exc}", file=sys.stderr)
            return 1

    return wrapper


def _ray_or_exit() -> None:
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ValueError("tandem ray needs Ray: pip install 'tandem-serve[ray]'") from None


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", required=True, help="the Ray cluster's head (host:port of its GCS, as `ray start "
                   "--head` printed; 'auto': the cluster this machine belongs to)")
    p.add_argument("--name", default="tandem", help="the deployment's name (its actors are DEPLOYMENT:ROLE-I in "
                   "Ray's 'tandem' namespace)")


@_failing_clearly
def cmd_ray_up(args: argparse.Namespace) -> int:
    from tandem_cli.ray_cluster import RayDeployment, connect
    from tandem_cli.ray_deploy import DeploymentSpec, parse_resources
    from tandem_cli.up_command import decode_args, node_model_args, parallel_args

    _ray_or_exit()

    def ranks(role: str) -> int:
        flags = parallel_args(args, role)
        sizes = dict(zip(flags[::2], (int(v) for v in flags[1::2]), strict=True))
        return sizes.get("--tensor-parallel-size", 1) * sizes.get("--pipeline-parallel-size", 1)

    spec = DeploymentSpec(
        name=args.name, model_args=node_model_args(args), node_args=tuple(args.node_arg or ()),
        prefill_args=parallel_args(args, "prefill"), decode_args=decode_args(args),
        gateway_args=tuple(args.gateway_arg or ()),
        prefill_resources=parse_resources(args.prefill_resources, "--prefill-resources"),
        decode_resources=parse_resources(args.decode_resources, "--decode-resources"),
        gateway_resources=parse_resources(args.gateway_resources, "--gateway-resources")[0]
        if args.gateway_resources else {},
        prefill_ranks=ranks("prefill"), decode_ranks=ranks("decode"), gateway_port=args.port,
        http_port=args.http_port, internal_port=args.internal_port, placement_timeout_s=args.placement_timeout_s)
    connect(args.address)
    print(f"starting {args.prefill_nodes} prefill + {args.decode_nodes} decode nodes and the gateway on Ray at "
          f"{args.address}...", file=sys.stderr)
    deployment = RayDeployment(spec)
    info = deployment.up(args.prefill_nodes, args.decode_nodes)
    print(f"Tandem is up on Ray: gateway on {info['address']} (Ray node {info['ray_node_id'][:12]}); "
          f"`tandem ray down --address {args.address} --name {args.name}` stops it", file=sys.stderr)
    _print_status(args.name)
    return 0


@_failing_clearly
def cmd_ray_scale(args: argparse.Namespace) -> int:
    from tandem_cli.ray_cluster import RayDeployment, connect, load_spec

    _ray_or_exit()
    if args.prefill is None and args.decode is None:
        raise ValueError("tandem ray scale: give --prefill N and/or --decode M")
    connect(args.address)
    result = apply_scale(RayDeployment(load_spec(args.name)), args.prefill, args.decode)
    print(f"scaled {args.name}: added {', '.join(result['added']) or 'none'}; drained and removed "
          f"{', '.join(result['removed']) or 'none'}", file=sys.stderr)
    _print_status(args.name)
    return 0


def apply_scale(deployment: Any, prefill: int | None, decode: int | None) -> dict[str, list[str]]:
    """The one path that changes a running deployment's pools (``tandem ray scale``, ``tandem plan --apply``)."""
    return dict(deployment.scale({"prefill": prefill, "decode": decode}))


@_failing_clearly
def cmd_ray_down(args: argparse.Namespace) -> int:
    from tandem_cli.ray_cluster import RayDeployment, connect, load_spec

    _ray_or_exit()
    connect(args.address)
    stopped = RayDeployment(load_spec(args.name)).down()
    print(f"stopped {args.name}: {', '.join(stopped)}", file=sys.stderr)
    return 0


@_failing_clearly
def cmd_ray_status(args: argparse.Namespace) -> int:
    from tandem_cli.ray_cluster import connect, load_spec

    _ray_or_exit()
    connect(args.address)
    load_spec(args.name)
    _print_status(args.name)
    return 0


def status(name: str) -> list[dict[str, Any]]:
    """Each member's actor info (address, Ray node, pids), the gateway first."""
    import ray

    from tandem_cli.ray_cluster import CALL_TIMEOUT_S, actor, members

    names = ["gateway", *(m.name for m in members(name))]
    return [dict(ray.get(actor(name, n).info.remote(), timeout=CALL_TIMEOUT_S)) for n in names]


def _print_status(name: str) -> None:
    for info in status(name):
        print(json.dumps(info))


def add_ray_parser(sub: Any, add_model_flags: Callable[[Any], None],
                   add_speculative_flags: Callable[[Any], None]) -> None:
    """``tandem ray``; the model and speculative flags are the caller's (tandem_cli.cli), passed in so this module
    does not import it back."""
    from tandem_cli.up_command import add_role_layout_flags

    ray = sub.add_parser("ray", help="run Tandem on a Ray cluster: more than one machine (docs/multi-machine.md)")
    ray_sub = ray.add_subparsers(dest="ray_command", required=True)
    up = ray_sub.add_parser("up", help="place the gateway and the prefill and decode nodes on the Ray cluster")
    _common(up)
    up.add_argument("--prefill-nodes", type=int, default=1)
    up.add_argument("--decode-nodes", type=int, default=1)
    up.add_argument("--port", type=int, default=50051, help="the gateway's public gRPC port")
    up.add_argument("--http-port", type=int, default=0, help="the gateway's OpenAI-compatible HTTP API (0: off)")
    up.add_argument("--internal-port", type=int, default=50052, help="the gateway's Membership port (nodes "
                    "register there)")
    for role in ("prefill", "decode"):
        up.add_argument(f"--{role}-resources", default='{"CPU": 1}',
                        help=f"Ray resources of each rank of a {role} node, JSON: an object (every node) or a list "
                             "of objects (node i takes entry i mod n), e.g. '{\"GPU\": 1}' or '{\"host_a\": 1}'")
    up.add_argument("--gateway-resources", default=None, help="Ray resources the gateway's actor needs, JSON")
    up.add_argument("--placement-timeout-s", type=float, default=60.0,
                    help="how long a node's placement group may wait for resources before the command fails")
    up.add_argument("--node-arg", action="append", help="an extra flag for every node (repeat: --node-arg=--num-"
                    "blocks --node-arg=256)")
    up.add_argument("--gateway-arg", action="append", help="an extra flag for the gateway (repeatable)")
    add_model_flags(up)
    add_role_layout_flags(up)
    add_speculative_flags(up)
    up.set_defaults(func=cmd_ray_up)

    scale = ray_sub.add_parser("scale", help="change a running deployment's pools: new nodes serve before it "
                               "returns; removed ones are drained first")
    _common(scale)
    scale.add_argument("--prefill", type=int, default=None, help="prefill nodes wanted")
    scale.add_argument("--decode", type=int, default=None, help="decode nodes wanted")
    scale.set_defaults(func=cmd_ray_scale)

    down = ray_sub.add_parser("down", help="stop a deployment: nodes, then the gateway")
    _common(down)
    down.set_defaults(func=cmd_ray_down)

    st = ray_sub.add_parser("status", help="each member's address, Ray node and process, as JSON lines")
    _common(st)
    st.set_defaults(func=cmd_ray_status)

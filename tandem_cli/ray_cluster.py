"""A Tandem deployment on a Ray cluster: start it (``up``), change its pools (``scale``), stop it (``down``).

Every call is bounded: an unreachable ``--address`` fails before Ray is asked anything, a placement group no
Ray node can hold fails after ``placement_timeout_s`` naming the flag of the resources it asked for, and a
start that fails removes what it had created.
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import time
from dataclasses import dataclass
from typing import Any

from tandem_cli.ray_deploy import NAMESPACE, DeploymentSpec, TandemProcess, actor_name

START_TIMEOUT_S = 300.0  # a node loads its model and answers health within this
STOP_GRACE_S = 10.0
CALL_TIMEOUT_S = 30.0  # a Ray control call to an actor (info, stop)

def connect(address: str, timeout_s: float = 5.0) -> None:
    """Join the Ray cluster at ``address`` (host:port of its GCS) as a driver in Tandem's namespace. A port
    that answers nothing fails here within ``timeout_s``, not in Ray's own retries."""
    import ray

    if address != "auto":
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"--address: {address!r} is not host:port (the Ray head's GCS, 6379 by default)")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
        except OSError as exc:
            raise ValueError(f"--address {address}: no Ray cluster answers there ({exc.strerror or exc})") from None
    if address.startswith(("127.", "localhost:", "[::1]:")):
        _stay_on_loopback()
    # A restartable detached actor in a placement group is what a Tandem node is: the group's removal ends it.
    logging.getLogger("ray.actor").setLevel(logging.ERROR)
    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)

def _stay_on_loopback() -> None:
    """Ray turns a loopback address into this machine's interface address ("localhost isn't remotely
    reachable"), which a one-box cluster started on 127.0.0.1 does not listen on: keep the driver on loopback
    as ``scripts/ray-loopback.sh`` keeps the raylets (docs/multi-machine.md)."""
    import ray._private.services as services

    services.node_ip_address_from_perspective = lambda *args, **kwargs: "127.0.0.1"  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Member:
    name: str  # "prefill-0", "decode-2", "gateway"
    role: str
    index: int

_MEMBER = re.compile(r"^(prefill|decode)-(\d+)$")

def members(deployment: str) -> list[Member]:
    """The deployment's prefill and decode nodes, by their named actors."""
    import ray

    out = []
    for name in ray.util.list_named_actors():
        dep, _, member = name.partition(":")
        if dep == deployment and (m := _MEMBER.match(member)):
            out.append(Member(member, m.group(1), int(m.group(2))))
    return sorted(out, key=lambda m: (m.role, m.index))

def deployments() -> list[str]:
    import ray

    return sorted({n.partition(":")[0] for n in ray.util.list_named_actors() if n.endswith(":gateway")})

def actor(deployment: str, member: str) -> Any:
    import ray

    return ray.get_actor(actor_name(deployment, member), namespace=NAMESPACE)

def load_spec(deployment: str) -> DeploymentSpec:
    """The running deployment's record, from its gateway actor; a clear error for a name that runs nothing."""
    import ray

    try:
        gateway = actor(deployment, "gateway")
    except ValueError:
        running = ", ".join(deployments()) or "none"
        raise ValueError(f"--name {deployment}: no Tandem deployment of that name on this Ray cluster "
                         f"(running: {running})") from None
    return DeploymentSpec.from_json(ray.get(gateway.spec.remote(), timeout=CALL_TIMEOUT_S))

def _node_resources() -> list[dict[str, float]]:
    """Each alive Ray node's resources, without Ray's own bookkeeping (placement-group and node: entries)."""
    import ray

    return [{k: v for k, v in node["Resources"].items() if "_group_" not in k and not k.startswith("node:")
             and k not in ("memory", "object_store_memory")} for node in ray.nodes() if node["Alive"]]


class RayDeployment:
    """One deployment's actors, by name; the methods block until the change is done (or raise)."""

    def __init__(self, spec: DeploymentSpec) -> None:
        self.spec = spec

    @property
    def gateway_info(self) -> dict[str, Any]:
        import ray

        return dict(ray.get(actor(self.spec.name, "gateway").info.remote(), timeout=CALL_TIMEOUT_S))

    @property
    def internal_address(self) -> str:
        host = self.gateway_info["address"].rpartition(":")[0]
        return f"{host}:{self.spec.internal_port}"

    def up(self, num_prefill: int, num_decode: int) -> dict[str, Any]:
        """Start the gateway, then the nodes; on any failure stop what was started and raise."""
        import ray

        if self.spec.name in deployments():
            raise ValueError(f"--name {self.spec.name}: a deployment of that name runs already "
                             f"(`tandem ray down --name {self.spec.name}` first)")
        if num_prefill < 1 or num_decode < 1:
            raise ValueError("--prefill-nodes and --decode-nodes must be >= 1")
        try:
            args = [*self.spec.model_args, *self.spec.gateway_args, "--internal-port", str(self.spec.internal_port)]
            if self.spec.http_port:
                args += ["--http-port", str(self.spec.http_port)]
            options: dict[str, Any] = {"num_cpus": 0}
            if self.spec.gateway_resources:
                options["resources"] = dict(self.spec.gateway_resources)
            gateway = self._actor_class("gateway", **options).remote(
                "gateway", "gateway", args, [self.spec.gateway_port], spec=self.spec.to_json())
            ref = gateway.wait_serving.remote(START_TIMEOUT_S)
            ready, _ = ray.wait([ref], timeout=self.spec.placement_timeout_s + START_TIMEOUT_S)
            if not ready:
                raise TimeoutError(f"the gateway did not start (--gateway-resources {self.spec.gateway_resources} "
                                   f"on no Ray node?)")
            info = ray.get(ref)
            self._add({"prefill": num_prefill, "decode": num_decode})
        except BaseException:
            self.down()
            raise
        return info

    def scale(self, target: dict[str, int | None]) -> dict[str, list[str]]:
        """Bring each role's pool to ``target[role]`` nodes (None: unchanged): new nodes are started and
        serve before this returns; removed ones (the highest indices) are drained first, then stopped."""
        for role, n in target.items():
            if n is not None and n < 1:
                raise ValueError(f"--{role}: a deployment keeps at least one {role} node (asked for {n})")
        current = members(self.spec.name)
        added = self._add({role: max(0, (n or 0) - sum(m.role == role for m in current))
                           for role, n in target.items() if n is not None})
        removed = []
        for role, n in target.items():
            mine = [m for m in current if m.role == role]
            if n is not None and len(mine) > n:
                for m in sorted(mine, key=lambda m: -m.index)[: len(mine) - n]:
                    self._drain(m.name)
                    self._remove(m.name)
                    removed.append(m.name)
        return {"added": added, "removed": removed}

    def down(self) -> list[str]:
        """Stop the nodes, then the gateway; remove their placement groups. What is stopped, by name."""
        stopped = [m.name for m in members(self.spec.name)]
        for name in stopped:
            self._remove(name)
        self._remove("gateway")
        return [*stopped, "gateway"]

    # -- nodes --

    def _actor_class(self, member: str, **options: Any) -> Any:
        """A detached, named actor class that Ray restarts whenever it dies (until ``_remove`` kills it)."""
        import ray

        return ray.remote(TandemProcess).options(name=actor_name(self.spec.name, member), namespace=NAMESPACE,
                                                 lifetime="detached", max_restarts=-1, max_task_retries=0,
                                                 max_concurrency=4, **options)

    def _add(self, counts: dict[str, int]) -> list[str]:
        """Start ``counts[role]`` more nodes of each role at the lowest free indices; wait until each serves
        and the gateway routes to it."""
        import ray

        taken = {m.name for m in members(self.spec.name)}
        internal = self.internal_address
        started: list[tuple[str, Any]] = []
        for role, n in counts.items():
            index = 0
            for _ in range(n):
                while f"{role}-{index}" in taken:
                    index += 1
                name = f"{role}-{index}"
                taken.add(name)
                started.append((name, self._start_node(role, index, name, internal)))
        refs = [actor.wait_serving.remote(START_TIMEOUT_S) for _, actor in started]
        ray.get(refs, timeout=START_TIMEOUT_S + 30)
        self._wait_routed([name for name, _ in started])
        return [name for name, _ in started]

    def _start_node(self, role: str, index: int, name: str, internal: str) -> Any:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        resources = self.spec.resources(role, index)
        ranks = self.spec.ranks(role)
        pg = placement_group([dict(resources) for _ in range(ranks)], strategy="STRICT_PACK",
                             name=actor_name(self.spec.name, name), lifetime="detached")
        ready, _ = ray.wait([pg.ready()], timeout=self.spec.placement_timeout_s)
        if not ready:
            remove_placement_group(pg)
            raise ValueError(f"{name}: no Ray node can hold {ranks} x {resources} (--{role}-resources) within "
                             f"{self.spec.placement_timeout_s:g} s; the cluster's nodes have {_node_resources()}")
        args = [*self.spec.model_args, *self.spec.node_args, *getattr(self.spec, f"{role}_args"),
                "--gateway", internal, "--register-interval-s", "1"]
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0)
        return self._actor_class(name, num_cpus=0, scheduling_strategy=strategy).remote(role, name, args, [])

    def _wait_routed(self, names: list[str], timeout_s: float = 60.0) -> None:
        """Until the gateway lists each node reachable (its registration arrived and a Stats poll answered)."""
        import grpc

        from tandem.v1 import generate_pb2, generate_pb2_grpc

        target = self.gateway_info["address"]
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with grpc.insecure_channel(target) as channel:
                    nodes = generate_pb2_grpc.TandemStub(channel).GetLoads(generate_pb2.GetLoadsRequest(),
                                                                           timeout=5).nodes
                if set(names) <= {n.node_id for n in nodes if n.reachable}:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gateway at {target} did not route to {', '.join(names)} within "
                                   f"{timeout_s:.0f} s")
            time.sleep(0.2)

    def _drain(self, name: str, timeout_s: float = 300.0) -> None:
        """The gateway's Membership Drain: no new requests; returns once the node holds nothing."""
        import grpc

        from tandem.v1 import membership_pb2, membership_pb2_grpc

        with grpc.insecure_channel(self.internal_address) as channel:
            try:
                membership_pb2_grpc.MembershipStub(channel).Drain(
                    membership_pb2.DrainRequest(node_id=name, timeout_seconds=timeout_s), timeout=timeout_s + 10)
            except grpc.RpcError as exc:
                code = exc.code() if isinstance(exc, grpc.Call) else None
                if code != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: not registered (down already): stop it anyway
                    raise RuntimeError(f"drain {name}: {exc}") from None

    def _remove(self, name: str) -> None:
        """Stop the process gracefully, end the actor for good, free its placement group."""
        import ray
        from ray.util.placement_group import get_placement_group, remove_placement_group

        try:
            handle = actor(self.spec.name, name)
        except ValueError:
            handle = None
        if handle is not None:
            with contextlib.suppress(Exception):  # dead or unreachable: killed below either way
                ray.get(handle.stop.remote(STOP_GRACE_S), timeout=STOP_GRACE_S + CALL_TIMEOUT_S)
            ray.kill(handle, no_restart=True)
        if name != "gateway":
            with contextlib.suppress(ValueError):
                remove_placement_group(get_placement_group(actor_name(self.spec.name, name)))

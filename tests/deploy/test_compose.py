"""compose.yaml without Docker: valid against the compose-spec schema, and the same topology as `tandem up`.

The schema is vendored (compose_spec.json, see compose_spec.NOTICE): tests never reach the network.
Every Tandem container's command and environment are parsed by Tandem's own CLI and settings loader,
exactly as the container would, and compared with what the launcher gives its processes.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.config.settings import ModelSettings, NodeSettings, load_settings
from tandem_cli.cli import build_parser
from tandem_cli.launcher import Topology

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
# Fields that legitimately differ between containers and local processes (checked on their own below).
CONTAINER_ONLY = {"host", "advertise_host", "kv_store_port"}
# Not a bare "gpu" id: tests/conftest.py skips items with a "gpu" keyword (a parameter id is one) without CUDA.
BOTH_PROFILES = pytest.mark.parametrize("profile", ["cpu", "gpu"], ids=["cpu-profile", "gpu-profile"])


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's variable substitution: ${VAR}, ${VAR:-default}, ${VAR-default}, $$ (in every string)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(m: re.Match[str]) -> str:
        name, op, default = m.group(1), m.group(2), m.group(3) or ""
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        return env.get(name, "")

    return re.sub(r"\$\{(\w+)(?:(:?-)([^}]*))?\}", substitute, value).replace("$$", "$")


def load_compose(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    return interpolate(yaml.safe_load((ROOT / "compose.yaml").read_text()), env or {})


def enabled(compose: dict[str, Any], profile: str) -> dict[str, dict[str, Any]]:
    """The services ``docker compose --profile <profile> up`` starts (those without profiles always)."""
    return {name: s for name, s in compose["services"].items() if profile in s.get("profiles", [profile])}


@dataclass(frozen=True)
class Process:
    """One Tandem service as it will run, whatever says so (flags, environment or launcher)."""

    name: str  # compose service or launcher node name
    role: str
    port: int
    model: ModelSettings
    node: NodeSettings | None  # prefill / decode only
    prefill_targets: tuple[str, ...] = ()  # gateway only
    decode_targets: tuple[str, ...] = ()
    cpus: tuple[int, ...] = ()


def parse_process(name: str, argv: list[str], env: Mapping[str, str], cpus: tuple[int, ...] = ()) -> Process:
    args = build_parser().parse_args(argv)
    assert args.command == "serve"
    model = load_settings(ModelSettings, {k: getattr(args, k, None) for k in
                                          ("model", "dtype", "device", "attention_backend", "home", "num_threads")},
                          environ=env)
    if args.role == "gateway":
        port = args.port if args.port is not None else int(env.get("TANDEM_PORT", 50051))
        return Process(name, "gateway", port, model, None,
                       _split(args.prefill or env.get("TANDEM_PREFILL_TARGETS", "")),
                       _split(args.decode or env.get("TANDEM_DECODE_TARGETS", "")))
    node = load_settings(NodeSettings, {f.name: getattr(args, f.name, None) for f in fields(NodeSettings)},
                         environ=env)
    return Process(name, args.role, node.port, model, node, cpus=cpus)


def compose_processes(profile: str) -> dict[str, Process]:
    out = {}
    for name, service in enabled(load_compose(), profile).items():
        if name == "jaeger":
            continue
        env = {k: str(v) for k, v in service.get("environment", {}).items()}
        cpus = _cpuset(service["cpuset"]) if "cpuset" in service else ()
        out[name] = parse_process(name, list(service["command"]), env, cpus)
    return out


def launcher_processes() -> dict[str, Process]:
    """What `tandem up` starts on a 2-core machine (its default, 1 prefill + 1 decode node)."""
    out = {}
    for spec in Topology(1, 1, cpus=(0, 1)).nodes():
        env = {"TANDEM_NUM_THREADS": str(len(spec.cpus)), "OMP_NUM_THREADS": str(len(spec.cpus))} if spec.cpus else {}
        out[spec.name] = parse_process(spec.name, ["serve", spec.role, "--port", str(spec.port), *spec.args], env,
                                       spec.cpus)
    return out


def _split(targets: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in targets.split(",") if t.strip())


def _cpuset(text: str) -> tuple[int, ...]:
    cpus: list[int] = []
    for part in str(text).split(","):
        lo, _, hi = part.partition("-")
        cpus += range(int(lo), int(hi or lo) + 1)
    return tuple(cpus)


def _by_role(processes: Mapping[str, Process]) -> dict[str, list[Process]]:
    out: dict[str, list[Process]] = {}
    for p in processes.values():
        out.setdefault(p.role, []).append(p)
    return out


def _resolve(target: str, compose: dict[str, Any], profile: str) -> tuple[str, int]:
    """A gateway target ``name:port`` -> (the enabled service that answers to ``name``, port)."""
    host, _, port = target.rpartition(":")
    answering = [name for name, s in enabled(compose, profile).items()
                 if host == name or host in (s.get("networks") or {}).get("default", {}).get("aliases", [])]
    assert len(answering) == 1, f"{host!r} names {answering} in profile {profile}"
    return answering[0], int(port)


def _node_fields(node: NodeSettings) -> dict[str, Any]:
    return {f.name: getattr(node, f.name) for f in fields(NodeSettings) if f.name not in CONTAINER_ONLY}


# ---- the schema --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def validator() -> Any:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((HERE / "compose_spec.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_compose_file_matches_the_compose_spec(validator: Any) -> None:
    # compose validates after interpolation; the raw file (with ${...}) must pass too.
    for doc in (yaml.safe_load((ROOT / "compose.yaml").read_text()), load_compose(),
                load_compose({"TANDEM_PREFILL_CPUS": "0-3", "TANDEM_DECODE_CPUS": "4-7"})):
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
        assert errors == []


@pytest.mark.parametrize("mutate", [
    lambda d: d["services"]["gateway"].update(healthchek={"test": ["CMD", "true"]}),  # a misspelt key
    lambda d: d["services"]["decode-gpu"]["deploy"]["resources"]["reservations"]["devices"][0].pop("capabilities"),
    lambda d: d["services"]["prefill"].update(depends_on={"jaeger": {"condition": "service_ready"}}),
])
def test_the_schema_rejects_what_compose_would(validator: Any, mutate: Any) -> None:
    doc = load_compose()
    mutate(doc)
    assert list(validator.iter_errors(doc))


# ---- the topology ------------------------------------------------------------------------------------------


@BOTH_PROFILES
def test_same_roles_ports_and_model_as_the_launcher(profile: str) -> None:
    compose, launched = _by_role(compose_processes(profile)), _by_role(launcher_processes())
    assert {role: len(ps) for role, ps in compose.items()} == {"gateway": 1, "prefill": 1, "decode": 1}
    assert {role: len(ps) for role, ps in launched.items()} == {"gateway": 1, "prefill": 1, "decode": 1}
    for role in ("gateway", "prefill", "decode"):
        (c,), (lp,) = compose[role], launched[role]
        assert c.port == lp.port, role
        if profile == "cpu" or role == "gateway":
            assert c.model == lp.model, role  # same model, dtype, device, backend, threads
        else:
            assert c.model.device == "cuda" and c.model.model == lp.model.model and c.model.dtype == lp.model.dtype
        if role != "gateway":
            assert c.node is not None and lp.node is not None
            assert _node_fields(c.node) == _node_fields(lp.node), role  # node id, KV cache, batch limits...
            assert c.node.host == "0.0.0.0"  # in its container; the launcher's loopback would be unreachable


@BOTH_PROFILES
def test_gateway_targets_name_the_nodes(profile: str) -> None:
    compose = load_compose()
    processes = compose_processes(profile)
    gateway = processes["gateway"]
    launched = {p.role: p for p in launcher_processes().values()}
    assert len(gateway.prefill_targets) == len(launched["gateway"].prefill_targets) == 1
    assert len(gateway.decode_targets) == len(launched["gateway"].decode_targets) == 1
    for role, targets in (("prefill", gateway.prefill_targets), ("decode", gateway.decode_targets)):
        service, port = _resolve(targets[0], compose, profile)
        assert processes[service].role == role and processes[service].port == port
        assert port == int(getattr(launched["gateway"], f"{role}_targets")[0].rpartition(":")[2])


@BOTH_PROFILES
def test_decode_node_advertises_a_dialable_kv_endpoint(profile: str) -> None:
    compose = load_compose()
    (name, decode), = ((n, p) for n, p in compose_processes(profile).items() if p.role == "decode")
    assert decode.node is not None
    # A prefill container dials the reservation's kv_endpoint = advertise_host:port, then the KV store port.
    assert _resolve(f"{decode.node.advertise_host}:{decode.port}", compose, profile)[0] == name
    assert decode.node.kv_store_port > 0
    assert {str(decode.port), str(decode.node.kv_store_port)} <= set(compose["services"][name]["expose"])


def test_cpu_nodes_pinned_like_the_launcher() -> None:
    compose, launched = compose_processes("cpu"), launcher_processes()
    for c in compose.values():
        lp = next(p for p in launched.values() if p.role == c.role)
        assert c.cpus == lp.cpus, c.name  # gateway unpinned; one core per node on 2 cores
        if c.role != "gateway":
            assert c.model.num_threads == len(c.cpus)
    # On a bigger host the variables give each node more cores, with as many threads.
    bigger = load_compose({"TANDEM_PREFILL_CPUS": "0-7", "TANDEM_PREFILL_THREADS": "8"})["services"]["prefill"]
    assert _cpuset(bigger["cpuset"]) == tuple(range(8)) and bigger["environment"]["TANDEM_NUM_THREADS"] == "8"


def test_gpu_profile_reserves_one_distinct_gpu_per_node() -> None:
    gpu = enabled(load_compose(), "gpu")
    device_ids = []
    for name in ("prefill-gpu", "decode-gpu"):
        (device,) = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and len(device["device_ids"]) == 1
        device_ids += device["device_ids"]
        assert gpu[name]["environment"]["TANDEM_DEVICE"] == "cuda"
        assert gpu[name]["image"] != gpu["gateway"]["image"]  # the CUDA build; the gateway needs no torch
    assert len(set(device_ids)) == 2
    assert set(gpu) == {"gateway", "prefill-gpu", "decode-gpu", "jaeger"}
    assert set(enabled(load_compose(), "cpu")) == {"gateway", "prefill", "decode", "jaeger"}


def test_only_the_gateway_and_jaeger_ui_are_published_on_loopback() -> None:
    published = {name: s["ports"] for name, s in load_compose()["services"].items() if s.get("ports")}
    assert published == {"gateway": ["127.0.0.1:50051:50051", "127.0.0.1:8000:8000"],  # gRPC, OpenAI HTTP
                         "jaeger": ["127.0.0.1:16686:16686"]}


def test_every_tandem_service_traces_to_jaeger_and_is_health_checked() -> None:
    compose = load_compose()
    for name, service in compose["services"].items():
        if name == "jaeger":
            continue
        env = service["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317" and env["OTEL_SERVICE_NAME"], name
        assert env["TANDEM_HOST"] == "0.0.0.0"
        # The healthcheck is `tandem health` (the image's entrypoint is not applied to it) on the service's port.
        test = service["healthcheck"]["test"]
        assert test[:2] == ["CMD", "tandem"]
        args = build_parser().parse_args(test[2:])
        assert args.command == "health"
        port = next(p.port for p in compose_processes("gpu" if name.endswith("-gpu") else "cpu").values()
                    if p.name == name)
        assert args.target == f"127.0.0.1:{port}"
    assert "4317" in compose["services"]["jaeger"]["expose"]
    gateway_deps = compose["services"]["gateway"]["depends_on"]
    for node in ("prefill", "decode", "prefill-gpu", "decode-gpu"):
        assert gateway_deps[node] == {"condition": "service_healthy", "required": False}


def test_default_profile_and_image_entrypoint() -> None:
    env_file = dict(line.split("=", 1) for line in (ROOT / ".env").read_text().splitlines()
                    if line and not line.startswith("#"))
    assert env_file["COMPOSE_PROFILES"] == "cpu"
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["tandem"]' in dockerfile  # compose commands are `tandem` arguments
    assert "tandem model prepare" in dockerfile and "scripts/setup-venv.sh" in dockerfile
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def test_health_command_parses() -> None:
    args = build_parser().parse_args(["health", "--target", "decode:50071", "--service", "tandem.v1.Decode"])
    assert isinstance(args, argparse.Namespace) and args.func.__name__ == "cmd_health"


@BOTH_PROFILES
def test_speculation_is_turned_on_by_the_environment(profile: str) -> None:
    # The decode node reads TANDEM_SPECULATIVE like every other setting (no flags to re-serialize).
    from common.config.engine_config import SpeculativeMethod
    from common.config.settings import SpeculativeSettings, load_settings

    for env, method in (({}, SpeculativeMethod.NONE), ({"TANDEM_SPECULATIVE": "ngram"}, SpeculativeMethod.NGRAM)):
        compose = load_compose(env)
        decode = next(s for n, s in enabled(compose, profile).items() if "decode" in n)
        environ = {k: str(v) for k, v in decode["environment"].items()}
        assert load_settings(SpeculativeSettings, environ=environ).config().method is method

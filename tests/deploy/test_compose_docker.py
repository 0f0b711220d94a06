"""compose.yaml for real: build the image, `compose up` the cpu profile, stream a generation through the
gateway and find its trace in the project's own OTLP collector (tests/observability/collector.py).

Skips itself unless a container engine answers (``docker info`` or ``podman info``) with a compose command
that accepts compose.yaml as written (``<compose> config``): ``docker compose`` v2, ``podman compose``,
``podman-compose`` (PyPI) or, if it can read the file, Debian's ``docker-compose`` 1.29 (it cannot:
it predates the top-level ``name`` and ``depends_on.required``). ``TANDEM_COMPOSE`` names another compose
command (e.g. ``/path/to/podman-compose``), ``TANDEM_CONTAINER_ENGINE`` the engine CLI that goes with it.
Where no image registry is reachable, make a Debian-based Python 3.11 image locally and name it in
``TANDEM_DOCKER_BASE_IMAGE`` (the Dockerfile's ``BASE_IMAGE`` build argument; default
``python:3.11-slim``). The build runs with host networking and gets the host's pip wheels (the pinned CPU
torch wheel from pip's ``find-links`` folders) and CA bundle through docker/local/.

The collector listens on this host; the containers reach it as ``host.docker.internal`` (docker:
``host-gateway``) or ``host.containers.internal`` (podman adds it), through a compose override that
points every service's ``OTEL_EXPORTER_OTLP_ENDPOINT`` at it and replaces Jaeger (an image from a
registry) with an idle stand-in. The gateway publishes 127.0.0.1:50051 and :8000, as compose.yaml says.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tandem_cli.launcher import is_serving
from tests.observability.collector import Collector

pytestmark = pytest.mark.docker
ROOT = Path(__file__).resolve().parents[2]
IMAGE = "tandem:cpu"
GATEWAY = "127.0.0.1:50051"
BUILD_TIMEOUT_S = 3600  # the first build installs torch
UP_TIMEOUT_S = 600


def _answers(argv: list[str], timeout_s: float = 30.0) -> bool:
    try:
        return subprocess.run(argv, capture_output=True, timeout=timeout_s).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _compose_candidates(cli: str) -> list[list[str]]:
    found = [[cli, "compose"]]
    if cli == "docker" and shutil.which("docker-compose"):
        found.append(["docker-compose"])
    if cli == "podman" and shutil.which("podman-compose"):
        found.append(["podman-compose"])
    return found


def container_engine() -> tuple[str, list[str]] | None:
    """The engine CLI and a compose command that reads compose.yaml as written, or None."""
    env = {**os.environ, "COMPOSE_PROFILES": "cpu"}
    chosen = os.environ.get("TANDEM_COMPOSE")
    clis = [os.environ.get("TANDEM_CONTAINER_ENGINE", "podman" if chosen and "podman" in chosen else "docker")]
    clis += [c for c in ("docker", "podman") if c not in clis]
    for cli in clis:
        if shutil.which(cli) is None or not _answers([cli, "info"]):
            continue
        for compose in ([chosen.split()] if chosen else _compose_candidates(cli)):
            try:
                ok = subprocess.run([*compose, "-f", str(ROOT / "compose.yaml"), "config"], capture_output=True,
                                    timeout=60, cwd=ROOT, env=env).returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                ok = False
            if ok:
                return cli, compose
    return None


@pytest.fixture(scope="module")
def engine() -> tuple[str, list[str]]:
    found = container_engine()
    if found is None:
        pytest.skip("no reachable Docker/podman engine with a compose command that reads compose.yaml "
                    "(see the module docstring: TANDEM_COMPOSE)")
    return found


def override(cli: str, collector_port: int) -> dict[str, object]:
    """Every Tandem service exports to the collector on the host; Jaeger stays off."""
    host = "host.containers.internal" if cli == "podman" else "host.docker.internal"
    tandem: dict[str, object] = {
        "environment": {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{host}:{collector_port}",
                        "OTEL_BSP_SCHEDULE_DELAY": "200", "TANDEM_DTYPE": "float32"}}
    if cli != "podman":  # podman adds host.containers.internal by itself
        tandem["extra_hosts"] = ["host.docker.internal:host-gateway"]
    # Jaeger's image cannot be pulled here: a stand-in from our own image keeps every dependency as written
    # (podman-compose 1.6 cannot start a service whose dependency is in an inactive profile).
    jaeger = {"image": IMAGE, "entrypoint": ["sleep", "infinity"]}
    return {"services": {"gateway": tandem, "prefill": tandem, "decode": tandem, "jaeger": jaeger}}


def pip_setting(name: str) -> list[str]:
    """A pip configuration value (``find-links``, ``cert``), split on whitespace; [] when unset."""
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    values: list[str] = []
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.rsplit(".", 1)[-1] == name:
            values += value.strip().strip("'\"").split()
    return values


def stage_local_files() -> list[Path]:
    """Copy the host's pinned CPU torch wheel and CA bundle into docker/local/ (what the build needs offline)."""
    local = ROOT / "docker" / "local"
    staged = []
    for folder in pip_setting("find-links"):
        for wheel in sorted(Path(folder).glob("torch-2.13.0+cpu-*.whl")) if Path(folder).is_dir() else []:
            staged.append(Path(shutil.copy2(wheel, local / wheel.name)))
    for cert in pip_setting("cert")[:1]:
        if Path(cert).is_file():
            staged.append(Path(shutil.copy2(cert, local / "ca-certificates.crt")))
    return staged


def run(argv: list[str], timeout_s: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                            env={**os.environ, **(env or {})})
    assert result.returncode == 0, f"{' '.join(argv)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


def generates() -> bool:
    """One greedy token through the gateway (False while a node is still unreachable)."""
    req = generate_pb2.GenerateRequest(text="Hi", sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0.0))
    try:
        with grpc.insecure_channel(GATEWAY) as channel:
            list(generate_pb2_grpc.TandemStub(channel).Generate(req, timeout=60))
        return True
    except grpc.RpcError:
        return False


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    c = Collector(host="0.0.0.0").start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def deployment(engine: tuple[str, list[str]], collector: Collector,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    cli, compose = engine
    base = os.environ.get("TANDEM_DOCKER_BASE_IMAGE", "python:3.11-slim")
    staged = stage_local_files()
    index = ["--build-arg", "CPU_TORCH_INDEX="] if any(p.suffix == ".whl" for p in staged) else []
    try:
        run([cli, "build", "--network", "host", "-t", IMAGE, "--build-arg", f"BASE_IMAGE={base}",
             "--build-arg", "TORCH_FLAVOUR=cpu", *index, "."], BUILD_TIMEOUT_S)
    finally:
        for path in staged:
            path.unlink(missing_ok=True)
    extra = tmp_path_factory.mktemp("compose") / "compose.test.yaml"
    extra.write_text(yaml.safe_dump(override(cli, collector.port)))
    project = f"tandem-test-{secrets.token_hex(3)}"
    files = [*compose, "-p", project, "-f", str(ROOT / "compose.yaml"), "-f", str(extra)]
    env = {"COMPOSE_PROFILES": "cpu"}
    try:
        run([*files, "up", "-d", "--no-build"], UP_TIMEOUT_S, env)
        deadline = time.monotonic() + UP_TIMEOUT_S
        # The gateway first, then its nodes (an engine that ignores `service_healthy`, as podman < 4.6 does,
        # starts the gateway before its nodes are ready): a one-token generation that goes through.
        while not (is_serving(GATEWAY, 2.0) and generates()):
            if time.monotonic() > deadline:
                logs = subprocess.run([*files, "logs"], cwd=ROOT, capture_output=True, text=True,
                                      timeout=60, env={**os.environ, **env})
                pytest.fail(f"the deployment did not serve within {UP_TIMEOUT_S} s:\n{logs.stdout[-6000:]}"
                            f"\n{logs.stderr[-3000:]}")
            time.sleep(2.0)
        yield
    finally:
        subprocess.run([*files, "down", "-v", "--remove-orphans", "-t", "20"], cwd=ROOT, capture_output=True,
                       timeout=300, env={**os.environ, **env})


def test_a_generation_streams_through_compose_and_is_traced(deployment: None, collector: Collector) -> None:
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    req = generate_pb2.GenerateRequest(text="The capital of France is",
                                       sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0.0,
                                                                          ignore_eos=True))
    with grpc.insecure_channel(GATEWAY) as channel:
        responses = list(generate_pb2_grpc.TandemStub(channel).Generate(
            req, timeout=120, metadata=[("traceparent", f"00-{trace_id}-{parent}-01")]))
    assert len(responses) >= 2  # streamed: more than one message
    assert responses[-1].usage.completion_tokens == 8 and "".join(r.text for r in responses)
    assert responses[-1].timings.prefill_node == "prefill-0" and responses[-1].timings.decode_node == "decode-0"
    services = {"tandem-gateway", "tandem-prefill", "tandem-decode"}
    spans = collector.wait_for(lambda got: services <= {s.service for s in got if s.trace_id == trace_id}, 60.0)
    mine = [s for s in spans if s.trace_id == trace_id]
    assert services <= {s.service for s in mine}, sorted({(s.service, s.name) for s in spans})
    assert any(s.parent_span_id == parent for s in mine)  # the gateway's root span continues the client's trace

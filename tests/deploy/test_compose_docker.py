"""compose.yaml for real: build the image, `compose up` the cpu profile, stream a generation through the
gateway and find its trace in the project's own OTLP collector (tests/observability/collector.py).

Skips itself unless a container engine answers (``docker info`` or ``podman info``) and a compose command
exists (``docker compose`` v2, ``docker-compose`` v1, ``podman compose``). Where no image registry is
reachable, make a Debian-based Python 3.11 image locally and name it in ``TANDEM_DOCKER_BASE_IMAGE``
(the Dockerfile's ``BASE_IMAGE`` build argument; default ``python:3.11-slim``).

The collector listens on this host; the containers reach it as ``host.docker.internal`` (``host-gateway``),
through a compose override that points every service's ``OTEL_EXPORTER_OTLP_ENDPOINT`` at it and leaves
Jaeger (an image from a registry) out. The gateway publishes 127.0.0.1:50051 and :8000, as compose.yaml says.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
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


def container_engine() -> tuple[str, list[str]] | None:
    """The engine CLI and the compose command to use, or None when no engine is reachable."""
    for cli in ("docker", "podman"):
        if shutil.which(cli) is None or not _answers([cli, "info"]):
            continue
        if _answers([cli, "compose", "version"]):
            return cli, [cli, "compose"]
        if cli == "docker" and shutil.which("docker-compose") and _answers(["docker-compose", "version"]):
            return cli, ["docker-compose"]
    return None


@pytest.fixture(scope="module")
def engine() -> tuple[str, list[str]]:
    found = container_engine()
    if found is None:
        pytest.skip("no reachable Docker/podman engine with a compose command (`docker info` fails)")
    return found


def override(collector_port: int) -> dict[str, object]:
    """Every Tandem service exports to the collector on the host; Jaeger stays off."""
    tandem = {"environment": {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://host.docker.internal:{collector_port}",
                              "OTEL_BSP_SCHEDULE_DELAY": "200", "TANDEM_DTYPE": "float32"},
              "extra_hosts": ["host.docker.internal:host-gateway"],
              "depends_on": {"jaeger": {"condition": "service_started", "required": False}}}
    return {"services": {"gateway": tandem, "prefill": tandem, "decode": tandem,
                         "jaeger": {"profiles": ["jaeger"]}}}


def run(argv: list[str], timeout_s: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                            env={**os.environ, **(env or {})})
    assert result.returncode == 0, f"{' '.join(argv)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


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
    run([cli, "build", "-t", IMAGE, "--build-arg", f"BASE_IMAGE={base}", "--build-arg", "TORCH_FLAVOUR=cpu", "."],
        BUILD_TIMEOUT_S)
    extra = tmp_path_factory.mktemp("compose") / "compose.test.yaml"
    extra.write_text(yaml.safe_dump(override(collector.port)))
    project = f"tandem-test-{secrets.token_hex(3)}"
    files = [*compose, "-p", project, "-f", str(ROOT / "compose.yaml"), "-f", str(extra)]
    env = {"COMPOSE_PROFILES": "cpu"}
    try:
        run([*files, "up", "-d", "--no-build"], UP_TIMEOUT_S, env)
        deadline = time.monotonic() + UP_TIMEOUT_S
        while not is_serving(GATEWAY, 2.0):
            if time.monotonic() > deadline:
                logs = subprocess.run([*files, "logs", "--no-color"], cwd=ROOT, capture_output=True, text=True,
                                      timeout=60, env={**os.environ, **env})
                pytest.fail(f"the gateway did not serve within {UP_TIMEOUT_S} s:\n{logs.stdout[-6000:]}")
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

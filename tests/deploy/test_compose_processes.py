"""compose.yaml's services run as local processes with their own commands, environment and healthchecks.

Docker cannot run here, so this is the nearest thing to `docker compose up`: every Tandem service of the
cpu profile starts as `tandem <command>` with its compose environment (TANDEM_HOST=0.0.0.0 included),
service names resolve to 127.0.0.1 and the fixed ports become free ones. Jaeger is left out (the OTEL_*
variables are dropped: no collector listens here). The nodes' healthchecks gate the gateway's start, as
``depends_on: service_healthy`` does.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from common.serving.port_reservation import reserve_ports
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from tests.deploy.test_compose import enabled, load_compose
from tests.e2e.test_disaggregated import generate, prompts, reference, request

pytestmark = pytest.mark.e2e


class ComposeOnLoopback:
    """The cpu profile's Tandem services as processes: names -> 127.0.0.1, fixed ports -> free ports."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        compose = load_compose({"TANDEM_MODEL": str(model_dir), "TANDEM_DTYPE": "float32"})
        self.services = {n: s for n, s in enabled(compose, "cpu").items() if n != "jaeger"}
        fixed = sorted({int(p) for s in self.services.values() for p in s.get("expose", [])} | {50051, 8000})
        self.ports = dict(zip(fixed, reserve_ports(len(fixed)), strict=True))
        self.names = set(compose["services"])
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def rewrite(self, text: str, bare_names: bool = False) -> str:
        """``decode:50071`` -> ``127.0.0.1:<free>``, ``50071`` -> ``<free>``; with ``bare_names`` (environment
        values such as TANDEM_ADVERTISE_HOST) ``decode`` -> ``127.0.0.1`` too (in a command it is a role)."""
        def host_port(m: re.Match[str]) -> str:
            host = "127.0.0.1" if m.group(1) in self.names else m.group(1)
            return f"{host}:{self.ports.get(int(m.group(2)), int(m.group(2)))}"

        text = re.sub(r"^([\w.-]+):(\d+)$", host_port, text)
        if text.isdigit() and int(text) in self.ports:
            return str(self.ports[int(text)])
        return "127.0.0.1" if bare_names and text in self.names else text

    def port(self, name: str) -> int:
        return int(self.rewrite(self.services[name]["command"][3]))  # serve <role> --port <port>

    def start(self, name: str) -> None:
        service = self.services[name]
        env = {k: self.rewrite(str(v), bare_names=True) for k, v in service["environment"].items()
               if not k.startswith("OTEL_")}
        env = {**os.environ, **env}
        cpus = {int(c) for c in str(service.get("cpuset", "")).split(",") if c.isdigit()}
        pin = cpus if cpus and cpus <= os.sched_getaffinity(0) else None
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the process
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "tandem_cli", *(self.rewrite(a) for a in service["command"])],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, pin)) if pin else None,
        )

    def wait_healthy(self, name: str, timeout_s: float = 120.0) -> None:
        """Run the service's own healthcheck command until it passes, as Docker would."""
        test = [self.rewrite(a) for a in self.services[name]["healthcheck"]["test"]]
        assert test[:2] == ["CMD", "tandem"]
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.procs[name].poll() is None, f"{name} exited; see {self.log_dir / (name + '.log')}"
            if subprocess.run([sys.executable, "-m", "tandem_cli", *test[2:]], capture_output=True).returncode == 0:
                return
            assert time.monotonic() < deadline, f"{name} not healthy within {timeout_s:.0f} s"
            time.sleep(0.5)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


@pytest.fixture(scope="module")
def deployment(tiny_served_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeOnLoopback]:
    system = ComposeOnLoopback(tiny_served_model_dir, tmp_path_factory.mktemp("compose-logs"))
    try:
        gateway_deps: dict[str, Any] = system.services["gateway"]["depends_on"]
        nodes = [n for n in system.services if n in gateway_deps]
        for name in nodes:
            system.start(name)
        for name in nodes:
            system.wait_healthy(name)
        system.start("gateway")
        system.wait_healthy("gateway")
        yield system
    finally:
        system.stop()


def test_generation_through_the_compose_services(deployment: ComposeOnLoopback, tiny_served_model_dir: Path) -> None:
    gateway = f"127.0.0.1:{deployment.port('gateway')}"
    # The gateway's default is conditional disaggregation: prompts up to 256 tokens prefill on the decode
    # node, longer ones on the prefill node, their KV pushed to the decode node.
    g = torch.Generator().manual_seed(33)
    ps = [*prompts(2, seed=31), torch.randint(20, 49000, (300,), generator=g).tolist()]
    expected = reference(tiny_served_model_dir, ps, 6)
    for p, want in zip(ps, expected, strict=True):
        tokens, last = generate(gateway, request(p, 6))
        assert tokens == want
        assert last.timings.decode_node == "decode-0"
        if len(p) <= 256:
            assert last.timings.prefill_node == "decode-0" and last.timings.kv_transfer_bytes == 0
        else:
            assert last.timings.prefill_node == "prefill-0" and last.timings.kv_transfer_bytes > 0


def test_decode_node_listens_on_every_interface_and_advertises_its_name(deployment: ComposeOnLoopback) -> None:
    port = deployment.port("decode")
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = decode_pb2_grpc.DecodeStub(channel).Generate(decode_pb2.DecodeRequest(
            request_id="advertise-check", prompt_token_ids=prompts(1, seed=32)[0],
            sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0), kv_timeout_seconds=5.0), timeout=30)
        reservation = next(iter(call)).reservation
        call.cancel()
    # TANDEM_ADVERTISE_HOST=decode (here rewritten to 127.0.0.1), never the wildcard it listens on.
    assert reservation.kv_endpoint == f"127.0.0.1:{port}"

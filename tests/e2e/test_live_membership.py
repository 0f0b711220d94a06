"""Live membership with real processes on 127.0.0.1: ``tandem serve gateway --internal-port`` with no node,
a prefill and a decode node started with ``--gateway``, ``tandem drain`` from the command line, and a node's
SIGTERM deregistering it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from common.serving.port_reservation import reserve_ports
from tandem.v1 import common_pb2, decode_pb2_grpc, generate_pb2, generate_pb2_grpc

pytestmark = pytest.mark.e2e
START_TIMEOUT_S = 120.0


def tandem(*args: str, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "tandem_cli", *args], stdout=out, stderr=subprocess.STDOUT)


def loads(gateway: str) -> list[generate_pb2.NodeLoad]:
    with grpc.insecure_channel(gateway) as channel:
        return list(generate_pb2_grpc.TandemStub(channel).GetLoads(generate_pb2.GetLoadsRequest(), timeout=5).nodes)


def wait_for(what: str, check: object, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():  # type: ignore[operator]
                return
        except grpc.RpcError:
            pass
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.2)


@pytest.fixture
def ports() -> Iterator[list[int]]:
    yield reserve_ports(4)


def test_nodes_join_a_running_gateway_and_leave_it(tiny_served_model_dir: Path, tmp_path: Path,
                                                   ports: list[int]) -> None:
    gw_port, internal_port, prefill_port, decode_port = ports
    gateway, internal = f"127.0.0.1:{gw_port}", f"127.0.0.1:{internal_port}"
    model = ("--model", str(tiny_served_model_dir), "--dtype", "float32")
    node = ("--num-blocks", "64", "--block-size", "4", "--gateway", internal, "--register-interval-s", "0.5",
            "--grace-s", "2")
    procs = {"gateway": tandem("serve", "gateway", "--model-dir", str(tiny_served_model_dir), "--port",
                               str(gw_port), "--internal-port", str(internal_port), "--stats-interval-s", "0.3",
                               "--local-prefill-max-tokens", "0", log=tmp_path / "gateway.log")}
    try:
        procs["prefill"] = tandem("serve", "prefill", *model, *node, "--port", str(prefill_port), "--node-id", "p0",
                                  log=tmp_path / "prefill.log")
        procs["decode"] = tandem("serve", "decode", *model, *node, "--port", str(decode_port), "--node-id", "d0",
                                 log=tmp_path / "decode.log")
        wait_for("both nodes registered", lambda: {(n.node_id, n.reachable) for n in loads(gateway)} ==
                 {("p0", True), ("d0", True)})
        request = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=list(range(100, 112))),
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
            stream=generate_pb2.StreamOptions(include_token_ids=True))
        with grpc.insecure_channel(gateway) as channel:
            responses = list(generate_pb2_grpc.TandemStub(channel).Generate(request, timeout=60))
        assert len([t for r in responses for t in r.token_ids]) == 8
        assert (responses[-1].timings.prefill_node, responses[-1].timings.decode_node) == ("p0", "d0")

        drain = subprocess.run([sys.executable, "-m", "tandem_cli", "drain", "d0", "--gateway", internal,
                                "--timeout", "30"], capture_output=True, text=True, timeout=60)
        assert drain.returncode == 0, drain.stderr
        assert "node d0" in drain.stdout and "drained" in drain.stdout
        assert [n.node_id for n in loads(gateway)] == ["p0"]
        with grpc.insecure_channel(f"127.0.0.1:{decode_port}") as channel:
            stats = decode_pb2_grpc.DecodeStub(channel).Stats(common_pb2.StatsRequest(), timeout=10)
        assert stats.used_blocks == 0 and stats.num_running == 0
        unknown = subprocess.run([sys.executable, "-m", "tandem_cli", "drain", "d0", "--gateway", internal],
                                 capture_output=True, text=True, timeout=60)
        assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr and "'d0'" in unknown.stderr

        procs["prefill"].send_signal(signal.SIGTERM)  # a graceful stop deregisters the node
        assert procs["prefill"].wait(timeout=30) == 0
        assert loads(gateway) == []
        assert procs["gateway"].poll() is None and procs["decode"].poll() is None
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

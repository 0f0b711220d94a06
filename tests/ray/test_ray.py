"""Tandem on a real Ray cluster of three raylets (tests/ray/conftest.py), issue 34's goals: 1 prefill + 2 decode
nodes placed on different raylets by their custom resources, greedy output equal to the colocated engine's,
KV between "hosts" over sockets; a decode node's process SIGKILLed mid-stream fails no request (migration) and
Ray brings it back into routing within 30 s; decode scaled 2 -> 3 -> 1 under a steady load with 0 failed
requests and the new node taking traffic within 5 s; bad input refused naming the flag or node, with nothing
left running. Every Ray and Tandem socket on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from common.serving.port_reservation import reserve_ports
from tandem.v1 import generate_pb2, generate_pb2_grpc
from tests.e2e.test_disaggregated import prompts, reference, request
from tests.ray.conftest import ROOT, RayCluster, listeners, on_loopback

pytestmark = pytest.mark.e2e
TIMEOUT_S = 120.0
DEPLOYMENT = "rt"


def tandem(cluster: RayCluster, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tandem_cli", *args], env=cluster.env, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


@dataclass
class Deployment:
    cluster: RayCluster
    gateway: str
    internal: str
    log_dir: Path

    def status(self) -> dict[str, dict[str, object]]:
        out = tandem(self.cluster, "ray", "status", "--address", self.cluster.address, "--name", DEPLOYMENT,
                     timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        return {info["member"]: info for info in map(json.loads, out.stdout.splitlines())}

    def loads(self) -> dict[str, generate_pb2.NodeLoad]:
        with grpc.insecure_channel(self.gateway) as channel:
            nodes = generate_pb2_grpc.TandemStub(channel).GetLoads(generate_pb2.GetLoadsRequest(), timeout=5).nodes
        return {n.node_id: n for n in nodes}

    def logs(self) -> str:
        """What every Tandem process wrote (Ray keeps each actor's output in its session's log files)."""
        return "\n".join(p.read_text(errors="replace") for p in self.log_dir.rglob("worker-*"))


@pytest.fixture(scope="module")
def deployment(ray_cluster: RayCluster, tiny_served_model_dir: Path) -> Iterator[Deployment]:
    port, internal = reserve_ports(2)
    up = tandem(ray_cluster, "ray", "up", "--address", ray_cluster.address, "--name", DEPLOYMENT,
                "--prefill-nodes", "1", "--decode-nodes", "2", "--prefill-resources", '{"host_a": 1}',
                "--decode-resources", '[{"host_b": 1}, {"host_c": 1}]', "--port", str(port),
                "--internal-port", str(internal), "--model", str(tiny_served_model_dir), "--dtype", "float32",
                "--node-arg=--num-blocks", "--node-arg=256", "--node-arg=--grace-s", "--node-arg=1",
                "--gateway-arg=--migration-limit", "--gateway-arg=3", "--gateway-arg=--stats-interval-s",
                "--gateway-arg=0.3", "--gateway-arg=--local-prefill-max-tokens", "--gateway-arg=0")
    assert up.returncode == 0, up.stderr[-3000:]
    try:
        yield Deployment(ray_cluster, f"127.0.0.1:{port}", f"127.0.0.1:{internal}",
                         ray_cluster.temp_dir / "session_latest" / "logs")
    finally:
        down = tandem(ray_cluster, "ray", "down", "--address", ray_cluster.address, "--name", DEPLOYMENT)
        assert down.returncode == 0, down.stderr[-2000:]


def stream(target: str, ids: list[int], max_tokens: int, on_token: threading.Barrier | None = None,
           after: int = 0) -> tuple[list[int], str, str]:
    """Greedy tokens, the status code and the decode node that finished the request."""
    tokens: list[int] = []
    decode_node = ""
    with grpc.insecure_channel(target) as channel:
        call = generate_pb2_grpc.TandemStub(channel).Generate(request(ids, max_tokens), timeout=TIMEOUT_S)
        try:
            for message in call:
                tokens += message.token_ids
                decode_node = message.timings.decode_node or decode_node
                if on_token is not None and len(tokens) >= after:
                    on_token.wait()
                    on_token = None
        except grpc.RpcError as exc:
            return tokens, exc.code().name, decode_node
    return tokens, "OK", decode_node


def test_nodes_land_on_different_raylets_and_equal_the_colocated_engine(
        deployment: Deployment, tiny_served_model_dir: Path) -> None:
    status = deployment.status()
    assert set(status) == {"gateway", "prefill-0", "decode-0", "decode-1"}
    raylets = {status[m]["ray_node_id"] for m in ("prefill-0", "decode-0", "decode-1")}
    assert len(raylets) == 3  # each node on the raylet holding its resource
    assert status["gateway"]["ray_node_id"] in raylets
    ps = prompts(6, seed=3)
    expected = reference(tiny_served_model_dir, ps, 16)
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda p: stream(deployment.gateway, p, 16), ps))
    assert [(tokens, code) for tokens, code, _ in results] == [(want, "OK") for want in expected]
    assert {node for _, _, node in results} == {"decode-0", "decode-1"} or len(ps) < 2
    # Each node's host identity is its Ray node: the KV pairs formed over sockets, never shared memory.
    logs = deployment.logs()
    assert "formed over socket" in logs and "formed over shm" not in logs, logs[-3000:]
    # Every socket Ray and Tandem opened listens on loopback.
    opened = listeners() - deployment.cluster.before
    assert len(opened) > 10  # the raylets, GCS, workers and the four Tandem services
    assert not [(address, who) for address, who in opened if not on_loopback(address)]


def test_a_killed_decode_node_fails_no_request_and_ray_brings_it_back(
        deployment: Deployment, tiny_served_model_dir: Path) -> None:
    n, max_tokens = 6, 200
    ps = prompts(n, seed=9)
    expected = reference(tiny_served_model_dir, ps, max_tokens)
    before = deployment.status()["decode-0"]
    midway = threading.Barrier(n + 1, timeout=TIMEOUT_S)
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(stream, deployment.gateway, p, max_tokens, midway, 24) for p in ps]
        midway.wait()  # every stream has 24 tokens
        os.kill(int(before["pid"]), signal.SIGKILL)  # the Tandem process, not the actor: Ray sees it die
        killed = time.monotonic()
        results = [f.result(timeout=TIMEOUT_S) for f in futures]
    assert [code for _, code, _ in results] == ["OK"] * n
    assert [tokens for tokens, _, _ in results] == expected  # the same greedy tokens as undisturbed
    # Ray restarts the actor, which starts the process again; it registers and the gateway routes to it.
    while True:
        load = deployment.loads().get("decode-0")
        status = deployment.status()["decode-0"]
        if load is not None and load.reachable and status["pid"] != before["pid"] and status["running"]:
            break
        assert time.monotonic() - killed < 30, f"decode-0 not back in routing 30 s after the kill: {status}"
        time.sleep(0.3)
    back_s = time.monotonic() - killed
    print(f"decode-0 routed again {back_s:.1f} s after SIGKILL")
    # Concurrent requests spread over the decode nodes by load (one at a time, an idle pair's tie always goes
    # to the same node): the restarted node takes its share within a few waves (the router sees loads as its
    # last Stats poll did; a busy machine delays that).
    served: set[str] = set()
    for wave in range(10):
        with ThreadPoolExecutor(8) as pool:
            after = list(pool.map(lambda p: stream(deployment.gateway, p, 32), prompts(8, seed=10 + wave)))
        assert [code for _, code, _ in after] == ["OK"] * 8
        served |= {node for _, _, node in after}
        if "decode-0" in served:
            break
    assert "decode-0" in served, served


def test_scaling_decode_under_a_steady_load_fails_nothing(deployment: Deployment) -> None:
    stop = threading.Event()
    results: list[tuple[float, str, str]] = []  # (ended at, code, decode node)
    lock = threading.Lock()

    def client(seed: int) -> None:
        k = 0
        while not stop.is_set():
            (p,) = prompts(1, seed=1000 * seed + k)
            _, code, node = stream(deployment.gateway, p, 8)
            with lock:
                results.append((time.monotonic(), code, node))
            k += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    try:
        time.sleep(2)
        up = tandem(deployment.cluster, "ray", "scale", "--address", deployment.cluster.address, "--name",
                    DEPLOYMENT, "--decode", "3")
        assert up.returncode == 0, up.stderr[-2000:]
        routed = time.monotonic()  # scale returns once the gateway routes to the new node
        assert "decode-2" in deployment.status()
        deadline = routed + 5
        while time.monotonic() < deadline and not any(node == "decode-2" and code == "OK" and at >= routed
                                                      for at, code, node in list(results)):
            time.sleep(0.1)
        took = [at for at, code, node in list(results) if node == "decode-2" and code == "OK"]
        assert took and min(took) - routed <= 5, "decode-2 served nothing within 5 s of joining"
        print(f"decode-2 finished its first request {min(took) - routed:.1f} s after joining")
        down = tandem(deployment.cluster, "ray", "scale", "--address", deployment.cluster.address, "--name",
                      DEPLOYMENT, "--decode", "1")
        assert down.returncode == 0, down.stderr[-2000:]
        assert {m for m in deployment.status() if m.startswith("decode")} == {"decode-0"}
        time.sleep(2)
    finally:
        stop.set()
        for t in threads:
            t.join(TIMEOUT_S)
    codes = [code for _, code, _ in results]
    assert len(codes) > 10 and codes.count("OK") == len(codes), [c for c in codes if c != "OK"]
    assert {node for _, _, node in results} >= {"decode-0", "decode-2"}


def test_bad_input_is_refused_naming_the_flag_and_leaves_nothing(deployment: Deployment,
                                                                  tiny_served_model_dir: Path) -> None:
    cluster = deployment.cluster
    nowhere = tandem(cluster, "ray", "up", "--address", f"127.0.0.1:{reserve_ports(1)[0]}", "--name", "bad",
                     "--model", str(tiny_served_model_dir), timeout=60)
    assert nowhere.returncode == 2 and "--address" in nowhere.stderr and "no Ray cluster answers" in nowhere.stderr
    def bad_up(*flags: str) -> subprocess.CompletedProcess[str]:
        port, internal = reserve_ports(2)
        return tandem(cluster, "ray", "up", "--address", cluster.address, "--name", "bad", "--placement-timeout-s",
                      "3", "--port", str(port), "--internal-port", str(internal), "--model",
                      str(tiny_served_model_dir), "--dtype", "float32", *flags, timeout=300)

    started = time.monotonic()
    unplaceable = bad_up("--decode-resources", '{"host_z": 1}')
    assert unplaceable.returncode != 0 and "--decode-resources" in unplaceable.stderr, unplaceable.stderr[-2000:]
    assert "host_z" in unplaceable.stderr and time.monotonic() - started < 120
    # Three ranks (T=3) of {"host_b": 1} packed on one Ray node: no node has host_b 3.
    layout = bad_up("--decode-resources", '{"host_b": 1}', "--decode-tensor-parallel-size", "3")
    assert layout.returncode != 0 and "3 x {'host_b': 1.0}" in layout.stderr, layout.stderr[-2000:]
    unknown = tandem(cluster, "ray", "status", "--address", cluster.address, "--name", "bad", timeout=60)
    assert unknown.returncode == 2 and "--name bad: no Tandem deployment" in unknown.stderr, unknown.stderr
    assert f"running: {DEPLOYMENT}" in unknown.stderr  # nothing of "bad" left, the test deployment untouched
    drain = tandem(cluster, "drain", "nosuch-node", "--gateway", deployment.internal, timeout=60)
    assert drain.returncode != 0 and "nosuch-node" in drain.stderr, drain.stderr[-2000:]


def test_plan_apply_scales_the_ray_deployment_to_the_recommendation(deployment: Deployment,
                                                                     tiny_served_model_dir: Path) -> None:
    """`tandem plan --apply` on 3 nodes: the deployment takes the recommended prefill:decode split's counts
    (through `tandem ray scale`'s path; --apply chooses among the splits only)."""
    one = tandem(deployment.cluster, "ray", "scale", "--address", deployment.cluster.address, "--name", DEPLOYMENT,
                 "--prefill", "1", "--decode", "1")  # 1P:1D: any split of 3 nodes changes it
    assert one.returncode == 0, one.stderr[-2000:]
    plan = tandem(deployment.cluster, "plan", "--model", str(tiny_served_model_dir), "--dtype", "float32",
                  "--quick", "--nodes", "3", "--apply", "--address", deployment.cluster.address, "--name",
                  DEPLOYMENT, timeout=600)
    recommended = plan.stdout.split("**Recommended: ", 1)[1].split("**", 1)[0]
    members = deployment.status()
    print(f"tandem plan recommended {recommended}: {plan.stderr.strip().splitlines()[-1]}")
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert not recommended.startswith("colocated")
    p_part, d_part = recommended.split()[0].split(":")  # "1P:2D" or "1P:2D local<=256"
    prefill, decode = int(p_part.removesuffix("P")), int(d_part.removesuffix("D"))
    assert sum(m.startswith("prefill") for m in members) == prefill
    assert sum(m.startswith("decode") for m in members) == decode
    assert f"applied {recommended}" in plan.stderr and "added none" not in plan.stderr

"""Request migration with real processes (`tandem up`'s launcher, 1 prefill + 2 decode nodes): the decode node
with most streams killed with SIGKILL while greedy requests stream; every request finishes with the tokens an
undisturbed run gives (the colocated engine's), none fails, and the gateway counts the migrations."""

from __future__ import annotations

import os
import signal
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from tandem.v1 import generate_pb2, generate_pb2_grpc
from tandem_cli.launcher import Launcher, Topology
from tests.e2e.test_disaggregated import TIMEOUT_S, prompts, reference, request, wait_all_blocks_free

pytestmark = pytest.mark.e2e
NUM_REQUESTS = 8
MAX_TOKENS = 300  # long enough that every stream is mid-way when the node dies
KILL_AFTER = 32  # tokens every stream has received when a decode node is killed


def migrations(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tandem:request_migrations_total{") and 'role="decode"' in line)


def busiest_decode_node(gateway: str) -> str:
    """The decode node on which the gateway has the most requests open now (GetLoads)."""
    with grpc.insecure_channel(gateway) as channel:
        nodes = generate_pb2_grpc.TandemStub(channel).GetLoads(generate_pb2.GetLoadsRequest(), timeout=10).nodes
    decode = [n for n in nodes if n.role == "decode"]
    assert decode and max(n.num_inflight for n in decode) > 0, [(n.node_id, n.num_inflight) for n in nodes]
    return max(decode, key=lambda n: n.num_inflight).node_id


# The continuation's prompt (prompt + streamed tokens) prefilled by the prefill node, or by the decode node
# itself under conditional disaggregation.
@pytest.mark.parametrize("local_prefill_max_tokens", ["0", "1024"], ids=["disaggregated", "local-prefill"])
def test_decode_node_killed_mid_stream_fails_no_request(tiny_served_model_dir: Path, tmp_path: Path,
                                                        local_prefill_max_tokens: str) -> None:
    topology = Topology(num_prefill=1, num_decode=2, free_ports=True, http_port=None, metrics_base_port=0,
                        model_args=("--model", str(tiny_served_model_dir), "--dtype", "float32"),
                        node_args=("--num-blocks", "256", "--kv-timeout-s", "20", "--grace-s", "1"),
                        gateway_args=("--local-prefill-max-tokens", local_prefill_max_tokens,
                                      "--stats-interval-s", "0.3", "--shutdown-grace-s", "1"))
    ps = prompts(NUM_REQUESTS, seed=21)
    expected = reference(tiny_served_model_dir, ps, MAX_TOKENS)
    with Launcher(topology, log_dir=tmp_path) as launcher:
        gateway = launcher.gateway.target
        started = threading.Barrier(NUM_REQUESTS + 1, timeout=TIMEOUT_S)

        def stream(ids: list[int]) -> tuple[list[int], generate_pb2.GenerateResponse | None, str]:
            tokens: list[int] = []
            last = None
            with grpc.insecure_channel(gateway) as channel:
                call = generate_pb2_grpc.TandemStub(channel).Generate(request(ids, MAX_TOKENS), timeout=TIMEOUT_S)
                try:
                    waited = False
                    for message in call:
                        tokens += message.token_ids
                        last = message
                        if len(tokens) >= KILL_AFTER and not waited:
                            waited = True
                            started.wait()  # every stream is mid-way before the kill
                except grpc.RpcError as exc:
                    return tokens, last, exc.code().name
            return tokens, last, "OK"

        with ThreadPoolExecutor(NUM_REQUESTS) as pool:
            futures = [pool.submit(stream, p) for p in ps]
            started.wait()
            # The victim is the decode node with the most of these streams open now: the router may have placed
            # them all on one node (seen under load with local prefill), and killing an idle one moves nothing.
            victim_id = busiest_decode_node(gateway)
            survivor_id = "decode-1" if victim_id == "decode-0" else "decode-0"
            victim = launcher.procs[victim_id]
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait(10)
            results = [f.result(timeout=TIMEOUT_S) for f in futures]

        assert [code for _, _, code in results] == ["OK"] * NUM_REQUESTS
        for (tokens, last, _), want in zip(results, expected, strict=True):
            assert tokens == want  # no token lost, none repeated, the same greedy continuation
            assert last is not None and last.usage.completion_tokens == MAX_TOKENS
            assert last.finish_reason == 2  # FINISH_REASON_LENGTH
        moved = migrations(launcher.gateway.metrics_port or 0)
        on_survivor = sum(last.timings.decode_node == survivor_id for _, last, _ in results if last is not None)
        assert 1 <= moved <= NUM_REQUESTS and on_survivor == NUM_REQUESTS
        # New requests are served (by the node that lives, or by the victim once the launcher restarted it).
        with grpc.insecure_channel(gateway) as channel:
            responses = list(generate_pb2_grpc.TandemStub(channel).Generate(request(ps[0], 8), timeout=TIMEOUT_S))
        assert [t for r in responses for t in r.token_ids] == expected[0][:8]
        wait_all_blocks_free(launcher)

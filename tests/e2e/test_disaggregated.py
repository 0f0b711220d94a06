"""The whole system as real processes on 127.0.0.1: gateway -> prefill -> KV transfer -> decode."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch

from common.config.engine_config import CacheConfig
from common.engine.engine_core import ColocatedEngine
from common.model.loader import load_model
from common.sampling.params import SamplingParams
from tandem.v1 import common_pb2, decode_pb2_grpc, generate_pb2, generate_pb2_grpc, prefill_pb2_grpc
from tandem_cli.launcher import Launcher, Topology

pytestmark = pytest.mark.e2e
TIMEOUT_S = 120.0


def deployment(model_dir: Path, tmp_path: Path, prefill: int, decode: int) -> Launcher:
    topology = Topology(num_prefill=prefill, num_decode=decode, free_ports=True,
                        model_args=("--model", str(model_dir), "--dtype", "float32"),
                        node_args=("--num-blocks", "256", "--kv-timeout-s", "20", "--grace-s", "1"),
                        gateway_args=("--local-prefill-max-tokens", "0",
                                      "--stats-interval-s", "0.3", "--shutdown-grace-s", "1"))
    return Launcher(topology, log_dir=tmp_path, env={"TANDEM_HOME": os.environ.get("TANDEM_HOME", "")} if
                    os.environ.get("TANDEM_HOME") else None)


@pytest.fixture(scope="module")
def system(tiny_served_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    with deployment(tiny_served_model_dir, tmp_path_factory.mktemp("logs"), prefill=2, decode=2) as launcher:
        yield launcher


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(20, 49000, (int(k),), generator=g).tolist()
            for k in torch.randint(3, 60, (n,), generator=g)]


def reference(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    engine = ColocatedEngine(load_model(model_dir, dtype="float32"), CacheConfig(num_blocks=256))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return [out[str(i)] for i in range(len(prompts))]


def request(ids: list[int], max_tokens: int, **sampling: object) -> generate_pb2.GenerateRequest:
    params = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **sampling)
    return generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=ids), sampling=params,
                                        stream=generate_pb2.StreamOptions(include_token_ids=True))


def generate(target: str, req: generate_pb2.GenerateRequest) -> tuple[list[int], generate_pb2.GenerateResponse]:
    with grpc.insecure_channel(target) as channel:
        responses = list(generate_pb2_grpc.TandemStub(channel).Generate(req, timeout=TIMEOUT_S))
    return [t for r in responses for t in r.token_ids], responses[-1]


def used_blocks(launcher: Launcher) -> dict[str, int]:
    out = {}
    for spec in launcher.specs:
        if spec.role == "gateway" or launcher.procs[spec.name].poll() is not None:
            continue
        stub = prefill_pb2_grpc.PrefillStub if spec.role == "prefill" else decode_pb2_grpc.DecodeStub
        with grpc.insecure_channel(spec.target) as channel:
            out[spec.name] = stub(channel).Stats(common_pb2.StatsRequest(), timeout=10).used_blocks
    return out


def wait_all_blocks_free(launcher: Launcher, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        used = used_blocks(launcher)
        if not any(used.values()):
            return
        assert time.monotonic() < deadline, f"blocks still in use: {used}"
        time.sleep(0.2)


def test_streams_equal_the_colocated_engine(system: Launcher, tiny_served_model_dir: Path) -> None:
    ps = prompts(4)
    expected = reference(tiny_served_model_dir, ps, 12)
    for p, want in zip(ps, expected, strict=True):
        tokens, last = generate(system.gateway.target, request(p, 12))
        assert tokens == want
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert last.usage.prompt_tokens == len(p) and last.usage.completion_tokens == 12
        assert last.timings.kv_transfer_bytes > 0 and last.timings.prefill_node and last.timings.decode_node
    wait_all_blocks_free(system)


def test_sixteen_concurrent_streams(system: Launcher, tiny_served_model_dir: Path) -> None:
    ps = prompts(16, seed=1)
    expected = reference(tiny_served_model_dir, ps, 10)
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: generate(system.gateway.target, request(p, 10)), ps))
    assert [tokens for tokens, _ in results] == expected
    assert {last.timings.decode_node for _, last in results} == {"decode-0", "decode-1"}  # both nodes served
    wait_all_blocks_free(system)


def test_request_with_a_cached_prefix(system: Launcher, tiny_served_model_dir: Path) -> None:
    shared = prompts(1, seed=2)[0] * 2 + [77] * 40  # > 2 full blocks
    first, second = shared + [5, 6], shared + [9]
    expected = reference(tiny_served_model_dir, [first, second], 8)
    tokens1, _ = generate(system.gateway.target, request(first, 8))
    tokens2, last = generate(system.gateway.target, request(second, 8))
    assert [tokens1, tokens2] == expected
    assert last.usage.cached_tokens >= 16 * (len(shared) // 16) - 16  # routed back to the node holding the prefix


def test_cancel_mid_stream_frees_every_block(system: Launcher) -> None:
    with grpc.insecure_channel(system.gateway.target) as channel:
        call = generate_pb2_grpc.TandemStub(channel).Generate(request(prompts(1, seed=3)[0], 400), timeout=TIMEOUT_S)
        seen = 0
        for _ in call:
            seen += 1
            if seen == 3:
                call.cancel()
                break
    assert seen == 3
    wait_all_blocks_free(system)


def waiting_requests(launcher: Launcher) -> dict[str, int]:
    out = {}
    for spec in launcher.specs:
        if spec.role == "gateway":
            continue
        stub = prefill_pb2_grpc.PrefillStub if spec.role == "prefill" else decode_pb2_grpc.DecodeStub
        with grpc.insecure_channel(spec.target) as channel:
            stats = stub(channel).Stats(common_pb2.StatsRequest(), timeout=10)
            out[spec.name] = stats.num_waiting + stats.num_running
    return out


def test_cancellation_storm_at_random_stages_leaves_nothing_behind(system: Launcher) -> None:
    """120 requests, 24 at a time, each cancelled by the client 0-600 ms after it started (while queued,
    reserving, prefilling, transferring or decoding): afterwards no node holds a block or a request."""
    rng = random.Random(5)
    ps = prompts(120, seed=9)
    delays = [rng.uniform(0.0, 0.6) for _ in ps]

    def cancelled_call(i: int) -> str:
        with grpc.insecure_channel(system.gateway.target) as channel:
            call = generate_pb2_grpc.TandemStub(channel).Generate(request(ps[i], 64), timeout=TIMEOUT_S)
            timer = threading.Timer(delays[i], call.cancel)
            timer.start()
            try:
                for _ in call:
                    pass
                return "done"
            except grpc.RpcError as exc:
                return exc.code().name
            finally:
                timer.cancel()

    with ThreadPoolExecutor(24) as pool:
        outcomes = list(pool.map(cancelled_call, range(len(ps))))
    assert set(outcomes) <= {"done", "CANCELLED"}, outcomes
    assert outcomes.count("CANCELLED") > 60  # most were cut off somewhere on the way
    wait_all_blocks_free(system, timeout_s=30.0)
    assert not any(waiting_requests(system).values())


@pytest.mark.parametrize(("mutate", "field"), [
    (lambda r: r.ClearField("token_ids"), "input"),
    (lambda r: r.token_ids.ids.extend([5] * 1100), "token_ids"),
    (lambda r: setattr(r.sampling, "max_tokens", 0), "max_tokens"),
    (lambda r: setattr(r.sampling, "top_p", 1.5), "top_p"),
    (lambda r: setattr(r.sampling, "temperature", -1.0), "temperature"),
    (lambda r: setattr(r, "model", "no-such-model"), "model"),
])
def test_bad_input_is_invalid_argument_and_service_keeps_serving(system: Launcher, mutate: object, field: str) -> None:
    bad = request([10, 11, 12], 4)
    mutate(bad)  # type: ignore[operator]
    with pytest.raises(grpc.RpcError) as info:
        generate(system.gateway.target, bad)
    assert info.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE)
    assert field in (info.value.details() or "")
    tokens, _ = generate(system.gateway.target, request([10, 11, 12], 4))
    assert len(tokens) == 4


def test_node_failures(tiny_served_model_dir: Path, tmp_path: Path) -> None:
    with deployment(tiny_served_model_dir, tmp_path, prefill=2, decode=2) as launcher:
        gateway = launcher.gateway.target
        # A prefill node dies: requests go to the other one.
        os.kill(launcher.procs["prefill-0"].pid, signal.SIGKILL)
        launcher.procs["prefill-0"].wait(10)
        for p in prompts(3, seed=4):
            tokens, last = generate(gateway, request(p, 4))
            assert len(tokens) == 4 and last.timings.prefill_node == "prefill-1"
        # A decode node dies mid-stream: its streams continue on the other one (migration), new requests work.
        channel = grpc.insecure_channel(gateway)
        stub = generate_pb2_grpc.TandemStub(channel)
        calls = [stub.Generate(request(p, 300), timeout=TIMEOUT_S) for p in prompts(4, seed=5)]
        for call in calls:
            next(call)  # every stream has started (first token out)
        os.kill(launcher.procs["decode-0"].pid, signal.SIGKILL)
        launcher.procs["decode-0"].wait(10)
        codes = []
        for call in calls:
            try:
                for _ in call:
                    pass
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())
        channel.close()
        assert codes == [grpc.StatusCode.OK] * len(calls)
        for p in prompts(3, seed=6):
            tokens, last = generate(gateway, request(p, 4))
            assert len(tokens) == 4 and last.timings.decode_node == "decode-1"
        wait_all_blocks_free(launcher)


def test_graceful_stop_exits_cleanly_after_kv_transfers(tiny_served_model_dir: Path, tmp_path: Path) -> None:
    """SIGTERM after transfers: every process exits 0. A decode node used to abort at exit ("terminate called
    without an active exception") when a lost pair's thread was still dropping its gloo group."""
    with deployment(tiny_served_model_dir, tmp_path, prefill=1, decode=1) as launcher:
        for ids in prompts(3, seed=5):
            tokens, _ = generate(launcher.gateway.target, request(ids, max_tokens=4))
            assert len(tokens) == 4
    codes = {name: proc.returncode for name, proc in launcher.procs.items()}
    assert codes == dict.fromkeys(codes, 0), codes
    for log_file in tmp_path.glob("*.log"):
        assert "terminate called" not in log_file.read_text(errors="replace"), log_file.name


def test_load_beyond_the_decode_kv_cache_queues_and_completes(tiny_served_model_dir: Path, tmp_path: Path) -> None:
    """Twelve concurrent prompts of 3 blocks each against a decode node with 16 blocks: at most 4 fit at once
    (with their outputs), the rest wait in its admission queue; every request completes, none is refused."""
    topology = Topology(num_prefill=1, num_decode=1, free_ports=True,
                        model_args=("--model", str(tiny_served_model_dir), "--dtype", "float32"),
                        node_args=("--num-blocks", "16", "--block-size", "16", "--kv-timeout-s", "20",
                                   "--grace-s", "1"),
                        gateway_args=("--local-prefill-max-tokens", "0",
                                      "--stats-interval-s", "0.3", "--shutdown-grace-s", "1"))
    g = torch.Generator().manual_seed(7)
    ps = [torch.randint(20, 49000, (40,), generator=g).tolist() for _ in range(12)]
    expected = reference(tiny_served_model_dir, ps, 16)
    with Launcher(topology, log_dir=tmp_path) as launcher, ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda p: generate(launcher.gateway.target, request(p, 16)), ps))
        assert [tokens for tokens, _ in results] == expected
        wait_all_blocks_free(launcher)


def test_conditional_disaggregation_prefills_short_prompts_on_the_decode_node(tiny_served_model_dir: Path,
                                                                              tmp_path: Path) -> None:
    """With --local-prefill-max-tokens 32, a short prompt never touches a prefill node (no KV moves) and a
    long one is disaggregated; both stream exactly what the colocated engine generates."""
    topology = Topology(num_prefill=1, num_decode=1, free_ports=True,
                        model_args=("--model", str(tiny_served_model_dir), "--dtype", "float32"),
                        node_args=("--num-blocks", "64", "--kv-timeout-s", "20", "--grace-s", "1"),
                        gateway_args=("--stats-interval-s", "0.3", "--shutdown-grace-s", "1",
                                      "--local-prefill-max-tokens", "32"))
    g = torch.Generator().manual_seed(11)
    short, long = (torch.randint(20, 49000, (n,), generator=g).tolist() for n in (20, 70))
    expected = reference(tiny_served_model_dir, [short, long], 10)
    with Launcher(topology, log_dir=tmp_path) as launcher:
        short_tokens, short_last = generate(launcher.gateway.target, request(short, 10))
        long_tokens, long_last = generate(launcher.gateway.target, request(long, 10))
        assert [short_tokens, long_tokens] == expected
        assert short_last.timings.prefill_node == short_last.timings.decode_node == "decode-0"
        assert short_last.timings.kv_transfer_bytes == 0 and short_last.usage.completion_tokens == 10
        assert long_last.timings.prefill_node == "prefill-0" and long_last.timings.kv_transfer_bytes > 0
        wait_all_blocks_free(launcher)


def test_kv_load_failure_policy_recompute_prefills_on_the_decode_node(tiny_served_model_dir: Path,
                                                                      tmp_path: Path) -> None:
    """--kv-load-failure-policy recompute: with the prefill node dead, the KV can never arrive; the decode
    node computes the prompt itself and the client gets the same tokens (with `fail`: UNAVAILABLE)."""
    topology = Topology(num_prefill=1, num_decode=1, free_ports=True,
                        model_args=("--model", str(tiny_served_model_dir), "--dtype", "float32"),
                        node_args=("--num-blocks", "64", "--kv-timeout-s", "20", "--grace-s", "1"),
                        gateway_args=("--local-prefill-max-tokens", "0",
                                      "--stats-interval-s", "600", "--shutdown-grace-s", "1",
                                      "--kv-load-failure-policy", "recompute"))
    ps = prompts(2, seed=12)
    expected = reference(tiny_served_model_dir, ps, 8)
    with Launcher(topology, log_dir=tmp_path) as launcher:
        assert generate(launcher.gateway.target, request(ps[0], 8))[1].timings.prefill_node == "prefill-0"
        os.kill(launcher.procs["prefill-0"].pid, signal.SIGKILL)
        launcher.procs["prefill-0"].wait(10)
        for p, want in zip(ps, expected, strict=True):
            tokens, last = generate(launcher.gateway.target, request(p, 8))
            assert tokens == want
            assert last.timings.prefill_node == "decode-0" and last.timings.kv_transfer_bytes == 0
        wait_all_blocks_free(launcher)


def test_decode_node_speculates_with_a_draft_model(tiny_served_model_dir: Path, tmp_path: Path) -> None:
    """--speculative draft_model on a disaggregated decode node: the draft (here the target's own copy) takes
    its prompt KV from the target's, which the prefill node sent (no transfer of its own), and the greedy
    streams equal the colocated engine's."""
    topology = Topology(num_prefill=1, num_decode=1, free_ports=True,
                        model_args=("--model", str(tiny_served_model_dir), "--dtype", "float32"),
                        node_args=("--num-blocks", "64", "--kv-timeout-s", "20", "--grace-s", "1"),
                        decode_args=("--speculative", "draft_model", "--draft-model", str(tiny_served_model_dir),
                                     "--num-speculative-tokens", "4"),
                        gateway_args=("--local-prefill-max-tokens", "0",
                                      "--stats-interval-s", "0.3", "--shutdown-grace-s", "1"))
    ps = prompts(3, seed=13)
    expected = reference(tiny_served_model_dir, ps, 12)
    with Launcher(topology, log_dir=tmp_path) as launcher:
        for p, want in zip(ps, expected, strict=True):
            tokens, last = generate(launcher.gateway.target, request(p, 12))
            assert tokens == want and last.timings.kv_transfer_bytes > 0
        wait_all_blocks_free(launcher)
    assert "draft model" in (tmp_path / "decode-0.log").read_text()

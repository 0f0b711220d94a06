"""`tandem serve colocated` as a real process: the gateway's public API over one engine (the benchmark's
baseline), its health check, and the benchmark's client driving it (no timing assertions)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.serve_client import Api, drive
from benchmarks.serve_stats import summarize
from benchmarks.workloads import MixedWorkload
from common.serving.port_reservation import reserve_port
from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tandem_cli.launcher import ColocatedTopology, Launcher
from tests.e2e.test_disaggregated import generate, prompts, reference, request

pytestmark = pytest.mark.e2e


HTTP_PORT = reserve_port()
METRICS_PORT = reserve_port()


@pytest.fixture(scope="module")
def server(tiny_served_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    topology = ColocatedTopology(replicas=1, free_ports=True,
                                 model_args=("--model", str(tiny_served_model_dir), "--dtype", "float32"),
                                 node_args=("--num-blocks", "256", "--shutdown-grace-s", "1",
                                            "--http-port", str(HTTP_PORT), "--metrics-port", str(METRICS_PORT)))
    env = {"TANDEM_HOME": os.environ["TANDEM_HOME"]} if os.environ.get("TANDEM_HOME") else None
    with Launcher(topology, log_dir=tmp_path_factory.mktemp("logs"), env=env) as launcher:
        yield launcher


def target(launcher: Launcher) -> str:
    (spec,) = launcher.specs
    return spec.target


def test_streams_equal_the_colocated_engine_and_report_usage(server: Launcher, tiny_served_model_dir: Path) -> None:
    ps = prompts(6, seed=11)
    expected = reference(tiny_served_model_dir, ps, 9)
    with ThreadPoolExecutor(6) as pool:  # concurrent streams share the engine's batches
        results = list(pool.map(lambda p: generate(target(server), request(p, 9)), ps))
    assert [tokens for tokens, _ in results] == expected
    for p, (_, last) in zip(ps, results, strict=True):
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert last.usage.prompt_tokens == len(p) and last.usage.completion_tokens == 9
        assert last.timings.prefill_node == last.timings.decode_node == "colocated-0"
        assert last.timings.kv_transfer_bytes == 0  # nothing moves between processes


def test_metrics_carry_the_engine_series_beside_the_gateway_ones(server: Launcher) -> None:
    p = prompts(1, seed=12)[0]
    generate(target(server), request(p, 5))
    with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10) as response:
        samples = {s.name: s.value for f in text_string_to_metric_families(response.read().decode())
                   for s in f.samples}
    assert samples["tandem:request_success_total"] >= 1  # the gateway's
    assert samples["tandem:engine_step_prefill_tokens_total"] >= len(p)  # the engine's
    assert samples["tandem:engine_step_decode_tokens_total"] >= 4
    assert samples["tandem:engine_steps_total"] >= 5 and samples["tandem:engine_step_seconds_total"] > 0
    assert samples["tandem:num_requests_waiting"] == 0


def test_model_info_tokenize_and_stop_strings(server: Launcher) -> None:
    with grpc.insecure_channel(target(server)) as channel:
        stub = generate_pb2_grpc.TandemStub(channel)
        info = stub.ModelInfo(generate_pb2.ModelInfoRequest(), timeout=30)
        assert info.dtype == "float32" and info.num_prefill_nodes == info.num_decode_nodes == 1
        assert list(stub.Tokenize(generate_pb2.TokenizeRequest(text="hello"), timeout=30).token_ids)

        prompt = prompts(1, seed=21)[0]  # ordinary ids: the tiny model answers with words, not special tokens

        def text(stop: list[str]) -> tuple[str, generate_pb2.GenerateResponse]:
            replies = list(stub.Generate(generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=prompt), stop=stop,
                sampling=common_pb2.SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)), timeout=30))
            return "".join(r.text for r in replies), replies[-1]

        full, _ = text([])
        stop = full[len(full) // 2:][:2]
        assert len(stop) == 2
        cut, last = text([stop])
        assert cut == full[:full.index(stop)]  # up to the first occurrence, the stop string excluded
        assert last.finish_reason == common_pb2.FINISH_REASON_STOP and last.stop_string == stop


@pytest.mark.parametrize(("mutate", "field"), [
    (lambda r: r.token_ids.ids.extend([5] * 1100), "token_ids"),
    (lambda r: setattr(r.sampling, "top_p", 1.5), "top_p"),
    (lambda r: setattr(r, "model", "no-such-model"), "model"),
])
def test_bad_input_is_invalid_argument(server: Launcher, mutate: object, field: str) -> None:
    bad = request([10, 11, 12], 4)
    mutate(bad)  # type: ignore[operator]
    with pytest.raises(grpc.RpcError) as info:
        generate(target(server), bad)
    assert info.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE)
    assert field in (info.value.details() or "")


def test_cancel_mid_stream_then_keeps_serving(server: Launcher) -> None:
    with grpc.insecure_channel(target(server)) as channel:
        call = generate_pb2_grpc.TandemStub(channel).Generate(request(prompts(1, seed=3)[0], 400), timeout=60)
        for seen, _ in enumerate(call, 1):
            if seen == 3:
                call.cancel()
                break
    tokens, _ = generate(target(server), request([10, 11, 12], 4))
    assert len(tokens) == 4


def test_health_command_exit_codes(server: Launcher) -> None:
    def health(address: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tandem_cli", "health", "--target", address, "--timeout", "5"],
                              capture_output=True, text=True, timeout=60)

    ok = health(target(server))
    assert ok.returncode == 0 and "SERVING" in ok.stdout
    down = health("127.0.0.1:1")
    assert down.returncode == 1 and "UNAVAILABLE" in down.stdout


def test_benchmark_client_drives_the_server(server: Launcher) -> None:
    # The mixed workload shrunk to the tiny model: long prompts arriving while short requests decode.
    workload = MixedWorkload(num_requests=8, short_prompt_len=(8, 64), short_output_len=(2, 6),
                             long_prompt_len=(128, 256), long_output_len=(2, 4), seed=4)
    requests = workload.requests(vocab_size=49152, rate=50.0)
    records, duration = asyncio.run(drive([target(server)], requests, None, 60.0))
    summary = summarize("colocated", "here", records, duration)
    assert (summary.completed, summary.failed, summary.wrong_length) == (8, 0, 0)
    assert summary.output_tokens == sum(r.output_len for r in requests)
    assert summary.ttft_s is not None and summary.itl_s is not None
    assert {kind: k.completed for kind, k in summary.by_kind.items()} == {"short": 7, "long": 1}
    closed, _ = asyncio.run(drive([target(server)], requests, concurrency=3, timeout_s=60.0))
    assert [r.num_tokens for r in closed] == [r.output_len for r in requests]
    # The same workload over the OpenAI HTTP front (tandem bench serve --api openai).
    over_http, duration = asyncio.run(drive([f"http://127.0.0.1:{HTTP_PORT}"], requests, concurrency=3,
                                            timeout_s=60.0, api=Api.OPENAI))
    assert [r.num_tokens for r in over_http] == [r.output_len for r in requests]
    http_summary = summarize("colocated/openai", "here", over_http, duration)
    assert (http_summary.completed, http_summary.failed, http_summary.wrong_length) == (8, 0, 0)
    assert http_summary.ttft_s is not None


def test_openai_client_streams_a_chat_from_the_http_api(server: Launcher) -> None:
    """The colocated server serves the OpenAI-compatible HTTP API too, over the same engine."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{HTTP_PORT}/v1", api_key="unused", max_retries=0, timeout=60)
    (model,) = [m.id for m in client.models.list().data]
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                            temperature=0.0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6  # ignore_eos: all 6
    reply = client.completions.create(model=model, prompt="Hello", max_tokens=4, n=2, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    texts = [c.text for c in reply.choices]
    assert len(texts) == 2 and texts[0] == texts[1]  # greedy samples agree
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    # The second sample reused the first's prompt blocks (the prefix cache), when the prompt fills one.
    assert reply.usage.prompt_tokens_details is not None


def test_benchmark_client_runs_multi_turn_conversations(server: Launcher, tiny_served_model_dir: Path) -> None:
    """Each later turn is sent after the one before it, carrying that turn's prompt and the tokens the server
    generated for it: the prompt the next turn sends is exactly the conversation so far; TTFT per turn kind."""
    from benchmarks.workloads import MultiTurnWorkload

    workload = MultiTurnWorkload(num_conversations=3, turns=3, system_len=24, message_len=(4, 12),
                                 output_len=(3, 6), think_s=0.05, seed=2)
    requests = workload.requests(vocab_size=49152, rate=20.0)
    for closed_loop in (None, 2):
        records, duration = asyncio.run(drive([target(server)], requests, closed_loop, 60.0))
        summary = summarize("colocated", "here", records, duration)
        assert (summary.completed, summary.failed, summary.wrong_length) == (9, 0, 0)
        assert {kind: k.completed for kind, k in summary.by_kind.items()} == {"turn 1": 3, "turn 2": 3,
                                                                            "turns 3+": 3}
        for req in requests:
            if req.follows is not None:
                before = records[req.follows]
                assert records[req.index].prompt_len == (before.prompt_len + len(before.output_ids)
                                                         + len(req.prompt_token_ids))
                assert records[req.index].sent >= before.last  # sent after the previous turn's answer
    # the prompts the server saw are the conversation so far: the last turn's equals a reference of the whole
    conversation = [r for r in requests if r.index % 3 == 0]
    with pytest.raises(ValueError, match=r"multi-turn workload runs over gRPC only"):
        asyncio.run(drive([f"http://127.0.0.1:{HTTP_PORT}"], conversation, None, 10.0, api=Api.OPENAI))

"""Request migration: a stream whose node dies continues on another node from the prompt plus the tokens
already streamed (real gateway, scripted nodes on 127.0.0.1, nodes stopped as a death), within the
``migration_limit`` budget; past it the request ends UNAVAILABLE."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from scripted_nodes import Cluster, eventually, free_port, logprob, run_async, scripted_cluster

from common.config.settings import load_settings
from common.telemetry import spans
from common.telemetry.metrics import GatewayMetrics
from gateway.coordinator import Coordinator
from gateway.model import ServedModel
from gateway.node_pool import NodePool
from gateway.request import GatewayRequest
from gateway.router import Router
from gateway.settings import GatewaySettings
from tandem.v1 import common_pb2, generate_pb2

pytestmark = pytest.mark.real_model

G = generate_pb2.GenerateRequest
S = common_pb2.SamplingParams
TEXT = " The quick brown fox jumps over the lazy dog. It was a sunny day."  # 16 tokens


def script(model: ServedModel) -> list[int]:
    return model.tokenizer.encode(TEXT, add_special_tokens=False)


async def received_until_hang(c: Cluster, call: grpc.aio.UnaryStreamCall, node: int,
                              ) -> list[generate_pb2.GenerateResponse]:
    """Read the stream until decode node ``node`` hangs (what it streamed has reached the gateway)."""
    messages = [await call.read()]
    await asyncio.wait_for(c.decodes[node].hanging.wait(), 10)
    return messages


async def read_rest(call: grpc.aio.UnaryStreamCall) -> list[generate_pb2.GenerateResponse]:
    messages = []
    while (m := await call.read()) is not grpc.aio.EOF:
        messages.append(m)
    return messages


def migrations_metric(port: int) -> dict[str, float]:
    """tandem:request_migrations_total by lost role, scraped from the gateway's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("tandem:request_migrations_total{"):
            role = line.split('role="')[1].split('"')[0]
            out[role] = float(line.rsplit(" ", 1)[1])
    return out


def test_decode_death_mid_stream_continues_on_another_node(served_model: ServedModel, smollm2_dir: Path) -> None:
    tokens = script(served_model)
    metrics_port = free_port()

    async def scenario() -> None:
        async with scripted_cluster(served_model, smollm2_dir, tokens, num_decode=2, stats_interval_s=60,
                                    metrics_port=metrics_port) as c:
            c.decodes[0].hang_after = 4  # the prefill's token and 4 decode tokens reach the client, then it dies
            c.script.token_delay_s = 0.005
            call = c.stub.Generate(G(text="Hi", request_id="m1", sampling=S(max_tokens=12, logprobs=0),
                                     stream=generate_pb2.StreamOptions(include_token_ids=True)))
            before = await received_until_hang(c, call, 0)
            await c.node_servers["decode-0"].stop(0)  # the node dies under the stream
            messages = before + await read_rest(call)
            # One uninterrupted stream: every token once, in order, its text and logprobs at their positions.
            assert [t for m in messages for t in m.token_ids] == tokens[:12]
            assert "".join(m.text for m in messages) == served_model.tokenizer.decode(tokens[:12])
            assert [lp for m in messages for lp in m.logprobs] == [logprob(t, i) for i, t in enumerate(tokens[:12])]
            last = messages[-1]
            assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
            prompt = served_model.tokenizer.encode("Hi")
            assert last.usage == generate_pb2.Usage(prompt_tokens=len(prompt), completion_tokens=12, cached_tokens=0)
            assert last.timings.decode_node == "decode-1"
            assert 0 < last.timings.time_to_first_token < last.timings.e2e_seconds
            # The continuation: the prompt plus the 5 streamed tokens, re-prefilled, max_tokens counting them.
            resumed = c.decodes[1].last_request
            assert resumed is not None and list(resumed.prompt_token_ids) == prompt + tokens[:5]
            assert (resumed.resumed_output_tokens, resumed.sampling.max_tokens) == (5, 7)
            prefill = c.prefills[0].last_request
            assert prefill is not None and list(prefill.prompt_token_ids) == prompt + tokens[:5]
            assert prefill.resumed_output_tokens == 5 and prefill.destination.node_id == "decode-1"
            assert c.prefills[0].record.completed == ["m1", "m1"]
            assert migrations_metric(metrics_port) == {"decode": 1.0}
            # The dead node is out of routing: new requests go to decode-1 without a try on decode-0.
            loads = {n.node_id or n.target: n for n in (await c.stub.GetLoads(generate_pb2.GetLoadsRequest())).nodes}
            assert not loads["decode-0"].reachable
            again = [m async for m in c.stub.Generate(G(text="Hi", sampling=S(max_tokens=3)))]
            assert again[-1].timings.decode_node == "decode-1"

    run_async(scenario())


def test_a_decode_node_cancelling_its_call_is_a_lost_node_not_our_cancel(served_model: ServedModel,
                                                                         smollm2_dir: Path) -> None:
    """A decode node that ends a stream CANCELLED itself (its shutdown grace ran out) lost the request: it
    continues on another node. grpc's ``call.cancelled()`` is true for a CANCELLED status from either side, so
    the gateway used to take the node's cancel for its own, read nothing more and leave the client waiting until
    its deadline."""
    tokens = script(served_model)

    async def scenario() -> None:
        async with scripted_cluster(served_model, smollm2_dir, tokens, num_decode=2, stats_interval_s=60) as c:
            c.decodes[0].cancel_after = 4
            c.decodes[1].cancel_after = None
            call = c.stub.Generate(G(text="Hi", request_id="c1", sampling=S(max_tokens=12),
                                     stream=generate_pb2.StreamOptions(include_token_ids=True)), timeout=30)
            messages = await asyncio.wait_for(read_rest(call), 15)
            assert [t for m in messages for t in m.token_ids] == tokens[:12]
            assert messages[-1].timings.decode_node == "decode-1"
            assert c.decodes[1].record.completed == ["c1"]

    run_async(scenario())


def test_a_call_cancelled_under_the_gateway_is_the_nodes_failure(served_model: ServedModel,
                                                                  smollm2_dir: Path) -> None:
    """A decode stream whose channel closes under its reader (not our own cancel, which cancels the reader
    first) is read as the node's failure, queued for the request (so it migrates or fails with the node's
    status), never as a bare CancelledError that would reach the client as CANCELLED."""
    from common.serving.channel import open_channel
    from gateway.decode_leg import read_decode_stream as _read_decode_stream
    from tandem.v1 import decode_pb2, decode_pb2_grpc

    tokens = script(served_model)

    async def scenario() -> None:
        async with scripted_cluster(served_model, smollm2_dir, tokens, num_decode=1, stats_interval_s=60) as c:
            c.decodes[0].hang_after = 2
            channel = open_channel(c.node_servers["decode-0"].address)
            call = decode_pb2_grpc.DecodeStub(channel).Generate(decode_pb2.DecodeRequest(
                request_id="r1", prompt_token_ids=[1, 2, 3], kv_timeout_seconds=10,
                sampling=common_pb2.SamplingParams(max_tokens=8)))
            queue: asyncio.Queue[object] = asyncio.Queue()
            reader = asyncio.ensure_future(_read_decode_stream(call, queue))  # type: ignore[arg-type]
            await eventually(lambda: queue.qsize() == 1)  # the reservation
            c.board.push("decode-0/r1", tokens[0])  # the KV "arrived": the node streams two tokens, then hangs
            await asyncio.wait_for(c.decodes[0].hanging.wait(), 10)
            await eventually(lambda: queue.qsize() == 3)  # both deltas read (they may land after the hang)
            await channel.close()  # cancels the call on this side
            failure = await asyncio.wait_for(reader, 10)
            assert isinstance(failure, grpc.aio.AioRpcError) and failure.code() == grpc.StatusCode.CANCELLED
            items = [queue.get_nowait() for _ in range(queue.qsize())]
            assert items[-1] is failure and len(items) == 4  # the reservation, two deltas, the failure

            # the reader's own cancellation is still a cancellation
            channel = open_channel(c.node_servers["decode-0"].address)
            c.decodes[0].hanging.clear()
            call = decode_pb2_grpc.DecodeStub(channel).Generate(decode_pb2.DecodeRequest(
                request_id="r2", prompt_token_ids=[1, 2, 3], kv_timeout_seconds=10,
                sampling=common_pb2.SamplingParams(max_tokens=8)))
            queue = asyncio.Queue()
            reader = asyncio.ensure_future(_read_decode_stream(call, queue))  # type: ignore[arg-type]
            await eventually(lambda: queue.qsize() == 1)
            c.board.push("decode-0/r2", tokens[0])
            await asyncio.wait_for(c.decodes[0].hanging.wait(), 10)
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader
            call.cancel()
            await channel.close()

    run_async(scenario())


def test_stop_string_and_min_tokens_across_a_migration(served_model: ServedModel, smollm2_dir: Path) -> None:
    tokens = script(served_model)
    stop_at = served_model.tokenizer.decode(tokens[:9])  # " ... lazy dog": ends in the continuation

    async def scenario() -> None:
        async with scripted_cluster(served_model, smollm2_dir, tokens, num_decode=2, stats_interval_s=60) as c:
            c.decodes[0].hang_after = 2
            call = c.stub.Generate(G(text="Hi", sampling=S(max_tokens=16, min_tokens=6), stop=[" dog"]))
            before = await received_until_hang(c, call, 0)
            await c.node_servers["decode-0"].stop(0)
            messages = before + await read_rest(call)
            assert "".join(m.text for m in messages) == stop_at.removesuffix(" dog")
            last = messages[-1]
            assert (last.finish_reason, last.stop_string) == (common_pb2.FINISH_REASON_STOP, " dog")
            assert last.usage.completion_tokens == 9
            resumed = c.decodes[1].last_request
            assert resumed is not None
            assert (resumed.sampling.max_tokens, resumed.sampling.min_tokens, resumed.resumed_output_tokens) == \
                (13, 3, 3)

    run_async(scenario())


def test_past_the_budget_the_request_ends_unavailable(served_model: ServedModel, smollm2_dir: Path) -> None:
    tokens = script(served_model)

    async def scenario() -> None:
        async with scripted_cluster(served_model, smollm2_dir, tokens, num_decode=3, stats_interval_s=60,
                                    migration_limit=1) as c:
            c.decodes[0].hang_after = 3
            c.decodes[1].hang_after = 2
            c.decodes[2].hang_after = 0
            call = c.stub.Generate(G(text="Hi", request_id="b1", sampling=S(max_tokens=12),
                                     stream=generate_pb2.StreamOptions(include_token_ids=True)))
            before = await received_until_hang(c, call, 0)
            await c.node_servers["decode-0"].stop(0)  # migration 1 of 1: to decode-1
            await asyncio.wait_for(c.decodes[1].hanging.wait(), 10)
            await c.node_servers["decode-1"].stop(0)  # a second loss: past the budget
            with pytest.raises(grpc.aio.AioRpcError) as err:
                before += await read_rest(call)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "decode node" in err.value.details()
            assert c.decodes[2].record.requests == []

    run_async(scenario())


def test_migration_limit_zero_disables_it(served_model: ServedModel, smollm2_dir: Path) -> None:
    async def scenario() -> None:
        async with scripted_cluster(served_model, smollm2_dir, script(served_model), num_decode=2,
                                    stats_interval_s=60, migration_limit=0) as c:
            c.decodes[0].hang_after = 1
            call = c.stub.Generate(G(text="Hi"))
            await received_until_hang(c, call, 0)
            await c.node_servers["decode-0"].stop(0)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await read_rest(call)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert c.decodes[1].record.requests == []

    run_async(scenario())


def test_prefill_deaths_mid_transfer_rerun_on_other_prefills(served_model: ServedModel, smollm2_dir: Path) -> None:
    tokens = script(served_model)
    metrics_port = free_port()

    async def scenario() -> None:
        async with scripted_cluster(served_model, smollm2_dir, tokens, num_prefill=3, stats_interval_s=60,
                                    metrics_port=metrics_port) as c:
            c.prefills[0].delay_before_push_s = c.prefills[1].delay_before_push_s = 30  # mid-prefill when they die
            call = c.stub.Generate(G(text="Hi", request_id="p1", sampling=S(max_tokens=6),
                                     stream=generate_pb2.StreamOptions(include_token_ids=True)))
            # The first death: the reservation is tried once more, on another prefill node ...
            await eventually(lambda: c.prefills[0].record.requests == ["p1"])
            await c.node_servers["prefill-0"].stop(0)
            # ... the second: a migration (a fresh reservation, the lost nodes avoided).
            await eventually(lambda: c.prefills[1].record.requests == ["p1"])
            await c.node_servers["prefill-1"].stop(0)
            messages = await read_rest(call)
            assert [t for m in messages for t in m.token_ids] == tokens[:6]
            assert messages[-1].timings.prefill_node == "prefill-2"
            assert c.prefills[2].record.completed == ["p1"]
            await eventually(lambda: len(c.decodes[0].record.cancelled) == 1)  # the first reservation freed
            assert migrations_metric(metrics_port) == {"prefill": 1.0}

    run_async(scenario())


def test_a_transfer_failing_after_the_first_token_continues_from_it(served_model: ServedModel,
                                                                      smollm2_dir: Path) -> None:
    """The prefill node answers with the first token before its KV transfer ends, and the gateway hands it to the
    client at once; a transfer that then fails continues the request from that token (a migration), so the
    client's stream has every token once. Past the migration budget the request ends with the failure's status."""
    tokens = script(served_model)
    metrics_port = free_port()

    async def scenario() -> None:
        async with scripted_cluster(served_model, smollm2_dir, tokens, stats_interval_s=60,
                                    metrics_port=metrics_port) as c:
            c.prefills[0].delay_after_push_s = 0.3  # the transfer's acks come well after the first answer
            started = time.monotonic()
            call = c.stub.Generate(G(text="Hi", request_id="early", sampling=S(max_tokens=6),
                                     stream=generate_pb2.StreamOptions(include_token_ids=True)))
            first = await call.read()
            assert list(first.token_ids) == tokens[:1] and time.monotonic() - started < 0.3
            rest = await read_rest(call)
            assert [t for m in [first, *rest] for t in m.token_ids] == tokens[:6]
            assert rest[-1].timings.kv_transfer_bytes == 1234  # the transfer's end, counted once

            c.prefills[0].transfer_fails_with = grpc.StatusCode.UNAVAILABLE  # after the first answer, once
            call = c.stub.Generate(G(text="Hi", request_id="lost", sampling=S(max_tokens=6),
                                     stream=generate_pb2.StreamOptions(include_token_ids=True)))
            messages = await read_rest(call)
            assert [t for m in messages for t in m.token_ids] == tokens[:6]
            prefill = c.prefills[0].last_request  # the continuation: the prompt and the token the client has
            prompt = served_model.tokenizer.encode("Hi")
            assert prefill is not None and list(prefill.prompt_token_ids) == prompt + tokens[:1]
            assert prefill.resumed_output_tokens == 1
            assert c.prefills[0].record.completed == ["early", "lost"]
            await eventually(lambda: c.decodes[0].record.cancelled == ["lost"])  # the first reservation freed
            assert c.board.open_transfers == 0
            assert migrations_metric(metrics_port) == {"prefill": 1.0}

    run_async(scenario())

    async def past_the_budget() -> None:
        async with scripted_cluster(served_model, smollm2_dir, tokens, stats_interval_s=60, migration_limit=0) as c:
            c.prefills[0].transfer_fails_with = grpc.StatusCode.UNAVAILABLE
            call = c.stub.Generate(G(text="Hi", sampling=S(max_tokens=6),
                                     stream=generate_pb2.StreamOptions(include_token_ids=True)))
            first = await call.read()
            assert list(first.token_ids) == tokens[:1]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await read_rest(call)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "scripted transfer failure on prefill-0" in (err.value.details() or "")
            await eventually(lambda: c.board.open_transfers == 0 and len(c.decodes[0].record.cancelled) == 1)

    run_async(past_the_budget())


def test_migrations_are_marked_on_the_request_span(served_model: ServedModel, smollm2_dir: Path) -> None:
    """The coordinator alone over the scripted nodes, under a real SDK tracer of the test's own (the process-wide
    provider stays untouched): a ``migrated`` event per migration and the count as an attribute."""
    tokens = script(served_model)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def scenario() -> None:
        async with scripted_cluster(served_model, smollm2_dir, tokens, num_decode=2) as c:
            c.decodes[0].hang_after = 3
            targets = [c.node_servers[d.node_id].address for d in c.decodes]
            router = Router([c.node_servers["prefill-0"].address], targets)
            pool = NodePool(router, stats_interval_s=60)
            await pool.start()
            metrics = GatewayMetrics()
            coordinator = Coordinator(served_model, router, pool, kv_timeout_s=10, migration_limit=2,
                                      metrics=metrics)
            req = GatewayRequest.from_proto(G(text="Hi", request_id="s1", sampling=S(max_tokens=10)), served_model)
            got: list[int] = []
            try:
                with provider.get_tracer("test").start_as_current_span("generate"):
                    async def kill_when_hanging() -> None:
                        await c.decodes[0].hanging.wait()
                        await c.node_servers["decode-0"].stop(0)

                    killer = asyncio.create_task(kill_when_hanging())
                    async for chunk in coordinator.generate(req, time.monotonic(), time.monotonic() + 20):
                        got += chunk.token_ids
                    await killer
            finally:
                await pool.close()
            assert got == tokens[:10]
            assert metrics.registry.get_sample_value("tandem:request_migrations_total",
                                                     {"node": "gateway", "role": "decode"}) == 1.0
            assert not router.decode[targets[0]].reachable  # the dead node is out of routing

    run_async(scenario())
    (span,) = exporter.get_finished_spans()
    migrated = [e for e in span.events if e.name == "migrated"]
    assert len(migrated) == 1 and span.attributes is not None and span.attributes[spans.MIGRATIONS] == 1
    attributes = migrated[0].attributes or {}
    assert attributes[spans.LOST_ROLE] == "decode" and attributes[spans.STREAMED_TOKENS] == 4
    assert [e.name for e in span.events].count("reserved") == 2


def test_migration_limit_setting(tmp_path: Path) -> None:
    env = {"TANDEM_MODEL_DIR": str(tmp_path), "TANDEM_PREFILL_TARGETS": "127.0.0.1:7001",
           "TANDEM_DECODE_TARGETS": "127.0.0.1:7101"}
    assert load_settings(GatewaySettings, environ=env).migration_limit == 3
    assert load_settings(GatewaySettings, environ={**env, "TANDEM_MIGRATION_LIMIT": "0"}).migration_limit == 0
    with pytest.raises(ValueError, match="migration_limit must be >= 0"):
        load_settings(GatewaySettings, {"migration_limit": -1}, environ=env)

"""The gateway as a real grpc.aio server in front of scripted prefill/decode nodes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from scripted_nodes import Cluster, eventually, logprob, run_async, scripted_cluster

from gateway.model import ServedModel
from tandem.v1 import common_pb2, generate_pb2

T = TypeVar("T")

pytestmark = pytest.mark.real_model

G = generate_pb2.GenerateRequest
S = common_pb2.SamplingParams
TEXT = " The quick brown fox jumps over the lazy dog."  # 10 tokens


def script(model: ServedModel) -> list[int]:
    return model.tokenizer.encode(TEXT, add_special_tokens=False)


async def generate(c: Cluster, request: generate_pb2.GenerateRequest) -> list[generate_pb2.GenerateResponse]:
    return [m async for m in c.stub.Generate(request)]


async def read_rest(call: grpc.aio.UnaryStreamCall) -> list[generate_pb2.GenerateResponse]:
    """The remaining messages of a call already read with ``read()`` (the two styles cannot be mixed)."""
    messages = []
    while (m := await call.read()) is not grpc.aio.EOF:
        messages.append(m)
    return messages


async def failure(c: Cluster, request: generate_pb2.GenerateRequest, **kwargs: float) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in c.stub.Generate(request, **kwargs):
            pass
    return err.value


def test_first_token_streams_when_prefill_answers_then_deltas_then_finish(served_model: ServedModel,
                                                                          smollm2_dir: Path) -> None:
    tokens = script(served_model)

    async def scenario() -> None:
        async with scripted_cluster(served_model, smollm2_dir, tokens) as c:
            c.script.gate = asyncio.Event()  # the decode node holds its deltas until the test opens the gate
            call = c.stub.Generate(G(text="Hi", request_id="r1", sampling=S(max_tokens=8, logprobs=0),
                                     stream=generate_pb2.StreamOptions(include_token_ids=True)))
            first = await call.read()
            assert (first.request_id, first.text, list(first.token_ids)) == ("r1", " The", tokens[:1])
            assert first.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED and not first.HasField("usage")
            assert c.decodes[0].record.completed == []  # no decode delta was needed for the first token
            c.script.gate.set()
            rest = await read_rest(call)
            messages = [first, *rest]
            assert [t for m in messages for t in m.token_ids] == tokens[:8]
            assert "".join(m.text for m in messages) == served_model.tokenizer.decode(tokens[:8])
            assert [lp for m in messages for lp in m.logprobs] == [logprob(t, i) for i, t in enumerate(tokens[:8])]
            assert {m.request_id for m in messages} == {"r1"}
            assert {m.finish_reason for m in messages[:-1]} == {common_pb2.FINISH_REASON_UNSPECIFIED}
            last = messages[-1]
            assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
            prompt = served_model.tokenizer.encode("Hi")
            assert last.usage == generate_pb2.Usage(prompt_tokens=len(prompt), completion_tokens=8, cached_tokens=0)
            assert (last.timings.prefill_node, last.timings.decode_node) == ("prefill-0", "decode-0")
            assert last.timings.kv_transfer_bytes == 1234
            assert 0 < last.timings.time_to_first_token <= last.timings.e2e_seconds
            # What the nodes were asked: the same prompt and sampling; the prefill writes into the reservation.
            decode_request = c.decodes[0].last_request
            assert decode_request is not None and list(decode_request.prompt_token_ids) == prompt
            assert decode_request.sampling.max_tokens == 8 and decode_request.kv_timeout_seconds > 0
            assert list(decode_request.eos_token_ids) == list(served_model.eos_token_ids)
            assert c.prefills[0].record.completed == ["r1"] and c.board.open_transfers == 0

    run_async(scenario())


def test_defaults_text_only_stream_and_engine_stop(served_model: ServedModel, smollm2_dir: Path) -> None:
    tokens = script(served_model)

    async def scenario() -> None:
        async with scripted_cluster(served_model, smollm2_dir, tokens) as c:
            c.prefills[0].num_cached_tokens = 1
            messages = await generate(c, G(text="Hi"))  # max_tokens unset -> 16; the script ends after 10
            assert c.decodes[0].last_request.sampling.max_tokens == 16  # type: ignore[union-attr]
            assert all(not m.token_ids and not m.logprobs for m in messages)
            assert "".join(m.text for m in messages) == TEXT
            assert messages[-1].finish_reason == common_pb2.FINISH_REASON_STOP
            assert messages[-1].usage.completion_tokens == 10 and messages[-1].usage.cached_tokens == 1
            assert len(messages[0].request_id) == 32  # made up by the gateway

            one = await generate(c, G(text="Hi", sampling=S(max_tokens=1)))  # ends at the prefill's token
            assert [m.text for m in one] == [" The", ""]
            assert one[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH and one[-1].usage.completion_tokens == 1

    run_async(scenario())


def test_tokens_that_queue_up_behind_a_slow_writer_go_out_as_one_message(served_model: ServedModel,
                                                                          smollm2_dir: Path) -> None:
    tokens = script(served_model)

    async def scenario() -> None:
        async with scripted_cluster(served_model, smollm2_dir, tokens) as c:
            # The decode streams all its deltas as soon as the KV lands; the prefill's first answer comes 0.3 s
            # later, so by the time the first token is written the other nine are all waiting.
            c.prefills[0].answer_delay_s = 0.3
            messages = await generate(c, G(text="Hi", stream=generate_pb2.StreamOptions(include_token_ids=True)))
            assert [list(m.token_ids) for m in messages] == [tokens[:1], tokens[1:]]
            assert [m.text for m in messages] == [" The", TEXT.removeprefix(" The")]

    run_async(scenario())


def test_stop_string_truncates_finishes_and_cancels_the_decode(served_model: ServedModel, smollm2_dir: Path) -> None:
    tokens = script(served_model)

    async def scenario() -> None:
        async with scripted_cluster(served_model, smollm2_dir, tokens) as c:
            c.script.token_delay_s = 0.05  # the decode would still be streaming when the stop matches
            messages = await generate(c, G(text="Hi", request_id="s1", stop=["dog", "fox jumps"]))
            assert "".join(m.text for m in messages) == " The quick brown "
            last = messages[-1]
            assert (last.finish_reason, last.stop_string) == (common_pb2.FINISH_REASON_STOP, "fox jumps")
            assert last.usage.completion_tokens == 5  # " The", " quick", " brown", " fox", " jumps"
            await eventually(lambda: c.decodes[0].record.cancelled == ["s1"])
            assert c.board.open_transfers == 0

            messages = await generate(c, G(text="Hi", stop=[" The"], include_stop_string=True))  # the first token
            assert [m.text for m in messages] == [" The"] and messages[0].stop_string == " The"

    run_async(scenario())


def test_client_cancel_cancels_both_legs(served_model: ServedModel, smollm2_dir: Path) -> None:
    tokens = script(served_model)

    async def scenario() -> None:
        async with scripted_cluster(served_model, smollm2_dir, tokens) as c:
            prefill, decode = c.prefills[0], c.decodes[0]
            prefill.delay_before_push_s = 30  # cancel while the prefill is running
            call = c.stub.Generate(G(text="Hi", request_id="c1"))
            await eventually(lambda: prefill.record.requests == ["c1"])
            call.cancel()
            await eventually(lambda: prefill.record.cancelled == ["c1"] and decode.record.cancelled == ["c1"])

            prefill.delay_before_push_s = 0
            c.script.gate = asyncio.Event()  # cancel while the decode is streaming
            call = c.stub.Generate(G(text="Hi", request_id="c2"))
            assert (await call.read()).text == " The"
            call.cancel()
            await eventually(lambda: decode.record.cancelled == ["c1", "c2"])
            assert prefill.record.completed == ["c2"] and c.board.open_transfers == 0
            c.script.gate.set()
            assert (await generate(c, G(text="Hi")))[-1].finish_reason == common_pb2.FINISH_REASON_STOP

    run_async(scenario())


def test_bad_input_is_invalid_argument_naming_the_field(served_model: ServedModel, smollm2_dir: Path) -> None:
    cases = [
        (G(text=""), "text"),
        (G(token_ids=generate_pb2.TokenIds(ids=[100] * 8192)), "token_ids: prompt has 8192 tokens, limit 8191"),
        (G(text="Hi", sampling=S(max_tokens=0)), "sampling.max_tokens"),
        (G(text="Hi", sampling=S(top_p=1.5)), "sampling.top_p"),
        (G(text="Hi", sampling=S(temperature=-1)), "sampling.temperature"),
        (G(text="Hi", model="llama-70b"), "model: unknown model 'llama-70b'"),
    ]

    async def scenario() -> None:
        async with scripted_cluster(served_model, smollm2_dir, script(served_model)) as c:
            for request, expected in cases:
                err = await failure(c, request)
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and expected in err.details()
            assert c.decodes[0].record.requests == []  # rejected before any node was involved
            assert (await generate(c, G(text="Hi")))[-1].finish_reason == common_pb2.FINISH_REASON_STOP

    run_async(scenario())


def test_over_max_inflight_without_a_queue_is_resource_exhausted(served_model: ServedModel,
                                                                  smollm2_dir: Path) -> None:
    async def scenario() -> None:
        async with scripted_cluster(served_model, smollm2_dir, script(served_model), max_inflight=1,
                                    max_queued=0) as c:
            c.script.gate = asyncio.Event()
            held = c.stub.Generate(G(text="Hi"))
            await held.read()
            err = await failure(c, G(text="Hi"))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_inflight=1" in err.details()
            c.script.gate.set()
            assert (await read_rest(held))[-1].finish_reason == common_pb2.FINISH_REASON_STOP
            assert (await generate(c, G(text="Hi")))[-1].finish_reason == common_pb2.FINISH_REASON_STOP

    run_async(scenario())


async def loads(c: Cluster) -> generate_pb2.GetLoadsResponse:
    return await c.stub.GetLoads(generate_pb2.GetLoadsRequest(), timeout=5)


async def eventually_async(get: Callable[[], Awaitable[T]], check: Callable[[T], bool], timeout_s: float = 3.0) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        value = await get()
        if check(value) or time.monotonic() > deadline:
            assert check(value), value
            return value
        await asyncio.sleep(0.02)


def test_beyond_max_inflight_requests_queue_then_run(served_model: ServedModel, smollm2_dir: Path) -> None:
    """Load beyond the in-flight limit waits for a slot (FIFO) instead of failing; only a full queue or a
    wait past queue_timeout_s is refused, naming the limit."""
    async def scenario() -> None:
        async with scripted_cluster(served_model, smollm2_dir, script(served_model), max_inflight=1,
                                    max_queued=1, queue_timeout_s=30) as c:
            c.script.gate = asyncio.Event()
            held = c.stub.Generate(G(text="Hi"))
            await held.read()  # holds the only slot
            queued = asyncio.create_task(generate(c, G(text="Hi")))
            await eventually_async(lambda: loads(c), lambda r: r.num_queued == 1)
            err = await failure(c, G(text="Hi"))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queued=1" in err.details()
            c.script.gate.set()
            assert (await read_rest(held))[-1].finish_reason == common_pb2.FINISH_REASON_STOP
            assert (await queued)[-1].finish_reason == common_pb2.FINISH_REASON_STOP
            final = await loads(c)
            assert (final.num_inflight, final.num_queued) == (0, 0)

        async with scripted_cluster(served_model, smollm2_dir, script(served_model), max_inflight=1,
                                    max_queued=4, queue_timeout_s=0.3) as c:
            c.script.gate = asyncio.Event()
            held = c.stub.Generate(G(text="Hi"))
            await held.read()
            err = await failure(c, G(text="Hi"))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue_timeout_s=0.3" in err.details()
            assert (await loads(c)).num_queued == 0
            c.script.gate.set()
            assert (await read_rest(held))[-1].finish_reason == common_pb2.FINISH_REASON_STOP

    run_async(scenario())


def test_prefill_node_down_is_skipped_or_retried_on_another(served_model: ServedModel, smollm2_dir: Path) -> None:
    async def scenario() -> None:
        # Targets: a port nobody listens on (marked unreachable by the first poll), prefill-0, prefill-1.
        async with scripted_cluster(served_model, smollm2_dir, script(served_model), num_prefill=2, dead_prefill=1,
                                    stats_interval_s=60) as c:
            await c.node_servers["prefill-0"].stop(0)  # dies after the poll: the router still picks it
            messages = await generate(c, G(text="Hi", request_id="p1"))
            assert messages[-1].timings.prefill_node == "prefill-1"
            assert c.prefills[1].record.completed == ["p1"] and c.decodes[0].record.completed == ["p1"]
            await c.node_servers["prefill-1"].stop(0)
            err = await failure(c, G(text="Hi", request_id="p2"))
            assert err.code() == grpc.StatusCode.UNAVAILABLE and "prefill node" in err.details()
            # Its reservation, started beside the prefill, is cancelled (if the decode node saw it before then).
            await eventually(lambda: c.board.open_transfers == 0
                             and c.decodes[0].record.cancelled == c.decodes[0].record.requests[1:])

    run_async(scenario())


def test_prefill_errors_map_to_statuses_without_retry(served_model: ServedModel, smollm2_dir: Path) -> None:
    async def scenario() -> None:
        # migration_limit=0: an UNAVAILABLE answer would otherwise move the request on
        # (tests/gateway/test_gateway_migration.py)
        async with scripted_cluster(served_model, smollm2_dir, script(served_model), num_prefill=2,
                                    migration_limit=0) as c:
            for code, expected in [(grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE),  # alive: no retry
                                   (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT),
                                   (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.INTERNAL)]:
                c.prefills[0].fail_with = code
                err = await failure(c, G(text="Hi"))
                assert err.code() == expected and "scripted failure on prefill-0" in err.details()
            assert c.prefills[1].record.requests == []
            # Every reservation, started beside the prefill, is cancelled (those the decode node saw before then).
            await eventually(lambda: c.board.open_transfers == 0
                             and c.decodes[0].record.cancelled == c.decodes[0].record.requests)
            assert c.decodes[0].record.completed == []

    run_async(scenario())


def test_decode_node_down(served_model: ServedModel, smollm2_dir: Path) -> None:
    async def scenario() -> None:
        async with scripted_cluster(served_model, smollm2_dir, script(served_model), num_decode=2, dead_decode=1,
                                    stats_interval_s=60) as c:
            await c.node_servers["decode-0"].stop(0)  # dies after the poll: retried on decode-1
            messages = await generate(c, G(text="Hi"))
            assert messages[-1].timings.decode_node == "decode-1"
            await c.node_servers["decode-1"].stop(0)
            err = await failure(c, G(text="Hi"))
            assert err.code() == grpc.StatusCode.UNAVAILABLE and "decode node" in err.details()
            # The prefill started with the failed request too (before its reservation) and was cancelled (if the
            # call reached the node before the reservation failed).
            await eventually(lambda: c.prefills[0].record.cancelled == c.prefills[0].record.requests[1:])
            assert c.prefills[0].record.completed == [messages[0].request_id]

    run_async(scenario())


def test_decode_killed_mid_stream_ends_it_unavailable_and_routes_new_requests_elsewhere(
        served_model: ServedModel, smollm2_dir: Path) -> None:
    async def scenario() -> None:
        # migration_limit=0: no migration (with it, the stream goes on elsewhere:
        # tests/gateway/test_gateway_migration.py)
        async with scripted_cluster(served_model, smollm2_dir, script(served_model), num_decode=2,
                                    stats_interval_s=60, migration_limit=0) as c:
            c.script.gate = asyncio.Event()
            call = c.stub.Generate(G(text="Hi"))
            await call.read()
            await c.node_servers["decode-0"].stop(0)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "decode node" in err.value.details()
            c.script.gate.set()
            assert (await generate(c, G(text="Hi")))[-1].timings.decode_node == "decode-1"

    run_async(scenario())


def test_deadlines_end_the_request_and_cancel_both_legs(served_model: ServedModel, smollm2_dir: Path) -> None:
    async def scenario() -> None:
        async with scripted_cluster(served_model, smollm2_dir, script(served_model), request_timeout_s=0.4) as c:
            c.script.gate = asyncio.Event()  # never opened: every request runs into its deadline
            err = await failure(c, G(text="Hi", request_id="d1"))
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "request_timeout_s=0.4" in err.details()
            await eventually(lambda: c.decodes[0].record.cancelled == ["d1"])
            last = c.decodes[0].last_request
            assert last is not None and 0 < last.kv_timeout_seconds <= 0.4  # the decode frees it too, by itself

            err = await failure(c, G(text="Hi", request_id="d2"), timeout=0.3)  # the client's deadline is sooner
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await eventually(lambda: c.decodes[0].record.cancelled == ["d1", "d2"])

            c.prefills[0].delay_before_push_s = 30  # no KV ever arrives: the decode frees the reservation itself
            err = await failure(c, G(text="Hi", request_id="d3"))
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await eventually(lambda: c.prefills[0].record.cancelled == ["d3"])
            await eventually(lambda: c.board.open_transfers == 0)  # the decode's own release comes after

    run_async(scenario())


def test_tokenize_model_info_health_and_reflection(served_model: ServedModel, smollm2_dir: Path) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    tok = served_model.tokenizer

    async def scenario() -> None:
        async with scripted_cluster(served_model, smollm2_dir, script(served_model), num_prefill=2) as c:
            reply = await c.stub.Tokenize(generate_pb2.TokenizeRequest(text="Hello world"))
            assert list(reply.token_ids) == tok.encode("Hello world", add_special_tokens=False)
            assert list(reply.tokens) == tok.convert_ids_to_tokens(list(reply.token_ids))
            chat = generate_pb2.ChatInput(messages=[generate_pb2.ChatMessage(role="user", content="Hi")])
            reply = await c.stub.Tokenize(generate_pb2.TokenizeRequest(chat=chat))
            assert list(reply.token_ids) == tok.encode_chat([{"role": "user", "content": "Hi"}])
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.stub.Tokenize(generate_pb2.TokenizeRequest())
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("input:")

            info = await c.stub.ModelInfo(generate_pb2.ModelInfoRequest())
            assert (info.model, info.vocab_size, info.max_model_len) == ("SmolLM2-135M-Instruct", 49152, 8192)
            assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (30, 9, 3, 64)
            assert (info.num_prefill_nodes, info.num_decode_nodes, info.block_size) == (2, 1, 16)
            assert info.has_chat_template and list(info.eos_token_ids) == list(served_model.eos_token_ids)

            health = health_pb2_grpc.HealthStub(c.channel)
            for service in ("", "tandem.v1.Tandem"):
                answer = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
            reflection = reflection_pb2_grpc.ServerReflectionStub(c.channel)
            call = reflection.ServerReflectionInfo()
            await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            listed = {s.name for s in (await call.read()).list_services_response.service}
            await call.done_writing()
            assert {"tandem.v1.Tandem", "grpc.health.v1.Health"} <= listed

    run_async(scenario())


def test_prefill_starts_before_the_reservation_answers(served_model: ServedModel, smollm2_dir: Path) -> None:
    """The prefill node gets the request at once (it computes while the decode node reserves) and its destination
    once the reservation is there; the request then runs as before."""
    tokens = script(served_model)

    async def scenario() -> None:
        async with scripted_cluster(served_model, smollm2_dir, tokens) as c:
            decode, prefill = c.decodes[0], c.prefills[0]
            decode.reserve_gate = asyncio.Event()  # a busy decode node: its reservation waits
            call = c.stub.Generate(G(text="Hi", request_id="o1", sampling=S(max_tokens=4),
                                     stream=generate_pb2.StreamOptions(include_token_ids=True)))
            await eventually(lambda: prefill.record.requests == ["o1"])
            assert "o1" not in decode.reserved_at and "o1" not in prefill.destinations
            decode.reserve_gate.set()
            messages = [m async for m in call]
            assert [t for m in messages for t in m.token_ids] == tokens[:4]
            assert prefill.destinations["o1"] >= decode.reserved_at["o1"]
            assert prefill.last_request is not None and prefill.last_request.destination.transfer_id == "decode-0/o1"
            assert prefill.record.completed == ["o1"] and decode.record.completed == ["o1"]

    run_async(scenario())


def test_a_failed_reservation_cancels_the_prefill(served_model: ServedModel, smollm2_dir: Path) -> None:
    async def scenario() -> None:
        async with scripted_cluster(served_model, smollm2_dir, script(served_model)) as c:
            decode, prefill = c.decodes[0], c.prefills[0]
            decode.reserve_gate = asyncio.Event()
            decode.reserve_fails_with = grpc.StatusCode.RESOURCE_EXHAUSTED
            call = c.stub.Generate(G(text="Hi", request_id="f1"))
            await eventually(lambda: prefill.record.requests == ["f1"])
            decode.reserve_gate.set()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call.read()
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "decode node" in err.value.details()
            await eventually(lambda: prefill.record.cancelled == ["f1"])  # the prefill node frees its blocks
            assert prefill.record.completed == [] and "f1" not in prefill.destinations

    run_async(scenario())


def test_a_failed_prefill_cancels_the_pending_reservation(served_model: ServedModel, smollm2_dir: Path) -> None:
    async def scenario() -> None:
        async with scripted_cluster(served_model, smollm2_dir, script(served_model)) as c:
            decode, prefill = c.decodes[0], c.prefills[0]
            decode.reserve_gate = asyncio.Event()  # never opened: the reservation is still pending
            prefill.fail_with = grpc.StatusCode.INVALID_ARGUMENT
            err = await failure(c, G(text="Hi", request_id="f2"))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "scripted failure on prefill-0" in err.details()
            await eventually(lambda: decode.record.cancelled == ["f2"])
            assert "f2" not in decode.reserved_at and c.board.open_transfers == 0

    run_async(scenario())


def test_a_prefill_that_timed_out_waiting_for_the_reservation_is_sent_again_once_it_comes(
        served_model: ServedModel, smollm2_dir: Path) -> None:
    """A decode node short of blocks for longer than the prefill node's KV timeout: the prefill gives up on its
    destination (DEADLINE_EXCEEDED), and the gateway prefills again once the reservation is there."""
    tokens = script(served_model)

    async def scenario() -> None:
        async with scripted_cluster(served_model, smollm2_dir, tokens) as c:
            decode, prefill = c.decodes[0], c.prefills[0]
            decode.reserve_gate = asyncio.Event()
            prefill.destination_timeout_s = 0.2
            call = c.stub.Generate(G(text="Hi", request_id="t1", sampling=S(max_tokens=3),
                                     stream=generate_pb2.StreamOptions(include_token_ids=True)))
            await eventually(lambda: prefill.record.requests == ["t1"])
            await asyncio.sleep(0.5)  # past the prefill node's timeout
            decode.reserve_gate.set()
            messages = [m async for m in call]
            assert [t for m in messages for t in m.token_ids] == tokens[:3]
            assert prefill.record.requests == ["t1", "t1"] and prefill.record.completed == ["t1"]

    run_async(scenario())

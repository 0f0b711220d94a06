"""The gRPC API's additions on a real gateway in front of scripted nodes: n samples, Abort, GetLoads."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from scripted_nodes import eventually, run_async, scripted_cluster

from gateway.model import ServedModel
from tandem.v1 import common_pb2, generate_pb2

pytestmark = pytest.mark.real_model

G = generate_pb2.GenerateRequest
S = common_pb2.SamplingParams
TEXT = " The quick brown fox jumps over the lazy dog."


def test_n_samples_each_finish_with_their_index(served_model: ServedModel, smollm2_dir: Path) -> None:
    tokens = served_model.tokenizer.encode(TEXT, add_special_tokens=False)

    async def scenario() -> None:
        async with scripted_cluster(served_model, smollm2_dir, tokens) as c:
            messages = [m async for m in c.stub.Generate(G(text="Hi", request_id="r", n=3,
                                                           sampling=S(max_tokens=4, seed=10)))]
            assert {m.request_id for m in messages} == {"r"}
            for i in range(3):
                mine = [m for m in messages if m.index == i]
                assert "".join(m.text for m in mine) == served_model.tokenizer.decode(tokens[:4])
                assert mine[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
                assert mine[-1].usage.completion_tokens == 4
            # One node request per sample; the first alone until its first token, then the others.
            assert c.prefills[0].record.requests[0] == "r-0"
            assert sorted(c.prefills[0].record.requests) == ["r-0", "r-1", "r-2"]
            last = c.decodes[0].last_request
            assert last is not None and last.sampling.seed in (11, 12)  # seed + i

            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in c.stub.Generate(G(text="Hi", n=17)):
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("n: ")

    run_async(scenario())


def test_abort_cancels_a_request_on_both_nodes(served_model: ServedModel, smollm2_dir: Path) -> None:
    tokens = served_model.tokenizer.encode(TEXT, add_special_tokens=False)

    async def scenario() -> None:
        async with scripted_cluster(served_model, smollm2_dir, tokens) as c:
            c.script.gate = asyncio.Event()  # the decode node holds its tokens
            call = c.stub.Generate(G(text="Hi", request_id="victim", sampling=S(max_tokens=8)))
            first = await call.read()
            assert first.text == " The"
            reply = await c.stub.Abort(generate_pb2.AbortRequest(request_ids=["victim", "unknown"]))
            assert list(reply.aborted) == ["victim"]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while await call.read() is not grpc.aio.EOF:
                    pass
            assert err.value.code() == grpc.StatusCode.CANCELLED and "aborted" in err.value.details()
            await eventually(lambda: c.decodes[0].record.cancelled == ["victim"])
            assert c.board.open_transfers == 0
            # The gateway serves on: the next request with the same id runs.
            c.script.gate.set()
            again = [m async for m in c.stub.Generate(G(text="Hi", request_id="victim", sampling=S(max_tokens=2)))]
            assert again[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH

    run_async(scenario())


def test_get_loads_reports_each_node(served_model: ServedModel, smollm2_dir: Path) -> None:
    async def scenario() -> None:
        async with scripted_cluster(served_model, smollm2_dir, [1, 2, 3], num_decode=2, dead_decode=1,
                                    stats_interval_s=0.05) as c:
            c.decodes[0].free_blocks = 250  # seen at the next poll
            c.decodes[0].cache_counters = (900, 600, 160, 42)

            async def loads() -> list[generate_pb2.NodeLoad]:
                return list((await c.stub.GetLoads(generate_pb2.GetLoadsRequest())).nodes)

            for _ in range(100):
                nodes = await loads()
                if any(n.free_blocks == 250 for n in nodes):
                    break
                await asyncio.sleep(0.02)
            assert [(n.role, n.reachable) for n in nodes] == [("prefill", True), ("decode", False),
                                                                ("decode", True), ("decode", True)]
            by_id = {n.node_id: n for n in nodes if n.reachable}
            assert set(by_id) == {"prefill-0", "decode-0", "decode-1"}
            assert (by_id["decode-0"].num_blocks, by_id["decode-0"].free_blocks) == (1000, 250)
            assert by_id["decode-0"].kv_usage == pytest.approx(0.75) and by_id["decode-1"].kv_usage == 0.0
            assert {n.num_inflight for n in nodes} == {0}
            # The node's prefix-cache counters pass through (tandem bench serve reads them per run)
            d0 = by_id["decode-0"]
            assert (d0.prefix_cache_queries, d0.prefix_cache_hits, d0.offload_hits, d0.offload_blocks) == (
                900, 600, 160, 42)
            assert by_id["decode-1"].offload_hits == 0

    run_async(scenario())

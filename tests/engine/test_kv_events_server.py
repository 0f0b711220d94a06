"""SubscribeKvEvents on real servers: a tiny-model decode node in this process, its own stream and the
gateway's merged one, against the chained block hashes of the request's tokens."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from common.config.settings import ModelSettings, NodeSettings
from common.kv.block_hash import hash_prompt_blocks
from decode_service.server import serve_decode
from gateway.server import serve_gateway
from gateway.settings import GatewaySettings
from prefill_service.server import serve_prefill
from tandem.v1 import common_pb2, decode_pb2_grpc, generate_pb2, generate_pb2_grpc

BS = 4
PROMPT = [101, 102, 103, 104, 105, 106, 107, 108, 109, 110]  # 2 full blocks + 2 tokens
MAX_TOKENS = 6


def run(coro: object, timeout_s: float = 120.0) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout_s))  # type: ignore[arg-type]


async def collect_stored(stream: AsyncIterator[common_pb2.KvEventBatch], num_blocks: int,
                         batches: list[common_pb2.KvEventBatch]) -> None:
    seen = 0
    async for batch in stream:
        batches.append(batch)
        seen += sum(len(e.stored.block_hashes) for e in batch.events if e.WhichOneof("kind") == "stored")
        if seen >= num_blocks:
            return


def stored_events(batches: list[common_pb2.KvEventBatch]) -> list[common_pb2.KvBlockStored]:
    return [e.stored for b in batches for e in b.events if e.WhichOneof("kind") == "stored"]


def test_a_request_on_a_real_node_publishes_its_blocks(tiny_served_model_dir: Path) -> None:
    model = ModelSettings(model=str(tiny_served_model_dir), dtype="float32")
    node = NodeSettings(num_blocks=64, block_size=BS, grace_s=0.1)

    async def main() -> None:
        decode = await serve_decode(model, node)
        prefill = await serve_prefill(model, node)
        gateway = await serve_gateway(GatewaySettings(
            model_dir=tiny_served_model_dir, port=0, prefill_targets=(prefill.address,),
            decode_targets=(decode.address,), local_prefill_max_tokens=1000,  # block size: the nodes report BS
            stats_interval_s=0.2, shutdown_grace_s=0.1))
        channel = grpc.aio.insecure_channel(decode.address)
        gw_channel = grpc.aio.insecure_channel(gateway.address)
        try:
            gateway_stub = generate_pb2_grpc.TandemStub(gw_channel)
            node_stream = decode_pb2_grpc.DecodeStub(channel).SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
            merged = gateway_stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
            await asyncio.sleep(1.0)  # both subscriptions reach the engine before the request does
            request = generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=PROMPT), stream=generate_pb2.StreamOptions(include_token_ids=True),
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
            responses = [r async for r in gateway_stub.Generate(request)]
            output = [t for r in responses for t in r.token_ids]
            assert len(output) == MAX_TOKENS
            # The KV of every token but the last generated one is written: (10 + 6 - 1) // 4 = 3 full blocks.
            expected = hash_prompt_blocks([*PROMPT, *output][: len(PROMPT) + MAX_TOKENS - 1], BS)
            assert len(expected) == 3
            node_batches: list[common_pb2.KvEventBatch] = []
            merged_batches: list[common_pb2.KvEventBatch] = []
            await asyncio.gather(collect_stored(node_stream, 3, node_batches),
                                 collect_stored(merged, 3, merged_batches))
            node_stream.cancel()
            merged.cancel()
            for batches in (node_batches, merged_batches):
                stored = stored_events(batches)
                assert [h for s in stored for h in s.block_hashes] == expected
                # Each run names its parent (none for the prompt's first block) and carries exactly its tokens.
                assert stored[0].parent_block_hash == b""
                for s in stored[1:]:
                    assert s.parent_block_hash == expected[expected.index(s.block_hashes[0]) - 1]
                tokens = [t for s in stored for t in s.token_ids]
                assert tokens == [*PROMPT, *output][: 3 * BS]
                assert all(s.block_size == BS for s in stored)
                assert all(b.role == "decode" and b.node_id.startswith("decode-") for b in batches)
                assert sum(b.dropped for b in batches) == 0
            assert all(b.target == "" for b in node_batches)
            assert all(b.target == decode.address for b in merged_batches)
        finally:
            await channel.close()
            await gw_channel.close()
            await gateway.stop(0.1)
            await prefill.stop(0.1)
            await decode.stop(0.1)

    run(main())

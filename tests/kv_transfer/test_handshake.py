"""The handshake over a real gRPC server (in-process): mismatched pairs are refused, naming the field."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest
import torch

from common.kv.kv_cache import KVCache, KVCacheSpec
from kv_transfer import PROTOCOL_VERSION, KVReceiver, KVSender, TransferFailed, make_layout
from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc, prefill_pb2

torch.set_num_threads(1)
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype_name="bfloat16")


def _with_decode(body: Callable[[KVReceiver, str], Awaitable[None]]) -> None:
    async def main() -> None:
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        receiver = KVReceiver(KVCache(SPEC, 16), make_layout(SPEC, "tiny", "f0"), "decode-0", group_timeout_s=5)
        receiver.add_to_server(server)
        await server.start()
        try:
            await asyncio.wait_for(body(receiver, f"127.0.0.1:{port}"), 30)
        finally:
            await receiver.close()
            await server.stop(0)

    asyncio.run(main())


async def _open(endpoint: str, spec: KVCacheSpec, model: str = "tiny", fingerprint: str = "f0") -> None:
    sender = KVSender(KVCache(spec, 16), make_layout(spec, model, fingerprint), "prefill-0", group_timeout_s=5)
    try:
        await sender.open("t0", prefill_pb2.KVDestination(kv_endpoint=endpoint, node_id="decode-0"))
    finally:
        await sender.close()


@pytest.mark.parametrize(
    ("spec", "fingerprint", "message"),
    [
        (KVCacheSpec(2, 2, 8, 8, "bfloat16"), "f0", "block_size differs: prefill 8, decode 4"),
        (SPEC, "f1", "model_fingerprint differs: prefill 'f1', decode 'f0'"),
        (KVCacheSpec(2, 2, 8, 4, "float32"), "f0", "dtype differs: prefill 'float32', decode 'bfloat16'"),
        (KVCacheSpec(3, 2, 8, 4, "bfloat16"), "f0", "num_layers differs: prefill 3, decode 2"),
    ],
)
def test_mismatched_layout_is_refused_naming_the_field(spec: KVCacheSpec, fingerprint: str, message: str) -> None:
    async def body(receiver: KVReceiver, endpoint: str) -> None:
        with pytest.raises(TransferFailed, match="decode node decode-0 refused to pair") as info:
            await _open(endpoint, spec, fingerprint=fingerprint)
        assert message in info.value.reason
        assert info.value.transfer_id is None

    _with_decode(body)


@pytest.mark.parametrize(
    ("handshake", "message"),
    [
        (kv_transfer_pb2.Handshake(protocol_version=PROTOCOL_VERSION + 1, device_type="cpu"),
         f"protocol_version differs: prefill {PROTOCOL_VERSION + 1}, decode {PROTOCOL_VERSION}"),
        (kv_transfer_pb2.Handshake(protocol_version=PROTOCOL_VERSION, device_type="cuda"),
         "device_type differs: prefill 'cuda', decode 'cpu'"),
    ],
)
def test_protocol_and_device_are_checked(handshake: kv_transfer_pb2.Handshake, message: str) -> None:
    async def body(receiver: KVReceiver, endpoint: str) -> None:
        handshake.sender_id = "raw"
        handshake.layout.CopyFrom(receiver.layout)
        async with grpc.aio.insecure_channel(endpoint) as channel:
            call = kv_transfer_pb2_grpc.KVTransferStub(channel).Connect()
            await call.write(kv_transfer_pb2.KVMessage(handshake=handshake))
            reply = (await call.read()).handshake_reply
            assert not reply.accepted
            assert reply.error == message
            assert await call.read() is grpc.aio.EOF

    _with_decode(body)


def test_unreachable_decode_node_is_a_transfer_failure() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(TransferFailed, match=f"127.0.0.1:{port}"):
        asyncio.run(_open(f"127.0.0.1:{port}", SPEC))


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's socket table")
def test_store_listens_on_the_configured_host_only() -> None:
    async def body(receiver: KVReceiver, endpoint: str) -> None:
        listening = []
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port = local.split(":")
            if state == "0A" and int(port, 16) == receiver.store_port:  # 0A: LISTEN
                listening.append(address)
        assert listening == ["0100007F"]  # 127.0.0.1 (little-endian hex), not 0.0.0.0

    _with_decode(body)

"""Same-host KV transport: choosing it, the shared segment and its grants, and its failure modes.

The data path itself (bit-exact, fragmented, refused, abandoned transfers) runs in test_transfer_e2e.py
with both data planes; here: the choice in the handshake (in-process, real gRPC), the segment's lifetime,
the grant fence (a revoke waits out a copy in progress), and real processes dying or freezing mid-copy.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from common.kv.kv_cache import KVCache, KVCacheSpec
from common.kv.shared_segment import SHM_DIR, SharedMemoryUnavailable, SharedSegment, remove_stale_segments
from kv_transfer import KVReceiver, KVSender, TransferFailed, make_layout
from kv_transfer.block_grants import BlockGrants
from kv_transfer.transport import choose_transport
from tandem.v1 import prefill_pb2
from tests.kv_transfer.test_peer_death import prompt_tokens, transfer_ok

torch.set_num_threads(1)
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype_name="bfloat16")
HOST = "boot/host-a"


@pytest.mark.parametrize(
    ("setting", "offered", "sender_host", "ready", "expected"),
    [
        ("auto", ["shm", "socket"], HOST, True, ("shm", None)),
        ("auto", ["shm", "socket"], "boot/host-b", True, ("socket", None)),
        ("auto", ["shm", "socket"], HOST, False, ("socket", None)),
        ("auto", [], "", True, ("socket", None)),  # a sender from before same-host transport
        ("socket", ["shm", "socket"], HOST, True, ("socket", None)),
        ("shm", ["shm", "socket"], HOST, True, ("shm", None)),
        ("shm", ["socket"], HOST, True, (None, "kv_transport differs: prefill 'socket', decode 'shm'")),
        ("socket", ["shm"], HOST, True, (None, "kv_transport differs: prefill 'shm', decode 'socket'")),
        ("auto", ["shm"], "boot/host-b", True,
         (None, "kv_transport shm needs both nodes on one host: prefill host 'boot/host-b', decode host "
                "'boot/host-a'")),
    ],
)
def test_transport_choice(setting: str, offered: list[str], sender_host: str, ready: bool,
                          expected: tuple[str | None, str | None]) -> None:
    assert choose_transport(setting, offered, sender_host, HOST, shm_ready=ready) == expected


def test_segment_is_checked_by_nonce_and_unlinked_at_close() -> None:
    cache = KVCache(SPEC, 8)
    cache.data.fill_(3)
    segment = cache.share_memory()
    assert cache.share_memory() is segment and bool((cache.data == 3).all())
    with pytest.raises(SharedMemoryUnavailable, match="nonce differs"):
        SharedSegment.open(segment.name, b"\0" * 16)
    peer = SharedSegment.open(segment.name, segment.nonce)
    peer.data().view(torch.bfloat16).view(cache.data.shape)[5].fill_(7)
    assert bool((cache.data[5] == 7).all())  # one memory
    cache.close()
    assert not segment.path.exists()
    with pytest.raises(SharedMemoryUnavailable, match="cannot open"):
        SharedSegment.open(segment.name, segment.nonce)
    peer.close()


def test_a_dead_owners_segment_is_swept() -> None:
    code = ("from common.kv.shared_segment import SharedSegment; import os, sys; s = SharedSegment.create(4096, 4); "
            "print(s.name, flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    name = proc.stdout.readline().strip()
    assert name not in remove_stale_segments()  # alive: its owner lock holds
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert name in remove_stale_segments()


def test_revoke_waits_for_a_copy_in_progress_and_then_no_copy_is_granted() -> None:
    cache = KVCache(SPEC, 16)
    segment = cache.share_memory()
    owner = BlockGrants(segment)
    writer = BlockGrants(SharedSegment.open(segment.name, segment.nonce))  # its own open file: its own locks
    owner.grant(42, [3, 4, 5])
    copying, release = threading.Event(), threading.Event()

    def copy() -> None:
        with writer.holding(42, 4, 2) as granted:
            assert granted
            copying.set()
            release.wait(10)

    thread = threading.Thread(target=copy)
    thread.start()
    copying.wait(10)
    assert not owner.try_revoke([3, 4, 5])  # the copy holds blocks 4..5
    threading.Timer(0.3, release.set).start()
    started = time.monotonic()
    assert owner.revoke([3, 4, 5], timeout_s=10)
    assert time.monotonic() - started >= 0.25
    thread.join()
    with writer.holding(42, 3, 3) as granted:
        assert not granted
    owner.grant(42, [9])
    with writer.holding(42, 9, 1) as granted, writer.holding(7, 9, 1) as other:
        assert granted and not other
    cache.close()


# ---------------------------------------------------------------------------------- the handshake, in-process


def _pair(body: Callable[[KVReceiver, str], Awaitable[None]], decode_transport: str = "auto") -> None:
    async def main() -> None:
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        receiver = KVReceiver(KVCache(SPEC, 16), make_layout(SPEC, "tiny", "f0"), "decode-0", group_timeout_s=5,
                              transport=decode_transport)
        receiver.add_to_server(server)
        await server.start()
        try:
            await asyncio.wait_for(body(receiver, f"127.0.0.1:{port}"), 30)
        finally:
            segment = receiver.shared_segment
            await receiver.close()
            await server.stop(0)
            assert segment is None or not (SHM_DIR / segment).exists()

    asyncio.run(main())


async def _pair_transport(endpoint: str, transport: str, host: str | None = None) -> str:
    sender = KVSender(KVCache(SPEC, 16), make_layout(SPEC, "tiny", "f0"), "prefill-0", group_timeout_s=5,
                      transport=transport, host_identity=host or "")
    try:
        await sender.open("t0", prefill_pb2.KVDestination(kv_endpoint=endpoint, node_id="decode-0"))
        (pair,) = sender._all_pairs
        return pair.transport
    finally:
        await sender.close()


def test_same_host_pairs_over_shared_memory_and_other_hosts_over_sockets() -> None:
    async def body(receiver: KVReceiver, endpoint: str) -> None:
        assert receiver.shared_segment is not None
        assert await _pair_transport(endpoint, "auto") == "shm"
        assert await _pair_transport(endpoint, "socket") == "socket"
        assert await _pair_transport(endpoint, "auto", host="other-boot/other-host") == "socket"
        with pytest.raises(TransferFailed, match="kv_transport shm needs both nodes on one host"):
            await _pair_transport(endpoint, "shm", host="other-boot/other-host")

    _pair(body)


def test_a_segment_the_sender_cannot_map_falls_back_to_sockets_unless_shm_is_forced() -> None:
    async def body(receiver: KVReceiver, endpoint: str) -> None:
        assert receiver._shared is not None
        receiver._shared.description.nonce = b"\1" * 16  # as if the sender saw another /dev/shm
        assert await _pair_transport(endpoint, "auto") == "socket"
        with pytest.raises(TransferFailed, match=r"kv_transport=shm: cannot map the KV .*nonce differs"):
            await _pair_transport(endpoint, "shm")

    _pair(body)


def test_a_socket_only_decode_node_refuses_a_shm_only_sender() -> None:
    async def body(receiver: KVReceiver, endpoint: str) -> None:
        assert receiver.shared_segment is None
        with pytest.raises(TransferFailed, match="kv_transport differs: prefill 'shm', decode 'socket'"):
            await _pair_transport(endpoint, "shm")

    _pair(body, decode_transport="socket")


# ---------------------------------------------------------------------------------- real processes

PSPEC = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": 4, "dtype": "bfloat16",
         "num_blocks": 64, "group_timeout_s": 8.0, "transport": "shm"}
DETECT_S = 5.0


def test_prefill_killed_mid_copy_releases_its_grant_lock(spawn: Callable[..., list[Any]]) -> None:
    decode, doomed, fresh = spawn(
        ("decode", {**PSPEC, "node_id": "decode-0"}),
        ("prefill", {**PSPEC, "node_id": "prefill-doomed", "stall_copy_after": 1}),
        ("prefill", {**PSPEC, "node_id": "prefill-fresh"}),
    )
    free_blocks = decode.info["free_blocks"]
    tokens = prompt_tokens(1)
    reservation = decode.call("reserve", request_id="r1", token_ids=tokens)
    wait = decode.send("wait", request_id="r1", timeout_s=30)
    doomed.send("transfer", transfer_id="r1", token_ids=tokens, blocks_per_push=3,
                destination=decode.destination(reservation, "r1"))
    doomed.event("copy_stalled")  # chunk 1 landed; the copy of chunk 2 holds its blocks' grant lock
    time.sleep(0.3)
    killed_at = time.monotonic()
    doomed.kill()

    reply = decode.reply(wait, timeout_s=DETECT_S + 5)  # the revoke got the lock the dead process held
    assert "connection to prefill node prefill-doomed lost" in reply["failed"], reply
    assert time.monotonic() - killed_at < DETECT_S
    assert reply["free_blocks"] == free_blocks
    transfer_ok(decode, fresh, "r2", seed=2)
    assert decode.call("state")["transports"] == ["shm"]


@pytest.mark.e2e
def test_decode_killed_mid_transfer_and_its_segment_swept(spawn: Callable[..., list[Any]]) -> None:
    doomed, prefill = spawn(("decode", {**PSPEC, "node_id": "decode-doomed"}),
                            ("prefill", {**PSPEC, "node_id": "prefill-0"}))
    free_blocks = prefill.info["free_blocks"]
    tokens = prompt_tokens(3, length=80)  # 20 blocks, one per push every 50 ms
    reservation = doomed.call("reserve", request_id="r1", token_ids=tokens)
    doomed.send("wait", request_id="r1", timeout_s=30)
    push = prefill.send("transfer", transfer_id="r1", token_ids=tokens, blocks_per_push=1, push_interval_s=0.05,
                        timeout_s=30, destination=doomed.destination(reservation, "r1"))
    time.sleep(0.4)
    killed_at = time.monotonic()
    doomed.kill()
    reply = prefill.reply(push, timeout_s=DETECT_S + 5)
    assert "decode-doomed" in reply["failed"]
    assert time.monotonic() - killed_at < DETECT_S
    assert reply["free_blocks"] == free_blocks

    segment = doomed.info["segment"]
    # The broken pair unmaps the dead node's KV: a restarted decode node must not leave a copy of its whole
    # cache resident in every prefill process (RssShmem grew by one KV cache per restart).
    maps = Path(f"/proc/{prefill.proc.pid}/maps")
    deadline = time.monotonic() + 10
    while segment in maps.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert segment not in maps.read_text()
    (restarted,) = spawn(("decode", {**PSPEC, "node_id": "decode-restarted"}))  # sweeps the dead one's segment
    assert not (SHM_DIR / segment).exists()
    transfer_ok(restarted, prefill, "r2", seed=4)


@pytest.mark.e2e
def test_silent_decode_fails_the_transfer_within_the_group_timeout(spawn: Callable[..., list[Any]]) -> None:
    group_timeout_s = 2.0
    frozen, prefill = spawn(("decode", {**PSPEC, "group_timeout_s": group_timeout_s, "node_id": "decode-frozen"}),
                            ("prefill", {**PSPEC, "node_id": "prefill-0"}))
    free_blocks = prefill.info["free_blocks"]
    tokens = prompt_tokens(5, length=160)
    reservation = frozen.call("reserve", request_id="r1", token_ids=tokens)
    frozen.send("wait", request_id="r1", timeout_s=30)
    push = prefill.send("transfer", transfer_id="r1", token_ids=tokens, blocks_per_push=1, push_interval_s=0.05,
                        timeout_s=30, destination=frozen.destination(reservation, "r1"))
    time.sleep(0.5)
    frozen.proc.send_signal(signal.SIGSTOP)  # alive but silent: its memory takes copies, it acks nothing
    stopped_at = time.monotonic()
    try:
        reply = prefill.reply(push, timeout_s=group_timeout_s + 10)
        assert "decode-frozen" in reply["failed"], reply
        assert "acked no KV" in reply["failed"], reply
        assert time.monotonic() - stopped_at < group_timeout_s + DETECT_S
        assert reply["free_blocks"] == free_blocks
    finally:
        frozen.kill()

"""A peer SIGKILLed mid-transfer: the survivor reports TransferFailed within seconds, gives every block back,
and a fresh pair works afterwards.

The kill lands while a data op is in flight: the doomed harness's pair thread blocks forever before posting
its second send (or recv), so the survivor has already posted the matching recv (or send) when the kill comes.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

SPEC = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": 4, "dtype": "bfloat16",
        "num_blocks": 64, "group_timeout_s": 8.0, "transport": "socket"}
DETECT_S = 5.0  # how long the survivor may take to notice (gloo reports a closed peer within ~1 s)


def prompt_tokens(seed: int, length: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(length)]


def transfer_ok(decode: Any, prefill: Any, request_id: str, seed: int) -> None:
    tokens = prompt_tokens(seed)
    reservation = decode.call("reserve", request_id=request_id, token_ids=tokens)
    wait = decode.send("wait", request_id=request_id, timeout_s=20)
    pushed = prefill.call("transfer", transfer_id=request_id, token_ids=tokens, blocks_per_push=3,
                          destination=decode.destination(reservation, request_id))
    landed = decode.reply(wait)
    assert "failed" not in pushed and "failed" not in landed, (pushed, landed)
    assert landed["mismatched_blocks"] == []


def test_prefill_killed_mid_transfer(spawn: Callable[..., list[Any]]) -> None:
    decode, doomed, fresh = spawn(
        ("decode", {**SPEC, "node_id": "decode-0"}),
        ("prefill", {**SPEC, "node_id": "prefill-doomed", "stall_send_after": 1}),
        ("prefill", {**SPEC, "node_id": "prefill-fresh"}),
    )
    free_blocks = decode.info["free_blocks"]
    tokens = prompt_tokens(1)
    reservation = decode.call("reserve", request_id="r1", token_ids=tokens)
    wait = decode.send("wait", request_id="r1", timeout_s=30)
    doomed.send("transfer", transfer_id="r1", token_ids=tokens, blocks_per_push=3,
                destination=decode.destination(reservation, "r1"))
    doomed.event("send_stalled")  # chunk 1 landed, chunk 2 announced: the decode side's recv is posted
    time.sleep(0.3)
    killed_at = time.monotonic()
    doomed.kill()

    reply = decode.reply(wait, timeout_s=DETECT_S + 5)
    assert "connection to prefill node prefill-doomed lost" in reply["failed"], reply
    assert time.monotonic() - killed_at < DETECT_S
    assert reply["free_blocks"] == free_blocks

    transfer_ok(decode, fresh, "r2", seed=2)  # a new pair (new epoch) on the same decode node
    assert decode.call("state")["free_blocks"] == free_blocks


def test_decode_killed_mid_transfer(spawn: Callable[..., list[Any]]) -> None:
    doomed, prefill = spawn(
        ("decode", {**SPEC, "node_id": "decode-doomed", "stall_recv_after": 1}),
        ("prefill", {**SPEC, "node_id": "prefill-0"}),
    )
    free_blocks = prefill.info["free_blocks"]
    tokens = prompt_tokens(3)
    reservation = doomed.call("reserve", request_id="r1", token_ids=tokens)
    doomed.send("wait", request_id="r1", timeout_s=30)
    push = prefill.send("transfer", transfer_id="r1", token_ids=tokens, blocks_per_push=3, timeout_s=30,
                        destination=doomed.destination(reservation, "r1"))
    doomed.event("recv_stalled")  # chunk 2's send is posted on the prefill side, waiting for its recv
    time.sleep(0.3)
    killed_at = time.monotonic()
    doomed.kill()

    reply = prefill.reply(push, timeout_s=DETECT_S + 5)
    assert "decode-doomed" in reply["failed"]
    assert time.monotonic() - killed_at < DETECT_S
    assert reply["free_blocks"] == free_blocks

    # A decode node restarted on the same endpoint: the prefill drops the broken pair and pairs again.
    port = int(doomed.info["kv_endpoint"].rsplit(":", 1)[1])
    (restarted,) = spawn(("decode", {**SPEC, "node_id": "decode-restarted", "grpc_port": port}))
    assert restarted.info["kv_endpoint"] == doomed.info["kv_endpoint"]
    transfer_ok(restarted, prefill, "r2", seed=4)
    assert prefill.call("state")["free_blocks"] == free_blocks


def test_silent_decode_fails_the_transfer_within_the_group_timeout(spawn: Callable[..., list[Any]]) -> None:
    group_timeout_s = 2.0
    frozen, prefill = spawn(
        ("decode", {**SPEC, "group_timeout_s": group_timeout_s, "node_id": "decode-frozen"}),
        ("prefill", {**SPEC, "node_id": "prefill-0"}),
    )
    free_blocks = prefill.info["free_blocks"]
    tokens = prompt_tokens(5, length=160)  # 40 blocks, one per push every 50 ms
    reservation = frozen.call("reserve", request_id="r1", token_ids=tokens)
    frozen.send("wait", request_id="r1", timeout_s=30)
    push = prefill.send("transfer", transfer_id="r1", token_ids=tokens, blocks_per_push=1, push_interval_s=0.05,
                        timeout_s=30, destination=frozen.destination(reservation, "r1"))
    time.sleep(0.5)
    frozen.proc.send_signal(signal.SIGSTOP)  # alive but silent: TCP still acks, nothing is ever received
    stopped_at = time.monotonic()
    try:
        reply = prefill.reply(push, timeout_s=group_timeout_s + 10)
        assert "decode-frozen" in reply["failed"], reply
        assert time.monotonic() - stopped_at < group_timeout_s + DETECT_S
        assert reply["free_blocks"] == free_blocks
    finally:
        frozen.kill()

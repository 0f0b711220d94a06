"""The same-host path on CUDA: a prefill and a decode process on one GPU (where NCCL cannot pair them) share
the decode node's KV tensor by CUDA IPC handle, passed in the protobuf handshake. Skips without CUDA."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

SPEC = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64, "block_size": 16, "dtype": "bfloat16",
        "num_blocks": 128, "group_timeout_s": 20.0, "device": "cuda:0", "forbid_pickle": True}


def test_two_processes_on_one_gpu_move_kv_bit_exact_over_ipc(spawn: Callable[..., list[Any]]) -> None:
    decode, prefill = spawn(("decode", {**SPEC, "fragment": 3, "node_id": "decode-gpu", "transport": "shm"}),
                            ("prefill", {**SPEC, "node_id": "prefill-gpu"}))
    rng = random.Random(0)
    for i, length in enumerate([5, 100, 333]):
        tokens = [rng.randrange(1000) for _ in range(length)]
        rid = f"ipc-{i}"
        reservation = decode.call("reserve", request_id=rid, token_ids=tokens)
        wait = decode.send("wait", request_id=rid, timeout_s=60)
        pushed = prefill.call("transfer", transfer_id=rid, token_ids=tokens, blocks_per_push=4,
                              destination=decode.destination(reservation, rid), reply_timeout_s=90)
        landed = decode.reply(wait, 90)
        assert "failed" not in pushed and "failed" not in landed, (pushed, landed)
        assert landed["mismatched_blocks"] == []
    assert decode.call("state")["transports"] == ["shm"]
    assert prefill.call("state")["pickle_calls"] == []
    ghost = {"kv_endpoint": decode.info["kv_endpoint"], "transfer_id": "ghost", "block_ids": list(range(1, 30, 3))}
    assert "not expected" in prefill.call("transfer", transfer_id="ghost", destination=ghost,
                                          token_ids=list(range(40)))["failed"]

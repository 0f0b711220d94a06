"""KV moves bit-exactly from prefill processes into a decode process's reserved blocks, and only what is missing.

One decode and two prefill processes for the whole module, all with pickle disabled inside (so every transfer
here also proves the control plane pickles nothing), once per data plane: sockets (gloo pair groups) and the
same-host one (the prefill copies into the decode node's shared-memory KV). Block ids are fragmented on both
sides so runs break on either side.
"""

from __future__ import annotations

import itertools
import random
import time
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

BLOCK_SIZE = 4  # conftest.SPEC
BYTES_PER_BLOCK = 2 * 2 * 4 * 2 * 8 * 2  # num_layers * (K, V) * block_size * heads * head_dim * bf16
Cluster = list[Any]  # [decode, prefill-0, prefill-1]: conftest.Harness processes


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(1000) for _ in range(length)]


def _run_transfers(decode: Any, jobs: list[tuple[Any, str, list[int], dict[str, Any]]]) -> list[dict[str, Any]]:
    """Reserve all, then start every wait and every push at once; return per job (reservation, prefill, decode)."""
    reservations = [decode.call("reserve", request_id=rid, token_ids=tokens) for _, rid, tokens, _ in jobs]
    waits = [decode.send("wait", request_id=rid, timeout_s=20) for _, rid, _, _ in jobs]
    pushes = [(prefill, prefill.send("transfer", transfer_id=rid, token_ids=tokens,
                                     destination=decode.destination(res, rid), **kw))
              for (prefill, rid, tokens, kw), res in zip(jobs, reservations, strict=True)]
    return [{"reservation": res, "prefill": prefill.reply(pid), "decode": decode.reply(wid)}
            for res, (prefill, pid), wid in zip(reservations, pushes, waits, strict=True)]


def _assert_landed(outcome: dict[str, Any], num_blocks_moved: int) -> None:
    prefill, decode = outcome["prefill"], outcome["decode"]
    assert "failed" not in prefill, prefill
    assert "failed" not in decode, decode
    assert decode["mismatched_blocks"] == []
    assert decode["bytes"] == prefill["bytes"] == num_blocks_moved * BYTES_PER_BLOCK


def test_ragged_transfers_land_bit_exact_in_fragmented_blocks(kv_cluster: Cluster) -> None:
    decode, prefill, _ = kv_cluster
    free_decode, free_prefill = decode.call("state")["free_blocks"], prefill.call("state")["free_blocks"]
    rng = random.Random(1)
    lengths = [1, 4, 5, 17, 38, 63]
    jobs: list[tuple[Any, str, list[int], dict[str, Any]]] = [
        (prefill, f"ragged-{n}", _prompt(rng, n),
         {"blocks_per_push": 1 + i % 3, "trace_context": {"traceparent": f"00-{i:032x}-{i:016x}-01"}})
        for i, n in enumerate(lengths)]
    outcomes = _run_transfers(decode, jobs)
    for (_, _, tokens, kw), outcome in zip(jobs, outcomes, strict=True):
        num_blocks = -(-len(tokens) // BLOCK_SIZE)
        _assert_landed(outcome, num_blocks)
        assert outcome["decode"]["trace_context"] == kw["trace_context"]
        assert outcome["decode"]["first_token"] == sum(tokens) % 97
        assert outcome["decode"]["first_logprob"] == [sum(tokens) % 97, -0.25]
        assert outcome["prefill"]["num_chunks"] == -(-num_blocks // kw["blocks_per_push"])
        assert outcome["prefill"]["num_chunks"] <= outcome["prefill"]["num_sends"] <= num_blocks
    table = outcomes[-1]["reservation"]["block_ids"]
    assert any(b - a != 1 for a, b in itertools.pairwise(table)), "destination should be fragmented"
    assert decode.call("state")["free_blocks"] == free_decode
    assert prefill.call("state")["free_blocks"] == free_prefill


def test_only_blocks_missing_on_the_decode_node_move(kv_cluster: Cluster) -> None:
    decode, prefill, _ = kv_cluster
    rng = random.Random(2)
    first = _prompt(rng, 40)  # 10 blocks, committed to the decode node's prefix cache afterwards
    (outcome,) = _run_transfers(decode, [(prefill, "prefix-a", first, {"blocks_per_push": 4})])
    _assert_landed(outcome, 10)

    shared = first[:28] + _prompt(rng, 12)  # 7 cached full blocks + 3 new
    same = list(first)  # everything cached but the last block (one token must be computed)
    outcomes = _run_transfers(decode, [(prefill, "prefix-b", shared, {"blocks_per_push": 2}),
                                       (prefill, "prefix-c", same, {"blocks_per_push": 2})])
    assert [o["reservation"]["num_cached_tokens"] for o in outcomes] == [28, 36]
    _assert_landed(outcomes[0], 3)
    _assert_landed(outcomes[1], 1)


def test_two_prefill_processes_push_into_one_decode_concurrently(kv_cluster: Cluster) -> None:
    decode, prefill_a, prefill_b = kv_cluster
    free_decode = decode.call("state")["free_blocks"]
    rng = random.Random(3)
    jobs = [(p, f"pair-{p.info.get('node_id', i)}-{i}-{n}", _prompt(rng, n), {"blocks_per_push": 3})
            for i, (p, n) in enumerate([(prefill_a, 30), (prefill_b, 45), (prefill_a, 21),
                                        (prefill_b, 9), (prefill_a, 50), (prefill_b, 33)])]
    for (_, _, tokens, _), outcome in zip(jobs, _run_transfers(decode, jobs), strict=True):
        _assert_landed(outcome, -(-len(tokens) // BLOCK_SIZE))
    assert decode.call("state")["free_blocks"] == free_decode


def test_nothing_is_pickled_on_either_side(kv_cluster: Cluster) -> None:
    decode, prefill, _ = kv_cluster
    # The harnesses replaced pickle.dumps/loads/Pickler/Unpickler, torch.distributed's object serialisers
    # and torch.save/load with functions that raise and record the call.
    assert decode.call("try_pickle")["pickle_works"] is False
    assert prefill.call("try_pickle")["pickle_works"] is False
    (outcome,) = _run_transfers(decode, [(prefill, "no-pickle", _prompt(random.Random(4), 26), {})])
    _assert_landed(outcome, 7)
    # try_pickle's own attempt is the only recorded call.
    assert decode.call("state")["pickle_calls"] == ["pickle.dumps"]
    assert prefill.call("state")["pickle_calls"] == ["pickle.dumps"]


def test_refused_chunks_fail_the_transfer_but_keep_the_pair_in_step(kv_cluster: Cluster) -> None:
    decode, prefill, _ = kv_cluster
    free_decode = decode.call("state")["free_blocks"]
    rng = random.Random(5)
    # A transfer the decode node never reserved: its chunks are received into scratch and refused.
    ghost = {"kv_endpoint": decode.info["kv_endpoint"], "transfer_id": "ghost", "block_ids": list(range(1, 40, 3))}
    reply = prefill.call("transfer", transfer_id="ghost", destination=ghost, token_ids=_prompt(rng, 50))
    assert "not expected on decode node decode-0" in reply["failed"]

    # A chunk aimed at a block outside the reservation (block 0 is pinned by the fragmenting pad).
    tokens = _prompt(rng, 20)
    reservation = decode.call("reserve", request_id="stray", token_ids=tokens)
    wait = decode.send("wait", request_id="stray", timeout_s=20)
    dest = decode.destination(reservation, "stray")
    dest["block_ids"] = [*dest["block_ids"][:-1], 0]
    reply = prefill.call("transfer", transfer_id="stray", destination=dest, token_ids=tokens, blocks_per_push=2)
    assert "destination block 0 is not a reserved, uncached block" in reply["failed"]
    assert "destination block 0" in decode.reply(wait)["failed"]
    assert decode.call("state")["free_blocks"] == free_decode

    # The same pair still works: the refused data was drained in order.
    (outcome,) = _run_transfers(decode, [(prefill, "after-refusal", _prompt(rng, 33), {})])
    _assert_landed(outcome, 9)


def test_decode_abandon_stops_the_sender_and_the_pair_survives(kv_cluster: Cluster) -> None:
    decode, prefill, _ = kv_cluster
    free_decode, free_prefill = decode.call("state")["free_blocks"], prefill.call("state")["free_blocks"]
    rng = random.Random(6)
    tokens = _prompt(rng, 60)  # 15 blocks, one per push every 0.1 s
    reservation = decode.call("reserve", request_id="abandoned", token_ids=tokens)
    push = prefill.send("transfer", transfer_id="abandoned", token_ids=tokens, blocks_per_push=1,
                        push_interval_s=0.1, destination=decode.destination(reservation, "abandoned"))
    time.sleep(0.4)
    assert decode.call("abandon", request_id="abandoned", reason="client cancelled")["free_blocks"] == free_decode
    reply = prefill.reply(push)
    assert "client cancelled" in reply["failed"]
    assert reply["free_blocks"] == free_prefill

    # Abandoned before the prefill even started: its chunks are refused with the decode side's reason.
    tokens = _prompt(rng, 12)
    reservation = decode.call("reserve", request_id="early", token_ids=tokens)
    assert decode.call("abandon", request_id="early", reason="deadline passed")["free_blocks"] == free_decode
    reply = prefill.call("transfer", transfer_id="early", token_ids=tokens,
                         destination=decode.destination(reservation, "early"))
    assert "abandoned by decode node decode-0: deadline passed" in reply["failed"]

    # A reservation nobody fills times out, and its blocks come back.
    decode.call("reserve", request_id="orphan", token_ids=_prompt(rng, 10))
    reply = decode.call("wait", request_id="orphan", timeout_s=0.5)
    assert "no complete KV within 0.5s" in reply["failed"]
    assert 0.4 < reply["elapsed_s"] < 3
    assert reply["free_blocks"] == free_decode

    (outcome,) = _run_transfers(decode, [(prefill, "after-abandon", _prompt(rng, 17), {})])
    _assert_landed(outcome, 5)


def test_pairs_use_the_transport_asked_for(kv_cluster: Cluster) -> None:
    decode, prefill_a, prefill_b = kv_cluster
    transport = decode.config["transport"]
    assert decode.call("state")["transports"] == [transport, transport]
    assert prefill_a.call("state")["transports"] == prefill_b.call("state")["transports"] == [transport]
    assert (decode.info["segment"] is not None) == (transport == "shm")


def test_no_tracebacks_in_node_logs(kv_cluster: Cluster) -> None:
    for node in kv_cluster:
        assert "Traceback" not in node.log_tail(10_000), node.log_tail()

"""``Prefill.PrefillStream`` on a real prefill and decode node (processes on 127.0.0.1), called directly: the prefill
starts before its KV destination is known (as the gateway starts it before the decode node has reserved), holds
the prompt's KV, and pushes it once the destination comes. A destination that never comes, or a bad one, aborts
the request and frees every block; the node keeps serving. The node answers twice: the first token once it is
sampled (``kv_pending``), then the transfer's end."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tandem_cli.launcher import Launcher, Topology
from tests.e2e.test_disaggregated import reference, wait_all_blocks_free

pytestmark = pytest.mark.e2e

KV_TIMEOUT_S = 6.0
WAIT_S = 60.0  # the bound of every wait below (a busy machine's steps can be slow)
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def pair(tiny_served_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    topology = Topology(free_ports=True, model_args=("--model", str(tiny_served_model_dir), "--dtype", "float32"),
                        # chunks of 16: a prompt of 40 tokens takes 3 steps, its last block partial
                        node_args=("--num-blocks", "64", "--max-prefill-chunk", "16",
                                   "--kv-timeout-s", str(KV_TIMEOUT_S), "--grace-s", "1"),
                        gateway_args=("--local-prefill-max-tokens", "0", "--shutdown-grace-s", "1"))
    env = {"TANDEM_HOME": os.environ["TANDEM_HOME"]} if os.environ.get("TANDEM_HOME") else None
    with Launcher(topology, log_dir=tmp_path_factory.mktemp("logs"), env=env) as launcher:
        yield launcher


def _target(launcher: Launcher, role: str) -> str:
    return next(s.target for s in launcher.specs if s.role == role)


def _stats(target: str) -> common_pb2.NodeStats:
    with grpc.insecure_channel(target) as channel:
        return prefill_pb2_grpc.PrefillStub(channel).Stats(common_pb2.StatsRequest(), timeout=10)


def _wait_until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"not within {WAIT_S} s: {what}"
        time.sleep(0.05)


def _prompt_done_and_held(target: str) -> bool:
    """The prefill node computed every prompt it has (first tokens sampled) and holds their KV."""
    s = _stats(target)
    return s.num_running == 0 and s.num_waiting == 0 and s.used_blocks > 0


def _request(request_id: str, prompt: list[int]) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt,
                                      sampling=common_pb2.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                                         ignore_eos=True))


class _Messages:
    """The client's side of a PrefillStream: the request at once, then whatever ``send`` gives (a destination, or
    None to end the stream without one); the gRPC thread that reads it waits for that, up to ``WAIT_S``."""

    def __init__(self, request: prefill_pb2.PrefillRequest) -> None:
        self._request = request
        self._second: prefill_pb2.KVDestination | None = None
        self._ready = threading.Event()

    def send(self, destination: prefill_pb2.KVDestination | None) -> None:
        self._second = destination
        self._ready.set()

    def __iter__(self) -> Iterator[prefill_pb2.PrefillMessage]:
        yield prefill_pb2.PrefillMessage(request=self._request)
        if self._ready.wait(WAIT_S) and self._second is not None:
            yield prefill_pb2.PrefillMessage(destination=self._second)


def _destination(reservation: decode_pb2.Reservation) -> prefill_pb2.KVDestination:
    r = reservation
    return prefill_pb2.KVDestination(kv_endpoint=r.kv_endpoint, node_id=r.node_id, transfer_id=r.transfer_id,
                                     block_ids=r.block_ids, num_cached_tokens=r.num_cached_tokens,
                                     first_block=r.first_block)


def _run_with_late_destination(launcher: Launcher, request_id: str, prompt: list[int]) -> list[int]:
    """Prefill ``prompt`` with its destination sent only once its first token is sampled; the tokens generated."""
    prefill, decode = _target(launcher, "prefill"), _target(launcher, "decode")
    request = _request(request_id, prompt)
    messages = _Messages(request)
    with grpc.insecure_channel(prefill) as p_channel, grpc.insecure_channel(decode) as d_channel:
        answers = prefill_pb2_grpc.PrefillStub(p_channel).PrefillStream(iter(messages), timeout=WAIT_S)
        try:
            _wait_until(lambda: _prompt_done_and_held(prefill), "the prompt computed before its destination")
            stream = decode_pb2_grpc.DecodeStub(d_channel).Generate(decode_pb2.DecodeRequest(
                request_id=request_id, prompt_token_ids=prompt, sampling=request.sampling,
                kv_timeout_seconds=KV_TIMEOUT_S), timeout=WAIT_S)
            first = next(stream)
            assert first.HasField("reservation")
            messages.send(_destination(first.reservation))
            early, reply = list(answers)  # the first token, then the transfer's end
            rest = [t for m in stream for t in m.delta.token_ids]
        finally:
            messages.send(None)
            answers.cancel()
    assert early.kv_pending and (early.transfer_bytes, early.transfer_seconds) == (0, 0)
    assert not reply.kv_pending and reply.transfer_bytes > 0 and reply.first_token == early.first_token
    return [reply.first_token, *rest]


def test_a_destination_after_the_first_token_gets_the_prompts_kv(pair: Launcher, tiny_served_model_dir: Path) -> None:
    prompt = [20 + i * 37 % 4000 for i in range(40)]
    want = reference(tiny_served_model_dir, [prompt], NEW_TOKENS)[0]
    prefill = _target(pair, "prefill")
    free_before = _stats(prefill).free_blocks
    assert _run_with_late_destination(pair, "late-1", prompt) == want
    wait_all_blocks_free(pair)
    assert _stats(prefill).free_blocks == free_before


@pytest.mark.parametrize("ending", ["stream_ends", "cancelled", "kv_timeout"])
def test_a_destination_that_never_comes_aborts_and_frees_every_block(pair: Launcher, ending: str) -> None:
    prefill = _target(pair, "prefill")
    free_before = _stats(prefill).free_blocks
    messages = _Messages(_request(f"never-{ending}", [5 + i for i in range(40)]))
    with grpc.insecure_channel(prefill) as channel:
        answers = prefill_pb2_grpc.PrefillStub(channel).PrefillStream(iter(messages), timeout=WAIT_S)
        try:
            _wait_until(lambda: _prompt_done_and_held(prefill), "the prompt computed, its KV held")
            started = time.monotonic()
            if ending == "stream_ends":
                messages.send(None)
            elif ending == "cancelled":
                answers.cancel()
            if ending != "cancelled":
                with pytest.raises(grpc.RpcError) as info:
                    next(answers)
                if ending == "stream_ends":
                    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert "destination" in (info.value.details() or "")
                else:
                    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                    assert "KV timeout" in (info.value.details() or "")
                    assert time.monotonic() - started < KV_TIMEOUT_S + 10
        finally:
            messages.send(None)
            answers.cancel()
    _wait_until(lambda: _stats(prefill).used_blocks == 0, "every block freed")
    assert _stats(prefill).free_blocks == free_before


def test_an_invalid_destination_is_refused_naming_the_field_and_the_node_keeps_serving(
        pair: Launcher, tiny_served_model_dir: Path) -> None:
    prefill = _target(pair, "prefill")
    free_before = _stats(prefill).free_blocks
    prompt = [7 + i for i in range(40)]
    messages = _Messages(_request("bad-dest", prompt))
    with grpc.insecure_channel(prefill) as channel:
        answers = prefill_pb2_grpc.PrefillStub(channel).PrefillStream(iter(messages), timeout=WAIT_S)
        try:
            # one block too few for the prompt
            messages.send(prefill_pb2.KVDestination(kv_endpoint="127.0.0.1:1", node_id="nobody", transfer_id="bad",
                                                    block_ids=[0]))
            with pytest.raises(grpc.RpcError) as info:
                next(answers)
        finally:
            messages.send(None)
            answers.cancel()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "destination.block_ids" in (info.value.details() or "")
    _wait_until(lambda: _stats(prefill).used_blocks == 0, "every block freed")
    assert _stats(prefill).free_blocks == free_before
    want = reference(tiny_served_model_dir, [prompt], NEW_TOKENS)[0]
    assert _run_with_late_destination(pair, "after-bad", prompt) == want
    wait_all_blocks_free(pair)

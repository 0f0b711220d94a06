"""Sliding-window KV on a disaggregated pair (issue 36): a random-weight Mistral whose window (7 tokens) is a
fraction of the prompts, every layer windowed, served by one prefill and one decode node as real processes on
127.0.0.1, over sockets and over shared memory. Greedy fp32 tokens equal transformers'; the prefill sends only
the blocks the decode node's first query reads (the transfer's bytes say how many); the decode node never held
more blocks than the window needs (its ``peak_used_blocks``); and every block is free afterwards."""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch

from common.engine.model_runner import kv_cache_spec
from common.model.loader import load_model
from tandem.v1 import common_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tandem_cli.launcher import Launcher, Topology
from tests.e2e.test_disaggregated import generate, request, wait_all_blocks_free
from tests.model.test_families import _hf_greedy, _with_tokenizer

pytestmark = pytest.mark.e2e

WINDOW = 7
BLOCK = 4
CHUNK = 8  # prefill chunks: a 45-token prompt takes 6
NEW_TOKENS = 10


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK)


def _dead(first_query: int) -> int:
    """Leading blocks no query at ``first_query`` or later reads (KVCacheManager.blocks_outside_window)."""
    return max(0, first_query - WINDOW + 1) // BLOCK


def _peak_used_blocks(target: str, role: str) -> int:
    stub = prefill_pb2_grpc.PrefillStub if role == "prefill" else decode_pb2_grpc.DecodeStub
    with grpc.insecure_channel(target) as channel:
        return stub(channel).Stats(common_pb2.StatsRequest(), timeout=10).peak_used_blocks


@pytest.mark.parametrize("transport", ["socket", "shm"])
def test_window_only_kv_crosses_and_decode_holds_the_window(tiny_model_factory: Callable[..., Path],
                                                            tmp_path: Path, transport: str) -> None:
    model_dir = _with_tokenizer(tiny_model_factory("mistral", seed=21, sliding_window=WINDOW))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (45, 29, 5)]
    expected = [_hf_greedy(model_dir, p, NEW_TOKENS) for p in prompts]
    bytes_per_block = kv_cache_spec(load_model(model_dir, dtype="float32"), BLOCK).bytes_per_block(4)
    hosts = ("machine-a", "machine-b") if transport == "socket" else ("machine-a", "machine-a")
    topology = Topology(free_ports=True, model_args=("--model", str(model_dir), "--dtype", "float32"),
                        node_args=("--num-blocks", "64", "--block-size", str(BLOCK), "--max-prefill-chunk", str(CHUNK),
                                   "--kv-timeout-s", "20", "--grace-s", "1"),
                        prefill_args=("--host-id", hosts[0]), decode_args=("--host-id", hosts[1]),
                        gateway_args=("--local-prefill-max-tokens", "0", "--stats-interval-s", "0.3",
                                      "--shutdown-grace-s", "1"))
    env = {"TANDEM_HOME": os.environ["TANDEM_HOME"]} if os.environ.get("TANDEM_HOME") else None
    with Launcher(topology, log_dir=tmp_path, env=env) as launcher:
        for again in (False, True):  # the second time from both prefix caches (freed blocks stayed cached)
            for prompt, want in zip(prompts, expected, strict=True):
                tokens, last = generate(launcher.gateway.target, request(prompt, NEW_TOKENS))
                assert tokens == want
                # only the blocks from the first one the decode node's first query (at the prompt's length) reads;
                # again, only the last: the decode node found the window's full blocks in its cache (the dead ones
                # need no hit)
                skipped = (len(prompt) - 1) // BLOCK if again else _dead(len(prompt))
                sent = _blocks(len(prompt)) - skipped
                assert last.timings.kv_transfer_bytes == sent * bytes_per_block, (len(prompt), again, sent)
        wait_all_blocks_free(launcher)
        prefill, decode = (next(s for s in launcher.specs if s.role == role) for role in ("prefill", "decode"))
        _bad_destinations_are_refused_naming_the_field(prefill.target, prompts[0])
        decode_peak = _peak_used_blocks(decode.target, "decode")
        prefill_peak = _peak_used_blocks(prefill.target, "prefill")
    longest = max(len(p) for p in prompts)
    # the decode node: the window's blocks of the longest prompt (3 of 12), one more as decoding crosses a block,
    # never the 14 its whole sequence spans
    assert decode_peak <= _blocks(longest) - _dead(longest) + 1 < _blocks(longest + NEW_TOKENS)
    # the prefill node starts a prompt before the decode node has reserved (PrefillStream): until the destination
    # says which blocks it reads, every block computed may be sent and is kept (KVProducer.kv_read_from), so it
    # may hold up to the whole prompt's blocks; from then on it frees the dead ones behind the window
    assert prefill_peak <= _blocks(longest)
    logs = "\n".join(f.read_text(errors="replace") for f in tmp_path.glob("prefill*"))
    assert f"formed over {transport}" in logs, logs[-2000:]


def _bad_destinations_are_refused_naming_the_field(target: str, prompt: list[int]) -> None:
    """A window reservation's block_ids start at first_block: without it they cannot hold the prompt (a reader
    that ignores the field is refused, never writes the wrong blocks); and first_block must leave the last token."""
    live = _blocks(len(prompt)) - _dead(len(prompt))
    cases = {"destination.block_ids": (0, live), "destination.first_block": (_blocks(len(prompt)), 1)}
    with grpc.insecure_channel(target) as channel:
        stub = prefill_pb2_grpc.PrefillStub(channel)
        for field, (first_block, num_blocks) in cases.items():
            dest = prefill_pb2.KVDestination(kv_endpoint="127.0.0.1:1", node_id="nobody", transfer_id=f"bad-{field}",
                                             block_ids=list(range(num_blocks)), first_block=first_block)
            with pytest.raises(grpc.RpcError) as info:
                stub.Prefill(prefill_pb2.PrefillRequest(request_id=f"bad-{field}", prompt_token_ids=prompt,
                                                        sampling=common_pb2.SamplingParams(max_tokens=1),
                                                        destination=dest), timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in (info.value.details() or "")


def test_a_windowed_draft_model_on_the_decode_node(tiny_model_factory: Callable[..., Path], tmp_path: Path) -> None:
    """The decode node speculates with a windowed draft (the target's weights, loaded as another model, so its
    KV is its own): the request arrives without its leading blocks, the draft starts its context from the first
    block the decode node holds, and the tokens stay transformers'; the decode node still holds only the window
    (now covering the draft's lag: 7 + 3 drafts + 1), never the whole sequence."""
    model_dir = _with_tokenizer(tiny_model_factory("mistral", seed=21, sliding_window=WINDOW))
    draft_dir = _with_tokenizer(tiny_model_factory("mistral", seed=21, sliding_window=WINDOW,
                                                   max_position_embeddings=1000))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (45, 29)]
    expected = [_hf_greedy(model_dir, p, NEW_TOKENS) for p in prompts]
    topology = Topology(free_ports=True, model_args=("--model", str(model_dir), "--dtype", "float32"),
                        node_args=("--num-blocks", "64", "--block-size", str(BLOCK), "--max-prefill-chunk", str(CHUNK),
                                   "--kv-timeout-s", "20", "--grace-s", "1"),
                        decode_args=("--speculative", "draft_model", "--draft-model", str(draft_dir),
                                     "--num-speculative-tokens", "3"),
                        gateway_args=("--local-prefill-max-tokens", "0", "--shutdown-grace-s", "1"),
                        metrics_base_port=0)
    env = {"TANDEM_HOME": os.environ["TANDEM_HOME"]} if os.environ.get("TANDEM_HOME") else None
    with Launcher(topology, log_dir=tmp_path, env=env) as launcher:
        for prompt, want in zip(prompts, expected, strict=True):
            tokens, _ = generate(launcher.gateway.target, request(prompt, NEW_TOKENS))
            assert tokens == want
        wait_all_blocks_free(launcher)
        decode = next(s for s in launcher.specs if s.role == "decode")
        with grpc.insecure_channel(decode.target) as channel:
            stats = decode_pb2_grpc.DecodeStub(channel).Stats(common_pb2.StatsRequest(), timeout=10)
        with urllib.request.urlopen(f"http://127.0.0.1:{decode.metrics_port}/metrics", timeout=10) as response:
            metrics = response.read().decode()
    drafted = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("tandem:spec_decode_num_draft_tokens_total")]
    assert drafted and drafted[0] > 0, metrics[-3000:]
    longest = max(len(p) for p in prompts)
    window = WINDOW + 3 + 1
    first_dead = max(0, longest - window + 1) // BLOCK
    assert stats.peak_used_blocks <= _blocks(longest) - first_dead + 2 < _blocks(longest + NEW_TOKENS)

"""`tandem bench serve --peer vllm`'s parts that run without vLLM: the server's command line and
environment (same cores, precision, KV budget), the client's workloads, the shipped chat lengths, the
report, and a clear refusal when the peer is not installed."""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import pytest

from benchmarks.bench_serve import main as bench_serve_main
from benchmarks.peers.vllm_server import VLLMServerConfig
from benchmarks.serve_peer import (
    CHAT_LENGTHS,
    MIXED_LENGTHS,
    Row,
    chat_lengths_rows,
    client_workloads,
    mixed_lengths_rows,
    report,
    schedule,
    system_variant,
)


def test_the_server_gets_the_same_cores_precision_and_kv_budget(tmp_path: Path) -> None:
    config = VLLMServerConfig(tmp_path, "SmolLM2-135M-Instruct", "float32", (0, 1), kv_cache_gib=1,
                              max_model_len=4096)
    argv = config.argv(Path("/peer/bin/python"), 12345)
    assert argv[:4] == ["taskset", "-c", "0,1", "/peer/bin/python"]
    assert argv[4:6] == ["-m", "vllm.entrypoints.openai.api_server"]  # not the `vllm` script (SIGILL on AVX2)
    flags = dict(zip(argv[6::2], argv[7::2], strict=False))
    assert flags["--host"] == "127.0.0.1" and flags["--port"] == "12345" and flags["--dtype"] == "float32"
    env = config.env()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_workloads_and_the_shipped_chat_lengths(smollm2_dir: Path) -> None:
    named = client_workloads(48)
    assert list(named) == ["random-384-128", "random-1024-64", "random-128-256", "chat", "mixed", "shared-prefix"]
    assert all(w.num_prompts == 48 for w in named.values())
    assert "--random-prefix-len" in named["shared-prefix"].dataset_args
    rows = [json.loads(line) for line in CHAT_LENGTHS.read_text().splitlines()]
    assert rows == chat_lengths_rows(smollm2_dir)  # the file is what the generator writes
    outputs = [r["output_tokens"] for r in rows]
    assert 100 <= statistics.median(outputs) <= 220 and max(outputs) <= 600
    assert len({r["prompt"][:30] for r in rows}) == len(rows)  # no two prompts share an opening


def test_the_shipped_mixed_workload_is_tandems_mixed_workload(smollm2_dir: Path) -> None:
    from tokenizers import Tokenizer

    mixed = client_workloads(48)["mixed"]
    assert (mixed.ttft_slo_ms, mixed.tpot_slo_ms) == (4000, 200)  # the mixed workload's SLOs (workloads.py)
    assert str(MIXED_LENGTHS) in mixed.dataset_args
    for custom in (mixed, client_workloads(48)["chat"]):  # each row's output length, not the client's 256
        args = custom.dataset_args
        assert args[args.index("--custom-output-len") + 1] == "-1"
    rows = [json.loads(line) for line in MIXED_LENGTHS.read_text().splitlines()]
    assert rows == mixed_lengths_rows(smollm2_dir)  # the file is what the generator writes
    tokenizer = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    shapes = [(len(tokenizer.encode(r["prompt"]).ids), r["output_tokens"]) for r in rows]
    longs = [(p, o) for p, o in shapes if p > 1000]
    shorts = [(p, o) for p, o in shapes if p <= 1000]
    # About one request in five is a long prompt with a short output; the others are short chats that decode long.
    assert 0.15 <= len(longs) / len(rows) <= 0.25
    assert all(p <= 1536 + 32 and 8 <= o <= 16 for p, o in longs)
    assert all(p <= 128 + 32 and 64 <= o <= 128 for p, o in shorts)
    assert len({r["prompt"][:30] for r in rows}) == len(rows)


def test_report_puts_each_system_beside_vllm() -> None:
    result = {"completed": 48, "num_prompts": 48, "output_throughput": 100.0, "p50_ttft_ms": 1000,
              "p99_ttft_ms": 2000, "p50_tpot_ms": 300, "p99_tpot_ms": 400, "p50_itl_ms": 290, "p99_itl_ms": 500,
              "request_goodput": 0.5}
    rows = [Row("vllm", "random-384-128", math.inf, "vllm bench serve", result),
            Row("colocated", "random-384-128", math.inf, "vllm bench serve", {**result, "output_throughput": 125.0})]
    args = argparse.Namespace(cpus=(0, 1))
    text = report(rows, {"vllm": 200.0, "colocated": 4.5}, args, "SmolLM2-135M-Instruct", "float32", "0.32.0")
    assert "| colocated | 4.5 |" in text and "| vllm | 200.0 |" in text
    assert "| colocated | vllm bench serve | inf | 48/48 | 125.0 | 1.25x |" in text


def test_the_systems_run_back_to_back_at_each_rate_and_take_turns_going_first() -> None:
    slots = schedule(["vllm", "colocated", "disaggregated"], ["mixed", "random-384-128"], [0.6, math.inf], rounds=2)
    assert [(r, w, rate) for r, w, rate, _ in slots] == [
        (r, w, rate) for r in (0, 1) for w in ("mixed", "random-384-128") for rate in (0.6, math.inf)]
    assert {tuple(order) for r, *_, order in slots if r == 0} == {("vllm", "colocated", "disaggregated")}
    assert {tuple(order) for r, *_, order in slots if r == 1} == {("colocated", "disaggregated", "vllm")}
    with pytest.raises(ValueError, match="--rounds must be >= 1"):
        schedule(["vllm"], ["mixed"], [1.0], rounds=0)


def test_rounds_are_compared_with_the_peer_of_the_same_round() -> None:
    def result(tok_s: float, ttft: float) -> dict[str, float]:
        return {"completed": 48, "num_prompts": 48, "output_throughput": tok_s, "p50_ttft_ms": ttft,
                "p99_ttft_ms": 2 * ttft, "p50_tpot_ms": 100, "p99_tpot_ms": 200, "p50_itl_ms": 90, "p99_itl_ms": 300,
                "request_goodput": 1.0}

    # The machine was twice as fast in round 2: each round's ratio is 1.2x (a cross-round one would say 0.6x/2.4x).
    rows = [Row("vllm", "mixed", 1.2, "vllm bench serve", result(100.0, 400.0), 0),
            Row("colocated", "mixed", 1.2, "vllm bench serve", result(120.0, 300.0), 0),
            Row("colocated", "mixed", 1.2, "vllm bench serve", result(240.0, 150.0), 1),
            Row("vllm", "mixed", 1.2, "vllm bench serve", result(200.0, 200.0), 1),
            Row("colocated", "mixed", 1.2, "vllm bench serve", result(270.0, 150.0), 2),
            Row("vllm", "mixed", 1.2, "vllm bench serve", result(200.0, 100.0), 2)]
    text = report(rows, {"vllm": 70.0, "colocated": 2.0}, argparse.Namespace(cpus=(0, 1)), "m", "float32", "0.32.0")
    assert "Each system ran 3 times" in text
    assert "| colocated | vllm bench serve | 1.2 | 1 | 48/48 | 120.0 | 1.20x |" in text
    assert "| colocated | vllm bench serve | 1.2 | 2 | 48/48 | 240.0 | 1.20x |" in text
    assert "| colocated | vllm bench serve | 1.2 | 3 | 48/48 | 270.0 | 1.35x |" in text
    # output 1.2, 1.2, 1.35; TTFT p50 0.75, 0.75, 1.5; TPOT and goodput 1.0 in every round
    assert ("| colocated | 1.2 | 1.20x [1.20-1.35] | 0.75x [0.75-1.50] | 0.75x [0.75-1.50] | 1.00x [1.00-1.00] | "
            "1.00x [1.00-1.00] | 1.00x [1.00-1.00] |") in text


def test_a_system_variant_carries_its_tandem_settings() -> None:
    assert system_variant("colocated") == ("colocated", {})
    assert system_variant("colocated/TANDEM_MAX_NUM_BATCHED_TOKENS=2048/TANDEM_MAX_PREFILL_CHUNK=2048") == (
        "colocated", {"TANDEM_MAX_NUM_BATCHED_TOKENS": "2048", "TANDEM_MAX_PREFILL_CHUNK": "2048"})
    for bad in ("colocated/OMP_NUM_THREADS=1", "colocated/TANDEM_X"):
        with pytest.raises(ValueError, match="TANDEM_NAME=VALUE"):
            system_variant(bad)


def test_without_the_peer_it_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    tiny_served_model_dir: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TANDEM_PEER_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    status = bench_serve_main(["--peer", "vllm", "--model", str(tiny_served_model_dir), "--dtype", "float32"])
    assert status == 2 and "setup-peer.sh vllm" in capsys.readouterr().err


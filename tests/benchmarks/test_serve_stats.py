"""The serving benchmark's statistics, its JSON results (the schema the suite's report reads) and its
command line's choice of workload and systems; no service is started."""

from __future__ import annotations

import argparse
import json
import re

import jsonschema
import pytest

from benchmarks.bench_serve import SYSTEMS, add_arguments, configure_workload, results_json
from benchmarks.serve_client import RequestRecord
from benchmarks.serve_stats import Distribution, kind_table, markdown_table, summarize
from benchmarks.workloads import WORKLOADS, MixedWorkload, MultiTurnWorkload, SharedPrefixWorkload

_D = {"oneOf": [{"type": "null"}, {"type": "object", "additionalProperties": False,
                                   "required": ["mean", "p50", "p90", "p99"],
                                   "properties": {k: {"type": "number"} for k in ("mean", "p50", "p90", "p99")}}]}
_OPTIONAL_NUMBER = {"type": ["number", "null"]}


def _object(properties: dict[str, object], **extra: object) -> dict[str, object]:
    return {"type": "object", "additionalProperties": False, "required": list(properties), "properties": properties,
            **extra}


# The --json document, exactly: the suite's report (benchmarks/report.py, plots.py) reads these fields.
SCHEMA = _object({
    "model": {"type": "string"}, "dtype": {"type": "string"},
    "workload": {"type": "object", "required": ["name"],
                 "properties": {"name": {"enum": ["serving", "shared-prefix", "mixed", "multi-turn"]}}},
    "rate": {"type": ["number", "null"]}, "rates": {"type": "array", "items": {"type": "number"}},
    "concurrency": {"type": ["integer", "null"]},
    "cpus": {"type": "array", "items": {"type": "integer"}},
    "slo": _object({"ttft_s": {"type": "number"}, "tpot_s": {"type": "number"}}),
    "local_prefill_max_tokens": {"type": "integer"},
    "apis": {"type": "array", "items": {"enum": ["grpc", "openai"]}},
    "capacity": {"type": "object", "additionalProperties": _OPTIONAL_NUMBER},
    "capacity_attainment": {"type": "number"},
    "systems": {"type": "array", "items": _object({
        "system": {"type": "string"}, "placement": {"type": "string"},
        **{k: {"type": "integer"} for k in ("completed", "failed", "wrong_length", "input_tokens", "output_tokens")},
        **{k: {"type": "number"} for k in ("duration_s", "request_throughput", "output_throughput",
                                           "tokens_per_message")},
        **{k: _D for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s", "kv_transfer_s")},
        "errors": {"type": "array", "items": {"type": "string"}},
        "started": {"type": "boolean"}, "goodput": _OPTIONAL_NUMBER, "rate": _OPTIONAL_NUMBER,
        "cache": {"type": "object", "additionalProperties": False,
                  "properties": {k: {"type": "integer"} for k in ("queries", "hits", "offload_hits")}},
        "slo": {"oneOf": [{"type": "null"}, _object({
            "slo": _object({"ttft_s": {"type": "number"}, "tpot_s": {"type": "number"}}),
            **{k: {"type": "integer"} for k in ("num_requests", "met_both", "met_ttft", "met_tpot")},
            "duration_s": {"type": "number"}})]},
        "by_kind": {"type": "object", "additionalProperties": _object({
            "completed": {"type": "integer"}, "ttft_s": _D, "tpot_s": _D, "e2e_s": _D})},
        "records": {"type": "array", "items": _object({
            "index": {"type": "integer"}, "kind": {"type": "string"}, "prompt_len": {"type": "integer"},
            "num_tokens": {"type": "integer"}, "ok": {"type": "boolean"},
            "ttft_s": _OPTIONAL_NUMBER, "tpot_s": _OPTIONAL_NUMBER, "e2e_s": _OPTIONAL_NUMBER})},
    })},
})


def records() -> list[RequestRecord]:
    # 0 (short): sent at 0, tokens at 0.5, 0.6, 0.8 (3 messages, 4 tokens); 1 (long) failed;
    # 2 (long): sent at 1, tokens at 3.0 and 3.2 (2 messages, 2 tokens).
    return [
        RequestRecord(0, "short", prompt_len=10, expected_tokens=4, sent=0.0, first=0.5, last=0.8, num_tokens=4,
                      num_messages=3, gaps=[0.1, 0.2], queue_s=0.05, kv_transfer_s=0.02),
        RequestRecord(1, "long", prompt_len=20, expected_tokens=4, sent=0.1, error="UNAVAILABLE: down"),
        RequestRecord(2, "long", prompt_len=30, expected_tokens=2, sent=1.0, first=3.0, last=3.2, num_tokens=2,
                      num_messages=2, gaps=[0.2]),
    ]


def test_summary_of_client_records() -> None:
    s = summarize("x", "here", records()[:2], duration_s=2.0)
    assert (s.completed, s.failed, s.wrong_length) == (1, 1, 0)
    assert (s.input_tokens, s.output_tokens) == (10, 4)
    assert s.ttft_s == Distribution(0.5, 0.5, 0.5, 0.5)
    assert s.tpot_s is not None and s.tpot_s.mean == pytest.approx(0.1)  # (0.8 - 0.5) / 3
    assert s.itl_s is not None and s.itl_s.mean == pytest.approx(0.15)
    assert s.request_throughput == 0.5 and s.output_throughput == 2.0
    assert s.tokens_per_message == pytest.approx(4 / 3)
    assert s.queue_s == Distribution(0.05, 0.05, 0.05, 0.05) and s.kv_transfer_s is not None
    assert s.errors == ("UNAVAILABLE: down",)
    table = markdown_table([s, s])
    assert "| metric | x | x |" in table and "| TTFT p50 (ms) | 500 | 500 |" in table
    assert "| server queue p99 (ms) | 50.0 | 50.0 |" in table


def test_per_kind_latencies_and_their_table() -> None:
    s = summarize("x", "here", records(), duration_s=4.0)
    assert list(s.by_kind) == ["short", "long"]  # in the order kinds first arrive
    short, long = s.by_kind["short"], s.by_kind["long"]
    assert (short.completed, long.completed) == (1, 1)  # the failed long request counts nowhere
    assert long.ttft_s == Distribution(2.0, 2.0, 2.0, 2.0) and long.e2e_s is not None and long.e2e_s.mean == 2.2
    assert long.tpot_s is not None and long.tpot_s.mean == pytest.approx(0.2)
    assert s.ttft_s is not None and s.ttft_s.mean == pytest.approx(1.25)  # both kinds together
    table = kind_table([s])
    assert table is not None and "| kind: metric | x |" in table
    assert "| long: TTFT p99 (ms) | 2000 |" in table and "| short: completed | 1 |" in table
    one_kind = summarize("y", "here", [RequestRecord(0, "chat", 5, 1, first=0.1, last=0.1, num_tokens=1)], 1.0)
    assert kind_table([one_kind]) is None and one_kind.by_kind["chat"].tpot_s is None


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_json_results_follow_the_schema() -> None:
    recs = records()
    s = summarize("disaggregated", "gateway [unpinned]", recs, duration_s=4.0)
    empty = summarize("colocated", "colocated-0 [cpu 0]", [], duration_s=0.0)
    args = parse("--workload", "mixed", "--quick", "--cpus", "0-1")
    args.rate = 1.0
    document = json.loads(json.dumps(results_json([(s, recs), (empty, [])], configure_workload(args), args,
                                                  "tiny", "float32")))
    jsonschema.validate(document, SCHEMA)
    assert document["workload"] == {"name": "mixed", "num_requests": 12, "short_prompt_len": [32, 96],
                                    "short_output_len": [32, 64], "long_prompt_len": [512, 768],
                                    "long_output_len": [8, 16], "long_rate_fraction": 0.25, "seed": 0}
    assert document["rate"] == 1.0 and document["concurrency"] is None and document["cpus"] == [0, 1]
    system = document["systems"][0]
    assert system["records"][1] == {"index": 1, "kind": "long", "prompt_len": 20, "num_tokens": 0, "ok": False,
                                    "ttft_s": None, "tpot_s": None, "e2e_s": None}
    assert system["by_kind"]["long"]["completed"] == 1 and document["systems"][1]["ttft_s"] is None


def test_the_workload_flag_picks_a_preset_and_its_fields_take_overrides() -> None:
    assert configure_workload(parse()) == WORKLOADS["serving"].full
    assert configure_workload(parse("--workload", "mixed", "--quick")) == WORKLOADS["mixed"].quick
    shared = configure_workload(parse("--workload", "shared-prefix", "--num-requests", "5", "--output-len", "4:8",
                                      "--seed", "3"))
    assert shared == SharedPrefixWorkload(num_requests=5, output_len=(4, 8), seed=3)
    with pytest.raises(ValueError, match="--prompt-len does not apply to the mixed workload"):
        configure_workload(parse("--workload", "mixed", "--prompt-len", "8:16"))
    with pytest.raises(ValueError, match="num_requests"):
        configure_workload(parse("--workload", "mixed", "--num-requests", "2"))
    assert isinstance(configure_workload(parse("--workload", "mixed")), MixedWorkload)


def test_system_variants_set_prefix_caching_explicitly() -> None:
    assert parse().systems == "disaggregated,colocated"
    assert [(s.name, s.disaggregated) for s in SYSTEMS.values()] == [
        ("disaggregated", True), ("colocated", False), ("conditional", True), ("disaggregated-nocache", True),
        ("colocated-nocache", False)]
    assert SYSTEMS["colocated"].node_args == ("--enable-prefix-caching", "--kv-offload", "none")
    assert SYSTEMS["disaggregated-nocache"].node_args == ("--no-enable-prefix-caching", "--kv-offload", "none")


def test_systems_with_an_offload_tier_and_the_pool_flags() -> None:
    from benchmarks.bench_serve import pool_args, system_named

    tiered = system_named("conditional+cpu")
    assert (tiered.name, tiered.disaggregated, tiered.local_prefill, tiered.kv_offload) == (
        "conditional+cpu", True, True, "cpu")
    assert tiered.node_args == ("--enable-prefix-caching", "--kv-offload", "cpu")
    assert system_named("colocated+disk").node_args[-1] == "disk"
    assert system_named("colocated") == SYSTEMS["colocated"]
    for bad, named in (("colocated+ssd", "colocated+ssd"), ("nothing", "nothing"),
                       ("colocated-nocache+cpu", "turns off")):
        with pytest.raises(ValueError, match=re.escape(named)):
            system_named(bad)
    assert pool_args(parse()) == ()
    assert pool_args(parse("--num-blocks", "200", "--kv-offload-gb", "0.5")) == (
        "--num-blocks", "200", "--kv-offload-gb", "0.5")
    from benchmarks.bench_serve import role_pool_args

    assert system_named("disaggregated+shared").node_args[-1] == "shared"
    assert role_pool_args(parse("--num-blocks", "200")) == {}
    assert role_pool_args(parse("--prefill-num-blocks", "120", "--decode-num-blocks", "226")) == {
        "prefill": ("--num-blocks", "120"), "decode": ("--num-blocks", "226")}


def test_multi_turn_flags_shape_the_workload() -> None:
    workload = configure_workload(parse("--workload", "multi-turn", "--conversations", "20", "--turns", "3",
                                        "--think-s", "12", "--message-len", "8:24", "--system-len", "64"))
    assert isinstance(workload, MultiTurnWorkload)
    assert (workload.num_conversations, workload.turns, workload.think_s, workload.message_len,
            workload.system_len, workload.num_requests) == (20, 3, 12.0, (8, 24), 64, 60)
    # One turn of 32 system + 16 message + 16 answer tokens each: 4 blocks, the system prompt's 2 shared.
    single = MultiTurnWorkload(num_conversations=3, turns=1, system_len=32, message_len=(16, 16),
                               output_len=(16, 16))
    assert single.history_blocks(16) == 2 + 3 * 2
    two = MultiTurnWorkload(num_conversations=3, turns=2, system_len=32, message_len=(16, 16), output_len=(16, 16))
    assert two.history_blocks(16) == 2 + 3 * 4  # the second turn adds a message and an answer: 2 more each
    with pytest.raises(ValueError, match="--conversations does not apply"):
        configure_workload(parse("--workload", "serving", "--conversations", "3"))

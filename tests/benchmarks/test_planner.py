"""The planner: the simulator with exact expectations on tiny synthetic cost models, the cost-model fit on
synthetic data and its store, and `tandem plan` end to end on a tiny random-weight model (no timing asserted)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from benchmarks.planner.cost_model import CostKey, CostModel, CostModelStore, StepSample, StepShape, fit
from benchmarks.planner.plan import candidates, parse_deployment, recommend, threads_per_node
from benchmarks.planner.simulator import Deployment, simulate
from benchmarks.slo import SLO
from benchmarks.workloads import TimedRequest
from common.config.engine_config import CacheConfig, SchedulerConfig

# 10 ms a step + 1 ms per prefill token + 2 ms per decoding sequence; KV moves at 0.1 ms a token.
COST = CostModel(base_s=0.01, per_prefill_token_s=0.001, per_decode_seq_s=0.002, per_context_token_s=0.0,
                 per_prefill_pair_s=0.0, kv_transfer_per_token_s=0.0001)
COLOCATED = Deployment(0, 1)


def req(index: int, prompt_len: int, output_len: int, arrival_s: float, first_id: int = 0) -> TimedRequest:
    return TimedRequest(index, tuple(range(first_id, first_id + prompt_len)), output_len, arrival_s, "chat")


def test_one_request_alone_ttft_is_its_prefill_steps_and_tpot_a_decode_step() -> None:
    (t,) = simulate([req(0, 100, 3, 0.0)], COLOCATED, COST).timings
    assert t.ttft_s == pytest.approx(0.11)  # one step: 10 ms + 100 prefill tokens
    assert t.tpot_s == pytest.approx(0.012)  # 10 ms + one decoding sequence
    assert t.finish_s == pytest.approx(0.134) and t.num_tokens == 3
    # 1200 tokens in chunks of at most 512: 512 + 512 + 176, three steps before the first token.
    (long,) = simulate([req(0, 1200, 1, 0.5)], COLOCATED, COST).timings
    assert long.ttft_s == pytest.approx(0.522 + 0.522 + 0.186) and long.tpot_s is None


def test_a_request_arriving_mid_step_joins_the_next_step_beside_the_decodes() -> None:
    a, b = simulate([req(0, 100, 3, 0.0), req(1, 50, 2, 0.05, first_id=500)], COLOCATED, COST).timings
    # Step 1 (0 -> 0.11): A's prefill. Step 2 (-> 0.172): A decodes, B prefills 50 tokens beside it.
    # Step 3 (-> 0.186): both decode; A has its 3rd token, B its 2nd.
    assert a.ttft_s == pytest.approx(0.11) and a.finish_s == pytest.approx(0.186)
    assert a.tpot_s == pytest.approx((0.186 - 0.11) / 2)
    assert b.ttft_s == pytest.approx(0.172 - 0.05) and b.tpot_s == pytest.approx(0.014)


def test_the_token_budget_splits_prefills_across_steps() -> None:
    limits = SchedulerConfig(max_num_batched_tokens=120, max_prefill_chunk=None)
    a, b = simulate([req(0, 100, 2, 0.0), req(1, 100, 1, 0.0, first_id=500)], COLOCATED, COST, limits).timings
    # Both arrive at 0, but a step starts when the first arrives: step 1 is A's 100 tokens (0.11).
    # Step 2: A decodes (1) and B gets the remaining budget, 119 >= 100 (0.01 + 0.1 + 0.002 = 0.112).
    assert a.ttft_s == pytest.approx(0.11) and a.finish_s == pytest.approx(0.222)
    assert b.ttft_s == pytest.approx(0.222)
    tight = SchedulerConfig(max_num_batched_tokens=60, max_prefill_chunk=None)
    (c,) = simulate([req(0, 100, 1, 0.0)], COLOCATED, COST, tight).timings
    assert c.ttft_s == pytest.approx(0.07 + 0.05)  # 60 then 40 tokens


def test_disaggregated_pushes_kv_then_decodes_and_conditional_prefills_short_prompts_locally() -> None:
    (t,) = simulate([req(0, 100, 3, 0.0)], Deployment(1, 1), COST).timings
    assert t.ttft_s == pytest.approx(0.11 + 0.01)  # the prefill step, then 100 tokens of KV at 0.1 ms
    assert t.tpot_s == pytest.approx(0.012) and t.finish_s == pytest.approx(0.144)
    both = [req(0, 100, 3, 0.0), req(1, 50, 2, 0.0, first_id=500)]
    _, queued = simulate(both, Deployment(1, 1), COST).timings
    # Disaggregated: B waits behind A's prefill (0.11), prefills (0.06), then its KV (0.005).
    assert queued.ttft_s == pytest.approx(0.11 + 0.06 + 0.005)
    a, local = simulate(both, Deployment(1, 1, local_prefill_max_tokens=64), COST).timings
    assert local.ttft_s == pytest.approx(0.06)  # on the decode node, at once
    assert a.ttft_s == pytest.approx(0.12)
    # B decodes 0.06 -> 0.072 and is done; A's KV lands at 0.12 and it decodes alone.
    assert local.finish_s == pytest.approx(0.072) and a.finish_s == pytest.approx(0.144)


def test_conditional_sends_a_long_prompt_to_an_idle_decode_node_when_the_prefill_node_is_busy() -> None:
    # Three 1000-token prompts at once, local threshold 64: the first two go to the prefill node (for the
    # second, the decode node's 2.5 * 1000 > 1000 + 1000); for the third 2.5 * 1000 < 2000 + 1000, so the decode
    # node prefills it, beside the others' prefill instead of behind it (gateway.prefill_policy.local_wins).
    three = [req(i, 1000, 2, 0.0, first_id=5000 * i) for i in range(3)]
    a, b, c = simulate(three, Deployment(1, 1, local_prefill_max_tokens=64), COST).timings
    # 512 + 488 tokens in two steps on the decode node alone: 0.522 + 0.498
    assert c.ttft_s == pytest.approx(1.02)
    assert a.ttft_s > 1.02 and b.ttft_s > 1.02  # two prompts' chunks share the prefill node's steps
    *_, queued = simulate(three, Deployment(1, 1), COST).timings  # disaggregated: it shares the prefill steps
    assert queued.ttft_s > c.ttft_s + 0.5


def test_a_served_step_adds_its_streamed_tokens() -> None:
    alone = [req(0, 64, 3, 0.0)]
    (plain,) = simulate(alone, COLOCATED, COST).timings
    (served,) = simulate(alone, COLOCATED, dataclasses.replace(COST, per_streamed_token_s=0.004)).timings
    assert served.ttft_s == pytest.approx(plain.ttft_s)  # the prefill step decodes nothing
    assert served.tpot_s == pytest.approx(plain.tpot_s + 0.004)  # each decode step streams one token
    assert dataclasses.replace(COST, per_streamed_token_s=0.004).step_s(StepShape(0, 3, 30)) == pytest.approx(
        COST.step_s(StepShape(0, 3, 30)) + 0.012)


def test_prefix_caching_skips_the_cached_full_blocks_and_the_kv_already_on_the_decode_node() -> None:
    first, second = req(0, 64, 1, 0.0), TimedRequest(1, tuple(range(48)) + (900,) * 16, 1, 1.0, "chat")
    one, two = simulate([first, second], COLOCATED, COST).timings
    assert one.ttft_s == pytest.approx(0.074) and two.ttft_s == pytest.approx(0.026)  # 3 blocks of 16 cached
    off = simulate([first, second], COLOCATED, COST, cache=CacheConfig(enable_prefix_caching=False)).timings
    assert off[1].ttft_s == pytest.approx(0.074)
    _, disagg = simulate([first, second], Deployment(1, 1), COST).timings
    assert disagg.ttft_s == pytest.approx(0.026 + 16 * 0.0001)  # only the 16 uncached tokens move


def test_a_full_kv_cache_makes_requests_wait_for_blocks_on_either_node() -> None:
    both = [req(0, 100, 3, 0.0), req(1, 50, 2, 0.05, first_id=500)]
    small = CacheConfig(num_blocks=10)  # 160 tokens: A's 7 blocks leave 3, B needs 4
    a, b = simulate(both, COLOCATED, COST, cache=small).timings
    # B is not admitted beside A's decodes (0.11 -> 0.122 -> 0.134) but once A has freed its blocks.
    assert a.finish_s == pytest.approx(0.134) and b.ttft_s == pytest.approx(0.134 + 0.06 - 0.05)
    assert b.finish_s == pytest.approx(0.134 + 0.06 + 0.012)
    # Disaggregated: the decode node cannot reserve B's blocks before A is done (0.144), so B's prefill
    # starts then: 0.06 of prefill and 0.005 of KV later it has its first token.
    a, b = simulate([req(0, 100, 3, 0.0), req(1, 50, 2, 0.0, first_id=500)], Deployment(1, 1), COST,
                    cache=small).timings
    assert a.finish_s == pytest.approx(0.144) and b.ttft_s == pytest.approx(0.144 + 0.06 + 0.005)
    # The prefill node frees the blocks it held for the transfer once the KV has landed, so one after another
    # fits; the decode node's are freed when each request ends.
    apart = [req(i, 100, 1, float(i), first_id=1000 * i) for i in range(3)]
    assert [t.ttft_s for t in simulate(apart, Deployment(1, 1), COST, cache=small).timings] == pytest.approx([0.12] * 3)
    with pytest.raises(ValueError, match="max_model_len = 64"):  # a node refuses such a prompt
        simulate(both, COLOCATED, COST, SchedulerConfig(max_model_len=64))


def test_goodput_of_a_simulated_run() -> None:
    result = simulate([req(0, 100, 3, 0.0), req(1, 50, 2, 0.05, first_id=500)], COLOCATED, COST)
    assert result.duration_s == pytest.approx(0.186)
    a = result.attainment(SLO(ttft_s=0.115, tpot_s=0.02))
    assert (a.met_ttft, a.met_tpot, a.met_both) == (1, 1, 0)  # A: TPOT 38 ms misses; B: TTFT 122 ms misses


def test_candidates_names_and_the_recommendation() -> None:
    assert [d.name for d in candidates(3, [256])] == [
        "colocated x3", "1P:2D", "1P:2D local<=256", "2P:1D", "2P:1D local<=256"]
    assert [d.name for d in candidates(1, [256])] == ["colocated x1"]
    assert parse_deployment("colocated", 2) == Deployment(0, 2)
    assert parse_deployment("1P:1D@256", 2) == Deployment(1, 1, 256)
    with pytest.raises(ValueError, match="PP:DD"):
        parse_deployment("one-one", 2)
    assert threads_per_node(2, [0, 1, 2, 3, 4]) == 2 and threads_per_node(4, [0]) == 1
    from benchmarks.planner.plan import Candidate

    requests = [req(0, 100, 3, 0.0), req(1, 50, 2, 0.0, first_id=500)]
    runs = [Candidate(simulate(requests, d, COST), SLO(0.1, 0.02)) for d in candidates(2, [64])]
    # A's TTFT (>= 110 ms) misses everywhere; B meets both SLOs on its own replica (done at 0.134 s, when A
    # is) and prefilled on the decode node (A done at 0.144 s), not behind A on the prefill node.
    assert [c.result.attainment(c.slo).goodput for c in runs] == pytest.approx([1 / 0.134, 0.0, 1 / 0.144])
    assert recommend(runs).result.deployment == Deployment(0, 2)
    # Every request meeting both SLOs: goodput (2 / duration) still decides when it differs by more than 2%.
    loose = [Candidate(c.result, SLO(1.0, 0.05)) for c in runs]
    assert [c.result.attainment(c.slo).met_both for c in loose] == [2, 2, 2]
    assert recommend(loose).result.deployment == Deployment(0, 2)
    assert recommend(loose[1:]).result.deployment == Deployment(1, 1, 64)  # done at 0.144 s, not 0.187 s
    # Requests 10 s apart: the durations (10.134 s, 10.144 s) tie, and the most headroom under the SLOs
    # wins: TTFT p99 / SLO 0.11 colocated, 0.12 with the KV transfer; TPOT p99 / SLO 0.012 both.
    apart = [req(0, 100, 3, 0.0), req(1, 100, 3, 10.0, first_id=500)]
    tied = [Candidate(simulate(apart, d, COST), SLO(1.0, 1.0)) for d in (Deployment(1, 1), Deployment(0, 2))]
    assert [round(c.headroom, 6) for c in tied] == [0.12, 0.11]
    assert recommend(tied).result.deployment == Deployment(0, 2)
    assert "| colocated x2 | 85 | 110 | 12 | 12 | 7.463 | 50 |" in "| " + " | ".join(runs[0].row()) + " |"


def test_step_shape_of_scheduled_chunks() -> None:
    shape = StepShape.of([(0, 100, False), (50, 1, True), (200, 1, True), (100, 28, False)])
    assert shape == StepShape(prefill_tokens=128, decode_seqs=2, context_tokens=252,
                              prefill_pairs=100 * 50 + 28 * (100 + 14))


def test_fit_recovers_synthetic_coefficients_and_keeps_them_non_negative() -> None:
    truth = CostModel(0.004, 2e-4, 1e-3, 3e-6, 1e-8)
    shapes = [StepShape(p, d, c, pairs) for p, d, c, pairs in (
        (0, 1, 64, 0), (0, 8, 512, 0), (0, 16, 4000, 0), (128, 0, 0, 8192), (512, 0, 0, 131072),
        (512, 4, 900, 400000), (32, 16, 1000, 512), (256, 6, 2000, 32768), (64, 2, 300, 2048))]
    model = fit([StepSample(s, truth.step_s(s)) for s in shapes], kv_transfer_per_token_s=1e-6)
    for got, want in zip(model.coefficients, truth.coefficients, strict=True):
        assert got == pytest.approx(want, rel=1e-6)
    assert model.kv_transfer_per_token_s == 1e-6 and model.num_samples == 9 and model.rms_error_s < 1e-12
    # Steps that get cheaper with more decodes: the unconstrained fit would say a decode costs < 0.
    falling = [StepSample(StepShape(p, d), 0.05 + 0.001 * p - 0.001 * d) for p, d in
               ((0, 1), (0, 4), (10, 2), (20, 8), (40, 1))]
    clipped = fit(falling)
    assert clipped.per_decode_seq_s == 0.0 and min(clipped.coefficients) >= 0
    with pytest.raises(ValueError, match="at least 2"):
        fit(falling[:1])


def test_the_store_keys_models_by_model_dtype_threads_and_cpu(tmp_path: Path) -> None:
    store = CostModelStore(tmp_path)
    key = CostKey("SmolLM2-135M-Instruct", "bfloat16", 1, "AMD EPYC")
    assert store.load(key) is None
    store.save(key, COST)
    store.save(CostKey("SmolLM2-135M-Instruct", "bfloat16", 2, "AMD EPYC"), CostModel(1, 0, 0, 0, 0))
    assert CostModelStore(tmp_path).load(key) == COST
    assert store.path == tmp_path / "planner" / "cost_models.json" and len(json.loads(store.path.read_text())) == 2
    entries = json.loads(store.path.read_text())  # a fit stored by another version (other fields): fit again
    entries[key.label]["cost_model"]["a_field_of_another_version"] = 1.0
    store.path.write_text(json.dumps(entries))
    assert store.load(key) is None


def test_plan_end_to_end_on_a_tiny_model(tiny_served_model_dir: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from tandem_cli.cli import main

    model_dir = tiny_served_model_dir  # servable: the serving overhead is measured on a real server
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    argv = ["plan", "--workload", "mixed", "--quick", "--num-requests", "6", "--rate", "4", "--nodes", "2",
            "--cpus", "0", "--model", str(model_dir), "--dtype", "float32", "--thresholds", "128",
            "--slo", "ttft:5000,tpot:500", "--json", str(tmp_path / "plan.json")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Cost model (fitted now; " in out and "| configuration | TTFT p50 (ms) |" in out
    for name in ("colocated x2", "1P:1D", "1P:1D local<=128"):
        assert f"| {name} |" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert [c["configuration"] for c in plan["candidates"]] == ["colocated x2", "1P:1D", "1P:1D local<=128"]
    assert plan["recommended"] in out and plan["cost_key"]["threads"] == 1
    assert plan["cost_model"]["num_samples"] >= 30
    assert plan["cost_model"]["per_streamed_token_s"] >= 0 and "us per streamed token" in out
    stored = (tmp_path / "home" / "planner" / "cost_models.json")
    assert stored.is_file()
    assert main(argv) == 0  # the second time the stored fit is reused
    assert "Cost model (stored; " in capsys.readouterr().out


def test_plan_is_an_entry_point_of_the_tandem_cli() -> None:
    import tomllib

    from benchmarks.planner import plan
    from tandem_cli.cli import build_parser

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["entry-points"]["tandem.commands"]["plan"] == "benchmarks.planner.plan:add_parser"
    args = build_parser().parse_args(["plan", "--workload", "mixed", "--slo", "ttft:900,tpot:80", "--nodes", "3"])
    assert args.func is plan.cmd_plan and args.slo == SLO(0.9, 0.08) and args.nodes == 3 and args.validate is None
    assert build_parser().parse_args(["plan", "--validate"]).validate == "recommended"


def test_apply_refuses_a_colocated_recommendation_and_needs_an_address() -> None:
    """`tandem plan --apply` scales a Ray deployment (tests/ray run it on a real cluster); a colocated
    recommendation cannot be a Ray deployment's shape, and --apply without --address is refused, before Ray."""
    import argparse

    from benchmarks.planner.plan import add_arguments, apply_on_ray, run

    with pytest.raises(ValueError, match=r"--apply: the recommendation is .*colocated"):
        apply_on_ray(Deployment(0, 2), "127.0.0.1:1", "tandem")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError, match="--apply needs --address"):
        run(parser.parse_args(["--apply"]))

"""The roofline's byte and FLOP counts (worked out by hand on a tiny config), its min(), and a smoke run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.roofline import (
    Bound,
    MachineLimits,
    binding_bound,
    decode_step_cost,
    main,
    measure_machine,
    read_llc_bytes,
    roofline,
)
from common.config.model_config import ModelConfig

# hidden 64, q 4 heads x 16 = 64, kv 2 heads x 16 = 32, intermediate 96, 2 layers, vocab 128.
TINY = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "tie_word_embeddings": False}
# One layer's matrices: q 64x64 + k 64x32 + v 64x32 + o 64x64 + gate/up/down 3 x 64x96
#   = 4096 + 2048 + 2048 + 4096 + 18432 = 30720; norms 2 x 64 = 128.
# Linear weights: 2 x 30720 + LM head 128 x 64 (8192) = 69632.
# Read every step: 69632 + 2 x 128 (layer norms) + 64 (final norm) = 69952 elements.
LINEAR_WEIGHTS = 69632
READ_PER_STEP = 69952


def _config(**overrides: object) -> ModelConfig:
    return ModelConfig.from_dict({**TINY, **overrides}, name="tiny")


def _limits(read_gb_s: float, bf16_gflops: float) -> MachineLimits:
    return MachineLimits(cpu="test", cores=1, threads=1, llc_bytes=None, copy_gb_s=read_gb_s, read_gb_s=read_gb_s,
                         matmul_gflops={"float32": bf16_gflops / 2, "bfloat16": bf16_gflops},
                         decode_gemm_gflops={"float32": 1.0, "bfloat16": 1.0})


def test_step_cost_counts_bytes_and_flops_exactly() -> None:
    cost = decode_step_cost(_config(), "bfloat16", batch=3, context=10)
    assert cost.weight_bytes == (READ_PER_STEP + 3 * 64) * 2  # + one 64-wide embedding row per sequence
    assert cost.kv_bytes_per_token == 2 * 2 * 32 * 2  # layers x (K, V) x kv_size x 2 bytes = 256
    assert cost.kv_bytes == 3 * 10 * 256
    assert cost.bytes_per_step == 140288 + 7680
    # 2 per linear weight + attention 4 x layers x heads x head_dim x context = 139264 + 5120.
    assert cost.flops_per_token == 144384.0
    # Layers 2 x (30720 + 128), final norm 64, embedding 8192, untied LM head 8192.
    assert cost.params == 78144


def test_tied_lm_head_is_one_parameter_but_still_read_every_step() -> None:
    untied = decode_step_cost(_config(), "float32", batch=1, context=1)
    tied = decode_step_cost(_config(tie_word_embeddings=True), "float32", batch=1, context=1)
    assert tied.params == untied.params - 128 * 64
    assert tied.weight_bytes == untied.weight_bytes == (READ_PER_STEP + 64) * 4
    assert tied.flops_per_token == untied.flops_per_token == 2 * LINEAR_WEIGHTS + 4 * 2 * 4 * 16


def test_biases_are_read_but_not_counted_as_matmul_flops() -> None:
    plain = decode_step_cost(_config(), "float32", batch=1, context=1)
    biased = decode_step_cost(_config(attention_bias=True, mlp_bias=True), "float32", batch=1, context=1)
    # Per layer: q, k, v, o biases 64 + 32 + 32 + 64, MLP biases 96 + 96 + 64.
    assert biased.weight_bytes - plain.weight_bytes == 2 * (192 + 256) * 4
    assert biased.flops_per_token == plain.flops_per_token


def test_roofline_takes_the_lower_ceiling() -> None:
    cost = decode_step_cost(_config(), "bfloat16", batch=4, context=8)
    # Memory: 4 tokens per step of `bytes_per_step` bytes at 1 GB/s.
    memory = 4 * 1e9 / cost.bytes_per_step
    slow_memory = _limits(read_gb_s=1.0, bf16_gflops=1e6)
    assert roofline(slow_memory, cost) == pytest.approx(memory)
    assert binding_bound(slow_memory, cost) is Bound.MEMORY
    # Compute: 1 GFLOP/s over the FLOPs of a token, with bandwidth to spare.
    slow_compute = _limits(read_gb_s=1e6, bf16_gflops=1.0)
    assert roofline(slow_compute, cost) == pytest.approx(1e9 / cost.flops_per_token)
    assert binding_bound(slow_compute, cost) is Bound.COMPUTE


def test_a_larger_batch_moves_the_bound_from_memory_to_compute() -> None:
    limits = _limits(read_gb_s=1.0, bf16_gflops=10.0)
    small = decode_step_cost(_config(), "bfloat16", batch=1, context=8)
    large = decode_step_cost(_config(), "bfloat16", batch=64, context=8)
    assert (binding_bound(limits, small), binding_bound(limits, large)) == (Bound.MEMORY, Bound.COMPUTE)


def test_unknown_dtype_names_the_choices() -> None:
    with pytest.raises(ValueError, match="float32, bfloat16"):
        decode_step_cost(_config(), "int4", batch=1, context=1)


def test_llc_size_is_read_from_sysfs_format(tmp_path: Path) -> None:
    (tmp_path / "size").write_text("32768K\n")
    assert read_llc_bytes(tmp_path / "size") == 32 << 20
    assert read_llc_bytes(tmp_path / "missing") is None


def test_quick_measurement_returns_positive_numbers() -> None:
    limits = measure_machine(threads=1, quick=True)
    assert limits.copy_gb_s > 0 and limits.read_gb_s > 0
    assert set(limits.matmul_gflops) == set(limits.decode_gemm_gflops) == {"float32", "bfloat16"}
    assert all(v > 0 for v in (*limits.matmul_gflops.values(), *limits.decode_gemm_gflops.values()))


def test_cli_writes_the_report_schema(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = tmp_path / "tiny"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "roofline.json"
    main(["--model", str(model_dir), "--quick", "--threads", "1", "--batches", "1,4", "--context", "8",
          "--json", str(out)])
    doc = json.loads(out.read_text())
    assert set(doc) == {"machine", "model", "roofline"}
    assert set(doc["machine"]) == {"cpu", "cores", "threads", "llc_bytes", "copy_gb_s", "read_gb_s",
                                   "matmul_gflops", "decode_gemm_gflops", "matmul_size", "notes"}
    assert doc["model"] == {"name": "tiny", "dtype": "bfloat16", "params": 78144,
                            "weight_bytes_per_step": (READ_PER_STEP + 64) * 2, "kv_bytes_per_token": 256,
                            "flops_per_token": 2 * LINEAR_WEIGHTS + 4 * 2 * 4 * 16 * 8}
    assert [(r["batch"], r["context"]) for r in doc["roofline"]] == [(1, 8), (4, 8)]
    assert all(r["tokens_per_s"] > 0 and r["bound"] in ("memory", "compute") for r in doc["roofline"])
    assert "| 4 | 8 |" in capsys.readouterr().out


def test_gemm_size_fits_the_time_target_at_the_probed_rate() -> None:
    from benchmarks.roofline import pick_gemm_size

    # 2 * 2048^3 = 17.2 GFLOP: 0.17 s at 100 GFLOP/s; at 0.3 GFLOP/s (bf16 without native support)
    # only 512^3 (0.27 GFLOP, 0.89 s) is too slow too, so the smallest size is used.
    assert pick_gemm_size(100.0, target_s=0.3) == 2048
    assert pick_gemm_size(10.0, target_s=0.3) == 1024
    assert pick_gemm_size(1.0, target_s=0.3) == 512
    assert pick_gemm_size(0.3, target_s=0.3) == 256


def test_repeats_stop_at_the_time_budget() -> None:
    import time

    from benchmarks.roofline import _best_seconds

    calls: list[float] = []
    _best_seconds(lambda: (calls.append(0.0), time.sleep(0.02)), repeats=1000, budget_s=0.05)
    assert len(calls) < 10  # warm-up + a few repeats, not 1000

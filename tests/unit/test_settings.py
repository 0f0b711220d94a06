from __future__ import annotations

from pathlib import Path

import pytest

from common.config.settings import ModelSettings, load_settings


def test_flags_override_env_override_defaults() -> None:
    env = {"TANDEM_DTYPE": "float32", "TANDEM_HOME": "/tmp/x", "TANDEM_NUM_THREADS": "3"}
    s = load_settings(ModelSettings, {"dtype": "bfloat16", "model": None}, environ=env)
    assert s.dtype == "bfloat16"  # flag wins
    assert s.home == Path("/tmp/x") and s.num_threads == 3  # env coerced to the field's type
    assert s.model == "SmolLM2-135M-Instruct"  # default


def test_bad_env_value_names_the_variable() -> None:
    with pytest.raises(ValueError, match="TANDEM_NUM_THREADS"):
        load_settings(ModelSettings, environ={"TANDEM_NUM_THREADS": "many"})
    with pytest.raises(ValueError, match="dtype"):
        load_settings(ModelSettings, environ={"TANDEM_DTYPE": "int3"})


def test_a_serving_node_s_step_budget_defaults_by_device() -> None:
    from common.config.settings import NodeSettings
    from common.engine.node_setup import engine_configs, step_budget

    assert step_budget(NodeSettings(), "cpu") == (512, 256)
    assert step_budget(NodeSettings(), "cuda:0") == (2048, 512)
    assert step_budget(NodeSettings(max_num_batched_tokens=4096), "cpu") == (4096, 256)  # set: kept
    scheduler = engine_configs(load_settings(NodeSettings, environ={"TANDEM_PREFILL_ORDER": "fcfs"}), "cpu")[1]
    assert (scheduler.max_num_batched_tokens, scheduler.max_prefill_chunk) == (512, 256)
    assert scheduler.prefill_order == "fcfs"
    assert scheduler.backlog_budget == (2048, 512)  # by device: load-aware on CPU
    assert engine_configs(NodeSettings(max_num_batched_tokens=1024), "cpu")[1].backlog_budget is None  # as set
    assert engine_configs(NodeSettings(), "cuda:0")[1].backlog_budget is None
    with pytest.raises(ValueError, match="max_prefill_chunk must be >= 1, or 0"):
        NodeSettings(max_prefill_chunk=-1)
    with pytest.raises(ValueError, match="TANDEM_PREFILL_ORDER"):
        NodeSettings(prefill_order="lifo")


def test_kernel_settings_are_read_in_one_place_and_listed_by_help() -> None:
    import dataclasses

    from common.config.settings import CPU_ISAS, KernelSettings, kernel_settings
    from common.kernels.isa import ISA_FLAGS
    from tandem_cli.cli import build_parser

    assert tuple(ISA_FLAGS) == CPU_ISAS  # the builds the kernel module knows
    settings = kernel_settings({"TANDEM_CPU_GEMV": " OFF ", "TANDEM_CPU_KERNELS": "0", "TANDEM_CPU_ISA": "AVX2"})
    got = (settings.cpu_gemv, settings.cpu_kernels, settings.cpu_isa, settings.fused_ops)
    assert got == ("off", False, "avx2", "auto")
    with pytest.raises(ValueError, match="TANDEM_DECODE_STEP='fast'; choose one of auto, on, off"):
        kernel_settings({"TANDEM_DECODE_STEP": "fast"})
    with pytest.raises(ValueError, match="TANDEM_CPU_ISA='sse9'; choose one of avx512, avx2, generic"):
        kernel_settings({"TANDEM_CPU_ISA": "sse9"})
    with pytest.raises(ValueError, match="TANDEM_CPU_KERNELS='maybe' is not a valid bool"):
        kernel_settings({"TANDEM_CPU_KERNELS": "maybe"})
    help_text = build_parser().format_help()
    for f in dataclasses.fields(KernelSettings):
        assert f"TANDEM_{f.name.upper()}=" in help_text


def test_speculative_settings_are_flags_and_variables_alike() -> None:
    import argparse

    from common.config.engine_config import SpeculativeMethod
    from common.config.settings import SpeculativeSettings, load_settings
    from tandem_cli.cli import build_parser
    from tandem_cli.up_command import settings_args

    env = {"TANDEM_SPECULATIVE": "draft_model", "TANDEM_DRAFT_MODEL": "SmolLM2-135M-Instruct",
           "TANDEM_DRAFT_QUANTIZATION": "int4", "TANDEM_SPECULATIVE_NGRAM_FIRST": "1"}
    config = load_settings(SpeculativeSettings, environ=env).config()
    assert config.method is SpeculativeMethod.DRAFT_MODEL
    assert (config.draft_quantization, config.ngram_first) == ("int4", True)
    with pytest.raises(ValueError, match=r"--speculative \(TANDEM_SPECULATIVE\) 'magic': choose one of none, ngram"):
        load_settings(SpeculativeSettings, environ={"TANDEM_SPECULATIVE": "magic"})
    with pytest.raises(ValueError, match="--speculative draft_model needs --draft-model"):
        load_settings(SpeculativeSettings, environ={"TANDEM_SPECULATIVE": "draft_model"})
    # `tandem up` hands the flags it was given to the decode nodes, generated from the same fields
    args = build_parser().parse_args(["up", "--speculative", "ngram", "--num-speculative-tokens", "6",
                                      "--no-speculative-ngram-first"])
    argv = settings_args(args, SpeculativeSettings)
    assert argv == ("--speculative", "ngram", "--num-speculative-tokens", "6", "--no-speculative-ngram-first")
    node = build_parser().parse_args(["serve", "decode", *argv])
    assert isinstance(node, argparse.Namespace) and (node.speculative, node.num_speculative_tokens) == ("ngram", 6)


def test_a_name_two_roles_read_differently_has_a_role_prefix_for_the_gateway() -> None:
    # `tandem up` gives every process one environment: the nodes' admission queue and the gateway's slot wait
    # must not share a variable.
    from common.config.settings import NodeSettings, env_name
    from gateway.settings import GatewaySettings

    env = {"TANDEM_QUEUE_TIMEOUT_S": "120", "TANDEM_GATEWAY_QUEUE_TIMEOUT_S": "7", "TANDEM_GATEWAY_KV_TIMEOUT_S": "9",
           "TANDEM_MODEL_DIR": "/m", "TANDEM_PREFILL_TARGETS": "127.0.0.1:1", "TANDEM_DECODE_TARGETS": "127.0.0.1:2"}
    node, gateway = load_settings(NodeSettings, environ=env), load_settings(GatewaySettings, environ=env)
    assert (node.queue_timeout_s, node.kv_timeout_s) == (120.0, NodeSettings().kv_timeout_s)
    assert (gateway.queue_timeout_s, gateway.kv_timeout_s) == (7.0, 9.0)
    assert env_name("queue_timeout_s", GatewaySettings) == "TANDEM_GATEWAY_QUEUE_TIMEOUT_S"
    assert env_name("port", GatewaySettings) == "TANDEM_PORT"

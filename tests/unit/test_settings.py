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
    from common.config.engine_config import scheduler_config
    from common.config.settings import NodeSettings
    from common.engine.node_setup import engine_configs

    def budget(node: NodeSettings, device: str) -> tuple[int, int | None, tuple[int, int] | None]:
        scheduler = engine_configs(node, device)[1]
        return scheduler.max_num_batched_tokens, scheduler.max_prefill_chunk, scheduler.backlog_budget

    assert budget(NodeSettings(), "cpu") == (512, 256, (2048, 2048))  # by device: load-aware on CPU
    assert budget(NodeSettings(), "cuda:0") == (2048, 512, None)
    assert budget(NodeSettings(max_num_batched_tokens=4096), "cpu") == (4096, 256, None)  # set: kept, as set
    assert budget(NodeSettings(max_prefill_chunk=16), "cuda:1") == (2048, 16, None)
    # 0 reads as unset, as documented before these fields were optional
    env = {"TANDEM_MAX_NUM_BATCHED_TOKENS": "0", "TANDEM_NUM_BLOCKS": "0", "TANDEM_PREFILL_ORDER": "fcfs"}
    node = load_settings(NodeSettings, environ=env)
    assert (node.max_num_batched_tokens, node.num_blocks) == (None, None)
    cache, scheduler = engine_configs(node, "cpu")
    assert scheduler.prefill_order == "fcfs" and scheduler.backlog_budget == (2048, 2048)
    assert cache.num_blocks is None
    # every entry point resolves the budget in one function: the offline LLM and the planner call it too
    assert engine_configs(NodeSettings(), "cpu")[1] == scheduler_config("cpu")
    # on CPU a prompt that fits the light step is not split by its chunk limit, unless a budget is set
    assert engine_configs(NodeSettings(), "cpu")[1].whole_prefill == 512
    assert engine_configs(NodeSettings(max_prefill_chunk=16), "cpu")[1].whole_prefill is None
    assert engine_configs(NodeSettings(), "cuda:0")[1].whole_prefill is None
    with pytest.raises(ValueError, match="max_prefill_chunk must be >= 1, got -1"):
        NodeSettings(max_prefill_chunk=-1)
    with pytest.raises(ValueError, match=r"--prefill-order \(TANDEM_PREFILL_ORDER\) must be one of shortest, fcfs"):
        NodeSettings(prefill_order="lifo")
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        load_settings(NodeSettings, environ={"TANDEM_BLOCK_SIZE": "12"})


def test_node_settings_are_the_engine_configs_knobs() -> None:
    """The engine's knobs are CacheConfig's and SchedulerConfig's fields: same names, types, defaults (the
    step budget's: by device), help and choices; the flags are generated from them."""
    import dataclasses

    from common.config.engine_config import PREFILL_ORDERS, CacheConfig, SchedulerConfig
    from common.config.settings import EngineSettings, NodeSettings
    from tandem_cli.cli import build_parser

    knobs = {f.name: f for f in dataclasses.fields(EngineSettings)}
    engine = {f.name: f for config in (CacheConfig, SchedulerConfig) for f in dataclasses.fields(config)
              if "help" in f.metadata}
    assert knobs.keys() == engine.keys()
    for name, f in knobs.items():
        source = engine[name]
        assert f.metadata["help"] == source.metadata["help"] and f.metadata["choices"] == source.metadata["choices"]
        if f.metadata["by_device"]:
            assert f.default is None and name in ("max_num_batched_tokens", "max_prefill_chunk")
        else:
            assert (f.type, f.default) == (source.type, source.default)
    assert set(knobs) <= {f.name for f in dataclasses.fields(NodeSettings)}
    assert NodeSettings().kv_cache_memory_gb == CacheConfig().kv_cache_memory_gb
    prefill = build_parser().parse_args(["serve", "prefill", "--prefill-order", "fcfs", "--num-blocks", "64",
                                         "--no-enable-prefix-caching"])
    assert (prefill.prefill_order, prefill.num_blocks, prefill.enable_prefix_caching) == ("fcfs", 64, False)
    with pytest.raises(SystemExit):  # the flag offers PREFILL_ORDERS and nothing else
        build_parser().parse_args(["serve", "prefill", "--prefill-order", "lifo"])
    assert PREFILL_ORDERS == ("shortest", "fcfs")


def test_the_offline_llm_reads_the_engine_knobs_as_a_node_does() -> None:
    from common.config.settings import EngineSettings, NodeSettings

    env = {"TANDEM_KV_CACHE_MEMORY_GB": "0.5", "TANDEM_MAX_NUM_SEQS": "8", "TANDEM_PORT": "not a port"}
    cache, scheduler = load_settings(EngineSettings, environ=env).configs("cpu")
    assert (cache.kv_cache_memory_gb, scheduler.max_num_seqs) == (0.5, 8)  # the node's variables, not its port
    assert (scheduler.max_num_batched_tokens, scheduler.backlog_budget) == (512, (2048, 2048))
    assert EngineSettings().configs("cuda")[0] == NodeSettings().configs("cuda")[0]


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

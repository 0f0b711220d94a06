"""Shared fixtures: tiny random-weight Hugging Face models and the bundled real model."""

from __future__ import annotations

import os
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import pytest

# One torch thread per test process: the CI machine has 2 cores and oversubscribed OpenMP threads
# make small matrix products 10-100x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# A small KV cache for every engine and node the tests start (LLM and nodes read it): the tests' prompts need
# a few MB, and zeroing the defaults' 1-2 GB in each of hundreds of starts cost minutes of CPU.
os.environ.setdefault("TANDEM_KV_CACHE_MEMORY_GB", "0.125")


# Modules whose tests take the longest (pytest --durations on a 2-core machine), run first: under
# pytest-xdist (`make test` runs two workers) a long test that starts last would run on alone at the end.
LONGEST_FIRST = ("tests/benchmarks/test_suite.py", "tests/parallel/test_parallel_engine.py",
                 "tests/deploy/test_wheel.py", "tests/benchmarks/test_bench_parallel.py",
                 "tests/quant/test_bundled_model_quant.py", "tests/kernels/test_kernel_build.py")


# The GPU lease (scripts/gpu-lease.sh) sets TANDEM_TEST_REQUIRE_GPU=1: there a missing GPU piece (no CUDA, FlashInfer
# or Triton not importable) fails the test instead of skipping it, so a broken install on the lent machine does
# not read as a pass. Skips for what the lease does not bring (a second GPU for NCCL, flash-attn) stay skips.
REQUIRE_GPU = os.environ.get("TANDEM_TEST_REQUIRE_GPU") == "1"
MISSING_GPU_PIECE = ("needs CUDA", "needs a CUDA GPU", "could not import 'flashinfer'", "could not import 'triton'",
                     "Triton was imported before")


@pytest.hookimpl(hookwrapper=True)  # the old style: the lent machine's pytest may predate wrapper=True
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    report = (yield).get_result()
    if REQUIRE_GPU and report.skipped and not hasattr(report, "wasxfail"):
        reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
        if any(piece in reason for piece in MISSING_GPU_PIECE):
            report.outcome = "failed"
            report.longrepr = f"TANDEM_TEST_REQUIRE_GPU=1 and a GPU piece is missing: {reason}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::")[0]
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: every module's tests stay together and in order
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


TINY_LLAMA: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


TINY_SIGLIP: dict[str, Any] = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                               "num_attention_heads": 2, "image_size": 28, "patch_size": 14}


def make_tiny_model(directory: Path, model_type: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Save a random-weight transformers model (fp32 safetensors) and return its directory."""
    import torch
    import transformers

    cfg_cls: Any = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "phi3": transformers.Phi3Config,
        "mixtral": transformers.MixtralConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "gpt_oss": transformers.GptOssConfig,
        "gemma2": transformers.Gemma2Config,
        "gemma3_text": transformers.Gemma3TextConfig,
        # Gemma 3's image-and-text model: the overrides are its text_config, beside a tiny SigLIP vision tower
        "gemma3": lambda **text: transformers.Gemma3Config(text_config=text, vision_config=TINY_SIGLIP,
                                                           mm_tokens_per_image=4),
    }[model_type]
    model_cls: Any = {
        "llama": transformers.LlamaForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "phi3": transformers.Phi3ForCausalLM,
        "mixtral": transformers.MixtralForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
        "gpt_oss": transformers.GptOssForCausalLM,
        "gemma2": transformers.Gemma2ForCausalLM,
        "gemma3_text": transformers.Gemma3ForCausalLM,
        "gemma3": transformers.Gemma3ForConditionalGeneration,
    }[model_type]
    kwargs = {**TINY_LLAMA, **overrides}
    torch.manual_seed(seed)
    config = cfg_cls(**kwargs)
    model = model_cls(config).to(torch.float32)
    # Random init leaves norms (Qwen3's q/k norms too) at 1 (Gemma's at 0: it scales by 1 + weight) and biases at
    # 0: perturb them so the test sees them.
    # A MoE router (``...gate.weight``) is scaled up so that each token's top-k experts are chosen by clear
    # margins (near-ties would make the choice hinge on the last bit of a sum).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith((".gate.weight", ".router.weight")):
                p.copy_(torch.randn_like(p))
    model.save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    cache: dict[str, Path] = {}

    def factory(model_type: str = "llama", seed: int = 0, **overrides: Any) -> Path:
        key = repr((model_type, seed, sorted(overrides.items())))
        if key not in cache:
            cache[key] = make_tiny_model(tmp_path_factory.mktemp("tiny"), model_type, seed, **overrides)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The bundled SmolLM2-135M-Instruct, converted once into Tandem's cache (TANDEM_HOME honoured)."""
    from common.config.settings import ModelSettings, load_settings
    from common.model.model_store import prepare_default_model

    settings = load_settings(ModelSettings)
    return prepare_default_model(settings.home, progress=False)


@pytest.fixture(scope="session")
def tiny_served_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A tiny random-weight Llama with SmolLM2's vocabulary and tokenizer: fast, yet servable end to end."""
    import shutil

    directory = tmp_path_factory.mktemp("tiny-served")
    make_tiny_model(directory, "llama", seed=11, vocab_size=49152, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, directory / name)
    return directory

"""The model families through the disaggregated system (issue 36): a random-weight Qwen3 (decoupled head_dim,
q/k norms), a Mistral whose window is shorter than the prompts, a Qwen2 with full and sliding layers, a
Phi-3 (its checkpoint's own fused projections) with a window, the Mixtral and Qwen3-MoE mixtures of experts,
gpt-oss, a Gemma 2 (sandwich norms, both soft-caps, local and global layers), a Gemma 3 (q/k norms, its local
rotary base, linear scaling on the global layers) and Gemma 3's image-and-text checkpoint served as text,
each served by one prefill and one decode node as real processes on 127.0.0.1 (the prompt's KV crosses from
one to the other), greedy fp32 tokens equal to transformers', twice (the second time from both nodes' prefix
caches), and every KV block free afterwards."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e.test_disaggregated import deployment, generate, request, wait_all_blocks_free
from tests.model.test_families import _hf_greedy, _with_tokenizer

pytestmark = pytest.mark.e2e

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("qwen3", {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
                        "tie_word_embeddings": False}),
    "mistral-window": ("mistral", {"sliding_window": 7}),
    "qwen2-mixed-windows": ("qwen2", {"num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": 6,
                                      "max_window_layers": 1}),
    # Phi3Config's token ids default to Phi-3's vocabulary: inside the tiny one here
    "phi3-window": ("phi3", {"sliding_window": 7, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # mixtures of experts: routed experts on every layer, or after a dense first layer
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32}),
    "qwen3moe-dense-first": ("qwen3_moe", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                           "num_hidden_layers": 3, "mlp_only_layers": [0], "head_dim": 16}),
    # gpt-oss: attention sinks, a window on every other layer, YaRN, biased experts
    "gpt-oss": ("gpt_oss", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                            "head_dim": 16, "sliding_window": 7, "max_position_embeddings": 256}),
    "gemma2-window-softcaps": ("gemma2", {"num_hidden_layers": 3, "sliding_window": 6, "head_dim": 16,
                                          "attn_logit_softcapping": 0.01, "final_logit_softcapping": 1.0}),
    "gemma3-pattern2-scaled-rope": ("gemma3_text", {
        "num_hidden_layers": 4, "sliding_window": 6, "sliding_window_pattern": 2, "head_dim": 16,
        "tie_word_embeddings": False,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
    # Gemma 3's image-and-text checkpoint (Gemma3ForConditionalGeneration) served as text
    "gemma3-multimodal-text": ("gemma3", {"num_hidden_layers": 3, "sliding_window": 6, "sliding_window_pattern": 3,
                                          "head_dim": 16}),
}
NEW_TOKENS = 10


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_served_disaggregated_equals_transformers(tiny_model_factory: Callable[..., Path], tmp_path: Path,
                                                         name: str) -> None:
    model_type, overrides = FAMILIES[name]
    model_dir = _with_tokenizer(tiny_model_factory(model_type, seed=21, **overrides))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 128, (int(n),), generator=g).tolist() for n in (9, 17, 30)]
    expected = [_hf_greedy(model_dir, p, NEW_TOKENS) for p in prompts]
    with deployment(model_dir, tmp_path, prefill=1, decode=1) as launcher:
        for _ in range(2):  # the second round reads the prompts' blocks from both prefix caches
            got = [generate(launcher.gateway.target, request(p, NEW_TOKENS))[0] for p in prompts]
            assert got == expected
        wait_all_blocks_free(launcher)

"""Phi-3 (issue 36): q/k/v and gate/up fused in the checkpoint itself, loaded under the model's own names; a
window on every layer when ``sliding_window`` is set. Greedy fp32 output identical to transformers on
random-weight configs saved by transformers, offline and through ``tandem generate``; longrope (the 128k variants)
read with its short factors; a partial rotary is refused naming the field."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from common.config.model_config import ModelConfig
from tests.model.test_families import BASE, _hf_greedy, _with_tokenizer, generate_cli

TOKENS = 12
PHI3: dict[str, dict[str, Any]] = {
    "gqa2-untied": {"num_attention_heads": 4, "num_key_value_heads": 2},
    "mha-tied": {"num_attention_heads": 4, "num_key_value_heads": 4, "tie_word_embeddings": True},
    "window-5": {"num_attention_heads": 4, "num_key_value_heads": 1, "sliding_window": 5, "num_hidden_layers": 3},
}


def _phi3(factory: Callable[..., Path], name: str) -> Path:
    # Phi3Config's token ids default to Phi-3's own vocabulary (pad and eos 32000): inside the tiny one here.
    return _with_tokenizer(factory("phi3", seed=13, pad_token_id=0, bos_token_id=1, eos_token_id=2, **PHI3[name]))


@pytest.mark.parametrize("fused", ["on", "off"])
@pytest.mark.parametrize("name", sorted(PHI3))
def test_phi3_offline_greedy_identical_to_transformers(tiny_model_factory: Callable[..., Path], name: str, fused: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from common.engine.llm import LLM
    from common.sampling.params import SamplingParams

    monkeypatch.setenv("TANDEM_FUSED_OPS", fused)
    model_dir = _phi3(tiny_model_factory, name)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (4, 11, 19)]
    with LLM(model_dir, dtype="float32", device="cpu") as llm:
        done = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))
    for prompt, completion in zip(prompts, done, strict=True):
        assert completion.token_ids == _hf_greedy(model_dir, prompt, TOKENS), name


def test_phi3_through_tandem_generate(tiny_model_factory: Callable[..., Path],
                                      capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = _phi3(tiny_model_factory, "window-5")
    prompt = "t17 t3 t99 t42 t8 t120 t64 t5 t77 t31"
    stdout, _, expected = generate_cli(model_dir, prompt, TOKENS, capsys)
    assert stdout == prompt + expected + "\n"


def test_phi3_config_reads_and_refusals() -> None:
    phi3 = ModelConfig.from_dict({**BASE, "model_type": "phi3", "sliding_window": 7})
    assert (phi3.qkv_bias, phi3.o_bias, phi3.mlp_bias, phi3.qk_norm) == (False, False, False, False)
    assert phi3.rms_norm_eps == 1e-5 and phi3.layer_windows == (7,) * 4
    with pytest.raises(ValueError, match=r"partial_rotary_factor 0\.75 is not supported"):
        ModelConfig.from_dict({**BASE, "model_type": "phi3",
                               "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                   "partial_rotary_factor": 0.75}})
    # the 128k variants' longrope: the short factors, served up to original_max_position_embeddings (the top level's
    # winning, as Phi3Config reads it; tests/model/test_heldout_families.py runs it against transformers)
    longrope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0, 2.0], "long_factor": [3.0, 4.0]}
    phi3_128k = ModelConfig.from_dict({**BASE, "model_type": "phi3", "max_position_embeddings": 1024,
                                       "original_max_position_embeddings": 256, "rope_parameters": longrope})
    assert phi3_128k.rope_scaling.rope_type == "longrope" and phi3_128k.max_position_embeddings == 256
    assert phi3_128k.rope_scaling.short_factor == (1.0, 2.0) and phi3_128k.rope_scaling.factor == 4.0
    su = ModelConfig.from_dict({**BASE, "model_type": "phi3", "rope_scaling": {**longrope, "rope_type": "su"}})
    assert su.rope_scaling.rope_type == "longrope"
    with pytest.raises(ValueError, match=r"rope_scaling.short_factor has 1 entries; longrope needs head_dim / 2 = 2"):
        ModelConfig.from_dict({**BASE, "model_type": "phi3", "rope_parameters": {**longrope, "short_factor": [1.0]}})
    with pytest.raises(ValueError, match=r"rope_scaling.rope_type 'longrope' needs rope_scaling.short_factor"):
        ModelConfig.from_dict({**BASE, "model_type": "phi3", "rope_parameters": {"rope_type": "longrope",
                                                                                 "rope_theta": 1e4}})
    with pytest.raises(ValueError, match=r"rope_scaling.rope_type 'linear' is not supported \(phi3\)"):
        ModelConfig.from_dict({**BASE, "model_type": "phi3", "rope_scaling": {"rope_type": "linear", "factor": 2.0}})

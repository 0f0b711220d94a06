"""The bundled SmolLM2-135M-Instruct: our runtime against transformers on the converted directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.engine.simple_generator import SimpleGenerator
from common.model.loader import load_model
from common.sampling.params import SamplingParams
from common.tokenizer import Tokenizer

pytestmark = pytest.mark.real_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]


@pytest.fixture(scope="module")
def fp32_model(smollm2_dir: Path) -> torch.nn.Module:
    return load_model(smollm2_dir, dtype="float32")


def test_greedy_tokens_match_transformers(smollm2_dir: Path, fp32_model: torch.nn.Module) -> None:
    import transformers

    tokenizer = Tokenizer(smollm2_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # like ignore_eos: EOS is a token like any other
    generator = SimpleGenerator(fp32_model)  # type: ignore[arg-type]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        ours = list(generator.stream(ids, params))
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, pad_token_id=2)
        assert ours == out[0, len(ids):].tolist(), prompt


def test_capital_of_france_is_paris(smollm2_dir: Path, fp32_model: torch.nn.Module) -> None:
    tokenizer = Tokenizer(smollm2_dir)
    ids = tokenizer.encode("The capital of France is")
    out = list(SimpleGenerator(fp32_model).stream(ids, SamplingParams(temperature=0.0, max_tokens=4)))  # type: ignore[arg-type]
    assert "Paris" in tokenizer.decode(out)


def test_chat_template_matches_transformers(smollm2_dir: Path) -> None:
    import transformers

    ours = Tokenizer(smollm2_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    with_system = [{"role": "system", "content": "Be terse."}, *messages,
                   {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]
    assert ours.encode_chat(with_system) == theirs.apply_chat_template(
        with_system, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ours.eos_token_ids == (2,)

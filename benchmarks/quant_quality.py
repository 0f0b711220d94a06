"""How much quantization changes a model: perplexity on a fixed text, greedy agreement with the float weights.

- ``perplexity(model, token_ids)``: one causal forward over the whole text (no KV cache), exp of the mean
  next-token negative log-likelihood, logits in fp32.
- ``greedy_tokens(engine, prompts, n)``: the first ``n`` greedy tokens of each prompt (EOS ignored).
- ``agreement(reference, other)``: the share of positions where the tokens are equal, and the mean length of
  the identical prefix (after the first difference the contexts differ, so later matches mean less).

The text is ``tests/quant/data/perplexity.txt`` (written for these measurements; shipped with the tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from common.attention.metadata import AttentionMetadata
from common.sampling.params import SamplingParams

if TYPE_CHECKING:
    from common.engine.engine_core import ColocatedEngine
    from common.model.llama import LlamaForCausalLM

TEXT_PATH = Path(__file__).resolve().parent.parent / "tests" / "quant" / "data" / "perplexity.txt"
PROMPTS = (
    "The capital of France is",
    "Water boils at a temperature of",
    "The three primary colors are",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The largest planet in the solar system is",
    "To make a cup of tea, first",
    "Photosynthesis is the process by which",
    "The quick brown fox",
    "In 1969, the first humans",
)


@dataclass(frozen=True)
class Agreement:
    token_match: float  # share of the n positions with the same token
    prefix_tokens: float  # mean length of the identical prefix


def perplexity(model: LlamaForCausalLM, token_ids: list[int]) -> float:
    n = len(token_ids)
    device = model.norm.weight.device
    ids = torch.tensor(token_ids, device=device)
    meta = AttentionMetadata.build([n], [0])
    with torch.no_grad():
        logits = model.compute_logits(model(ids, torch.arange(n, device=device), meta))
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), ids[1:], reduction="mean")
    return float(torch.exp(nll))


def greedy_tokens(engine: ColocatedEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    """All prompts batched together, greedy, exactly ``n`` new tokens each."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"agree-{i}", prompt, params)
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id.removeprefix("agree-")].extend(o.new_token_ids)
    return [out[str(i)] for i in range(len(prompts))]


def agreement(reference: list[list[int]], other: list[list[int]]) -> Agreement:
    matches = total = 0
    prefixes = []
    for ref, got in zip(reference, other, strict=True):
        matches += sum(a == b for a, b in zip(ref, got, strict=False))
        total += len(ref)
        prefix = next((i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), min(len(ref), len(got)))
        prefixes.append(prefix)
    return Agreement(matches / max(total, 1), sum(prefixes) / max(len(prefixes), 1))

"""How much quantization changes a model: perplexity on a fixed text, greedy agreement with the float weights.

- ``perplexity(model, token_ids)``: one causal forward over the whole text (no KV cache), exp of the mean
  next-token negative log-likelihood, logits in fp32. That is the prefill path (batched GEMMs).
- ``decode_perplexity(model, token_ids)``: the same text teacher-forced one token per step through a paged
  KV cache: the decode path (GEMV kernels, int8-rounded activations with the ``tandem_a8`` kernels, paged
  decode attention), which is what a served stream's tokens go through.
- ``greedy_tokens(engine, prompts, n)``: the first ``n`` greedy tokens of each prompt (EOS ignored), the
  prompts in batches of 5 so the decode steps take the GEMV path (at most ``GEMV_MAX_ROWS`` rows).
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


def decode_perplexity(model: LlamaForCausalLM, token_ids: list[int], block_size: int = 16) -> float:
    from common.kv.kv_cache import KVCache, KVCacheSpec

    cfg = model.config
    n = len(token_ids)
    device = model.norm.weight.device
    num_blocks = -(-n // block_size)
    cache = KVCache(KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size,
                                str(model.dtype).removeprefix("torch.")), num_blocks, device)
    table = [list(range(num_blocks))]
    nll = 0.0
    with torch.no_grad():
        for pos in range(n - 1):
            meta = AttentionMetadata.build([1], [pos], table, block_size, device)
            ids = torch.tensor(token_ids[pos : pos + 1], device=device)
            logits = model.compute_logits(model(ids, torch.tensor([pos], device=device), meta, cache))
            nll += float(torch.nn.functional.cross_entropy(logits.float(), torch.tensor(token_ids[pos + 1 : pos + 2])))
    return float(torch.exp(torch.tensor(nll / (n - 1))))


def greedy_tokens(engine: ColocatedEngine, prompts: list[list[int]], n: int, batch: int = 5) -> list[list[int]]:
    """Greedy, exactly ``n`` new tokens each, ``batch`` prompts at a time."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for first in range(0, len(prompts), batch):
        for i in range(first, min(first + batch, len(prompts))):
            engine.add_request(f"agree-{i}", prompts[i], params)
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

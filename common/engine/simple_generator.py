"""One request at a time over the paged KV cache: the plainest correct generation loop.

It is the reference the batched engines are tested against and what ``tandem generate`` used before
the engines existed. Blocks are handed out sequentially (one request owns the whole cache).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from common.attention.metadata import AttentionMetadata
from common.kv.kv_cache import KVCache, KVCacheSpec
from common.sampling.sampler import RequestSamplingState, Sampler

if TYPE_CHECKING:
    from common.model.llama import LlamaForCausalLM
    from common.sampling.params import SamplingParams


class SimpleGenerator:
    """Greedy or sampled generation for a single sequence, streaming token ids."""

    def __init__(self, model: LlamaForCausalLM, block_size: int = 16, max_model_len: int | None = None) -> None:
        self.model = model
        cfg = model.config
        self.block_size = block_size
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        num_blocks = -(-self.max_model_len // block_size)
        dtype = model.dtype
        spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size,
                           str(dtype).removeprefix("torch."))
        self.device = next(model.parameters()).device
        self.kv_cache = KVCache(spec, num_blocks, self.device)
        self.sampler = Sampler()

    @torch.inference_mode()
    def stream(self, prompt_ids: list[int], params: SamplingParams,
               eos_token_ids: tuple[int, ...] = ()) -> Iterator[int]:
        """Yield generated token ids until EOS, a stop id or ``max_tokens``."""
        if not prompt_ids:
            raise ValueError("prompt_ids: must not be empty")
        budget = self.max_model_len - len(prompt_ids)
        if budget < 1:
            raise ValueError(f"prompt_ids: {len(prompt_ids)} tokens leave no room in max_model_len="
                             f"{self.max_model_len}")
        state = RequestSamplingState.create(params, prompt_ids, eos_token_ids, self.device)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        table = list(range(self.kv_cache.num_blocks))
        new_ids, context = list(prompt_ids), 0
        for _ in range(min(params.max_tokens, budget)):
            n = len(new_ids)
            used = -(-(context + n) // self.block_size)
            meta = AttentionMetadata.build([n], [context], [table[:used]], self.block_size, self.device)
            input_ids = torch.tensor(new_ids, device=self.device)
            positions = torch.arange(context, context + n, device=self.device)
            hidden = self.model(input_ids, positions, meta, self.kv_cache)
            token = self.sampler(self.model.compute_logits(hidden[-1:]), [state]).token_ids[0]
            state.output_token_ids.append(token)
            yield token
            if token in stop_ids and len(state.output_token_ids) >= params.min_tokens:
                return
            context += n
            new_ids = [token]

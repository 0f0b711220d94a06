"""Turns a scheduled step into one forward pass and samples: the only engine code that touches torch.

Inputs are flat: the chunks' tokens laid end to end with their positions, one ``AttentionMetadata``
describing the ragged batch, and logits computed only for the rows that sample (the last token of each
chunk that reaches its request's end) — the LM head is the largest matmul of a small model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from common.attention.metadata import AttentionMetadata
from common.kv.kv_cache import KVCache, KVCacheSpec
from common.sampling.sampler import RequestSamplingState, Sampler, SampleResult

if TYPE_CHECKING:
    from common.engine.request import Request
    from common.engine.scheduler import SchedulerOutput
    from common.model.llama import LlamaForCausalLM


def kv_cache_spec(model: LlamaForCausalLM, block_size: int) -> KVCacheSpec:
    cfg = model.config
    dtype = next(model.parameters()).dtype
    return KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size,
                       str(dtype).removeprefix("torch."))


class ModelRunner:
    """Owns the model, its paged KV tensors and the sampler."""

    def __init__(self, model: LlamaForCausalLM, block_size: int, num_blocks: int) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.block_size = block_size
        self.kv_cache = KVCache(kv_cache_spec(model, block_size), num_blocks, self.device)
        self.sampler = Sampler()
        self._sampling: dict[str, RequestSamplingState] = {}

    def forget(self, request_id: str) -> None:
        """Drop per-request sampling state (seeded generator) of a request that ended."""
        self._sampling.pop(request_id, None)

    def _sampling_state(self, request: Request) -> RequestSamplingState:
        state = self._sampling.get(request.request_id)
        if state is None:
            generator = None
            if request.params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(request.params.seed)
            # The lists are shared with the request, so penalties always see the current output.
            state = RequestSamplingState(request.params, request.prompt_token_ids, request.eos_token_ids,
                                         request.output_token_ids, generator)
            self._sampling[request.request_id] = state
        return state

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput,
                layer_hook: Callable[[int], None] | None = None) -> SampleResult | None:
        """Run the step's forward; return samples for the chunks that reach their request's end."""
        if output.block_copies:
            self.kv_cache.copy_blocks(output.block_copies)
        hidden, meta = self.forward(output, layer_hook)
        sample_rows = [end - 1 for end, chunk in zip(meta.query_start_loc.tolist()[1:], output.chunks, strict=True)
                       if chunk.samples]
        if not sample_rows:
            return None
        logits = self.model.compute_logits(hidden[sample_rows])
        states = [self._sampling_state(c.request) for c in output.chunks if c.samples]
        return self.sampler(logits, states)

    def forward(self, output: SchedulerOutput,
                layer_hook: Callable[[int], None] | None = None) -> tuple[torch.Tensor, AttentionMetadata]:
        """The forward alone: hidden states ``[num_tokens, hidden]`` and the batch metadata."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        bs = self.block_size
        for chunk in output.chunks:
            end = chunk.start + chunk.num_tokens
            input_ids.extend(chunk.request.token_slice(chunk.start, end))
            positions.extend(range(chunk.start, end))
            query_lens.append(chunk.num_tokens)
            context_lens.append(chunk.start)
            tables.append(chunk.block_ids[: -(-end // bs)])
        meta = AttentionMetadata.build(query_lens, context_lens, tables, bs, self.device)
        hidden = self.model(
            torch.tensor(input_ids, device=self.device),
            torch.tensor(positions, device=self.device),
            meta,
            self.kv_cache,
            layer_hook,
        )
        return hidden, meta

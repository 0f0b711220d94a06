"""The engine loop shared by every role, and the colocated engine built on it.

``EngineCore.step`` is schedule -> run the model and sample -> post-process. The colocated engine (prefill
and decode in one process, the offline API's engine and the benchmarks' baseline) is the core as is; the
prefill and decode services subclass it with their KV-transfer hooks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.config.engine_config import CacheConfig, SchedulerConfig
from common.engine.model_runner import ModelRunner, kv_cache_spec
from common.engine.request import Request, RequestOutput
from common.engine.scheduler import Scheduler
from common.errors import InvalidRequestError
from common.kv.kv_cache_manager import KVCacheManager

if TYPE_CHECKING:
    from common.model.llama import LlamaForCausalLM
    from common.sampling.params import SamplingParams


class EngineCore:
    """Continuous batching with chunked prefill mixed into decode steps, over one paged KV cache."""

    def __init__(self, model: LlamaForCausalLM, cache: CacheConfig | None = None,
                 scheduler: SchedulerConfig | None = None, prefill_only: bool = False) -> None:
        cache = cache or CacheConfig()
        scheduler = scheduler or SchedulerConfig()
        spec = kv_cache_spec(model, cache.block_size)
        element_size = next(model.parameters()).element_size()
        num_blocks = cache.resolve_num_blocks(spec.bytes_per_block(element_size))
        self.model_config = model.config
        self.max_model_len = scheduler.max_model_len or model.config.max_position_embeddings
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.scheduler = Scheduler(scheduler, self.kv, self.max_model_len, prefill_only=prefill_only)
        self.runner = ModelRunner(model, cache.block_size, num_blocks)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Caller mistakes become InvalidRequestError naming the field and the limit."""
        if not prompt_token_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError("prompt", f"{len(prompt_token_ids)} tokens; the limit is "
                                      f"max_model_len - 1 = {self.max_model_len - 1}")
        vocab = self.model_config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise InvalidRequestError("prompt_token_ids", f"ids must be in [0, {vocab})")
        params.check_vocab(vocab)
        if self.kv.blocks_needed(len(prompt_token_ids) + 1) > self.kv.pool.num_blocks:
            raise InvalidRequestError("prompt", f"{len(prompt_token_ids)} tokens exceed the KV cache "
                                      f"({self.kv.pool.num_blocks} blocks of {self.kv.block_size})")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    eos_token_ids: tuple[int, ...] = ()) -> None:
        self.validate(prompt_token_ids, params)
        self.scheduler.add_request(Request(request_id, list(prompt_token_ids), params, tuple(eos_token_ids)))

    def abort(self, request_id: str) -> bool:
        self.runner.forget(request_id)
        return self.scheduler.abort(request_id) is not None

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule -> run the model and sample -> append tokens and stop."""
        scheduled = self.scheduler.schedule()
        sampled = self.runner.execute(scheduled) if not scheduled.is_empty else None
        outputs = self.scheduler.update(scheduled, sampled)
        for out in outputs:
            if out.finished:
                self.runner.forget(out.request_id)
        return outputs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()


class ColocatedEngine(EngineCore):
    """Prefill and decode in one process (Sarathi-Serve style mixed batches)."""

"""The offline Python API: ``LLM(...).generate(prompts, params)`` and ``LLM(...).stream(...)``.

    from common.engine.llm import LLM
    from common.sampling.params import SamplingParams

    llm = LLM()  # the bundled SmolLM2-135M-Instruct
    for c in llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8)):
        print(c.text)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from common.config.engine_config import CacheConfig, SchedulerConfig, SpeculativeConfig
from common.config.settings import EngineSettings, ModelSettings, load_settings
from common.detokenizer import IncrementalDetokenizer
from common.engine.engine_core import ColocatedEngine
from common.engine.node_setup import load_draft_model
from common.engine.request import FinishReason
from common.model.loader import load_model
from common.model.model_store import resolve_model
from common.sampling.params import SamplingParams
from common.tokenizer import Tokenizer

Prompt = str | list[int]


@dataclass(frozen=True)
class StreamDelta:
    """New output of one prompt (``index`` into the prompts given)."""

    index: int
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None


@dataclass(frozen=True)
class Completion:
    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None


class LLM:
    """A colocated engine with a tokenizer in front of it."""

    def __init__(self, model: str | Path | None = None, *, dtype: str | None = None,
                 device: str | None = None, attention_backend: str | None = None,
                 quantization: str | None = None, quantization_group_size: int | None = None,
                 quantization_kernel: str | None = None, cache: CacheConfig | None = None,
                 scheduler: SchedulerConfig | None = None, speculative: SpeculativeConfig | None = None,
                 tensor_parallel_size: int | None = None, pipeline_parallel_size: int | None = None,
                 expert_parallel: bool | None = None, parallel_collective: str | None = None) -> None:
        """``tensor_parallel_size`` / ``pipeline_parallel_size``: run the model in T x P rank processes
        (common/parallel/); ``close()`` (or the end of a ``with`` block) stops them. Without ``cache`` or
        ``scheduler``, the engine's knobs are a node's: their ``TANDEM_*`` variables where set, else their
        defaults, the step budget by device (``EngineSettings``)."""
        self.settings = load_settings(ModelSettings, {
            "model": None if model is None else str(model), "dtype": dtype, "device": device,
            "attention_backend": attention_backend, "quantization": quantization,
            "quantization_group_size": quantization_group_size, "quantization_kernel": quantization_kernel,
            "tensor_parallel_size": tensor_parallel_size, "pipeline_parallel_size": pipeline_parallel_size,
            "expert_parallel": expert_parallel, "parallel_collective": parallel_collective})
        if cache is None or scheduler is None:  # as a node reads them
            knobs = load_settings(EngineSettings).configs(self.settings.device)
            cache, scheduler = cache or knobs[0], scheduler or knobs[1]
        model_dir = resolve_model(self.settings.model, self.settings.home, progress=True)
        self.tokenizer = Tokenizer(model_dir)
        s = self.settings
        parallel = None
        if s.parallel:
            from common.engine.node_setup import parallel_launch
            from common.model.loader import load_skeleton

            self.model = load_skeleton(model_dir, s.dtype)
            parallel = parallel_launch(s, model_dir, self.model.dtype)
        else:
            self.model = load_model(model_dir, s.dtype, s.device, s.attention_backend, s.quantization,
                                    s.quantization_group_size, s.quantization_kernel)
        self.engine = ColocatedEngine(self.model, cache, scheduler, speculative,
                                      draft_model=load_draft_model(speculative, s, model_dir), parallel=parallel)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's rank processes, if any (idempotent)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if chat:
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def stream(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
               chat: bool = False) -> Iterator[StreamDelta]:
        """Yield text as it is generated, for all prompts batched together."""
        params_list = _broadcast(params, len(prompts))
        prompt_ids = [self.encode(p, chat) for p in prompts]
        ids = {f"offline-{next(self._ids)}": i for i in range(len(prompts))}
        detoks = {rid: IncrementalDetokenizer(self.tokenizer, prompt_ids[i]) for rid, i in ids.items()}
        eos = self.tokenizer.eos_token_ids or self.model.config.eos_token_ids
        for rid, i in ids.items():
            self.engine.add_request(rid, prompt_ids[i], params_list[i], eos)
        pending = set(ids)
        try:
            while pending:
                for out in self.engine.step():
                    if out.request_id not in ids:
                        continue
                    if out.finished:
                        pending.discard(out.request_id)
                    text = detoks[out.request_id].add(out.new_token_ids)
                    yield StreamDelta(ids[out.request_id], out.new_token_ids, text, out.finished,
                                      out.finish_reason)
        finally:
            for rid in pending:  # the caller stopped iterating: free what is left
                self.engine.abort(rid)

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 chat: bool = False) -> list[Completion]:
        prompt_ids = [self.encode(p, chat) for p in prompts]
        tokens: list[list[int]] = [[] for _ in prompts]
        reasons: list[FinishReason | None] = [None] * len(prompts)
        for delta in self.stream(prompt_ids, params):
            tokens[delta.index].extend(delta.token_ids)
            if delta.finished:
                reasons[delta.index] = delta.finish_reason
        return [Completion(i, prompt_ids[i], tokens[i], self.tokenizer.decode(tokens[i]), reasons[i])
                for i in range(len(prompts))]


def _broadcast(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"params: got {len(params)} for {n} prompts")
    return list(params)

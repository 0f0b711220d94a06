"""Turns a scheduled step into one forward pass and samples: the only engine code that touches torch.

Inputs are flat: the chunks' tokens laid end to end with their positions, one ``AttentionMetadata``
describing the ragged batch, and logits computed only for the rows that sample (the last token of each
chunk that reaches its request's end) — the LM head is the largest matmul of a small model.

With speculative decoding, a decoding chunk with draft slots gets proposals from the runner's ``Proposer``
(``common/spec_decode/proposer.py``: n-gram lookup, the model's own first layers, a draft model), the drafts
ride along in the same forward, and the target's logits at every draft position are verified exactly
(``common.spec_decode.rejection``); the proposer then hears how many the target kept.

On CUDA, pure decode steps replay CUDA graphs captured per batch-size bucket over static buffers
(``common/engine/cuda_graphs.py``); every other step, and every step on other devices, runs eager.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from common.attention.metadata import AttentionMetadata
from common.config.engine_config import SpeculativeConfig
from common.engine.cuda_graphs import DecodeGraphs, DecodeGraphSpec, capture_refusal
from common.engine.flat_batch import FlatBatch
from common.engine.scheduler_output import StepResult
from common.kv.kv_cache import KVCache, KVCacheSpec
from common.sampling.sampler import RequestSamplingState, Sampler
from common.spec_decode.draft_cost import DraftCostMeter
from common.spec_decode.proposer import DraftModel, LookupFirst, make_proposer
from common.spec_decode.rejection import verify

if TYPE_CHECKING:
    from common.engine.request import Request
    from common.engine.scheduler_output import ScheduledChunk, SchedulerOutput
    from common.model.llama import LlamaForCausalLM
    from common.spec_decode.draft_model import DraftModelProposer

log = logging.getLogger(__name__)


def kv_cache_spec(model: LlamaForCausalLM, block_size: int) -> KVCacheSpec:
    cfg = model.config
    dtype = model.dtype
    return KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size,
                       str(dtype).removeprefix("torch."))


class ModelRunner:
    """Owns the model, its paged KV tensors and the sampler."""

    def __init__(self, model: LlamaForCausalLM, block_size: int, num_blocks: int,
                 speculative: SpeculativeConfig | None = None, draft_model: LlamaForCausalLM | None = None,
                 kv_cache: KVCache | None = None, decode_graphs: DecodeGraphSpec | None = None) -> None:
        """``kv_cache``: one allocated elsewhere (a parallel node's shared one; ``model`` is then a skeleton).
        ``decode_graphs``: run pure decode steps through static buffers, as CUDA graphs on CUDA
        (common/engine/cuda_graphs.py); the engine asks for it on CUDA unless --enforce-eager."""
        self.model = model
        # With decode graphs the cache holds one block more than the scheduler hands out: the padding rows' block.
        own_blocks = num_blocks + 1 if decode_graphs is not None and kv_cache is None else num_blocks
        self.kv_cache = kv_cache or KVCache(kv_cache_spec(model, block_size), own_blocks,
                                            next(model.parameters()).device)
        self.device = self.kv_cache.data.device
        self.decode_graphs: DecodeGraphs | None = None
        if decode_graphs is not None:
            self.decode_graphs = self._decode_graphs(decode_graphs, kv_cache is None, num_blocks, block_size)
        self.block_size = block_size
        self.sampler = Sampler()
        self.speculative = speculative or SpeculativeConfig()
        # n-gram lookup, the early layers, a draft model, or the lookup first (common/spec_decode/proposer.py)
        self.proposer = make_proposer(self.speculative, model, self.kv_cache, block_size, num_blocks, draft_model)
        self._sampling: dict[str, RequestSamplingState] = {}
        self.draft_seconds = 0.0  # time spent proposing (speculative decoding)
        self.forward_seconds = 0.0  # time in the target's forward + sampling / verification
        self.num_steps = 0
        self.draft_cost = DraftCostMeter()  # a draft's cost here, for adaptive k (batch-1 decode steps)

    def _decode_graphs(self, spec: DecodeGraphSpec, own_cache: bool, num_blocks: int,
                       block_size: int) -> DecodeGraphs | None:
        """The decode graphs, or None (logged once) where this model or cache cannot have them."""
        refusal = None if own_cache else "the KV cache is shared with other ranks (no padding block)"
        if self.device.type == "cuda":
            refusal = refusal or capture_refusal(self.model)
        if refusal is not None:
            log.warning("CUDA graphs for decode are off: %s; decode steps run eager", refusal)
            return None
        return DecodeGraphs(self.model, self.kv_cache, block_size, spec, pad_block=num_blocks,
                            capture=self.device.type == "cuda")

    @property
    def draft(self) -> DraftModelProposer | None:
        """The separate draft model's proposer, when speculation runs one."""
        return self.proposer.draft if isinstance(self.proposer, DraftModel) else None

    @property
    def ngram_proposals(self) -> int:
        """Draft model with the lookup first: requests the n-gram lookup drafted for."""
        return self.proposer.num_lookups if isinstance(self.proposer, LookupFirst) else 0

    def close(self) -> None:
        """Nothing to stop in one process (a parallel runner stops its ranks)."""

    def forget(self, request_id: str) -> None:
        """Drop per-request sampling state of a request that ended."""
        if self.proposer is not None:
            self.proposer.forget(request_id)
        self._sampling.pop(request_id, None)

    def _sampling_state(self, request: Request) -> RequestSamplingState:
        state = self._sampling.get(request.request_id)
        if state is None:
            # The lists are shared with the request, so penalties (and a seeded request's position) always see
            # the current output.
            state = RequestSamplingState(request.params, request.prompt_token_ids, request.eos_token_ids,
                                         request.output_token_ids)
            self._sampling[request.request_id] = state
        return state

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> StepResult | None:
        """Run the step's forward; return tokens for the chunks that reach their request's end."""
        self.num_steps += 1
        self._begin_step(output)
        step_start = start = time.perf_counter()
        drafts, draft_probs = self._propose(output.chunks)
        self.draft_seconds += time.perf_counter() - start
        start = time.perf_counter()
        hidden, meta = self.forward(output, drafts)
        threads = self.model.layer_threads
        if threads is not None and any(c.samples for c in output.chunks):
            threads.handing_over()  # a prompt computed: its KV is about to make the decode node busy
        ends = meta.query_start_loc.tolist()[1:]
        result = self._sample(output.chunks, drafts, draft_probs, ends,
                              lambda rows: self.model.compute_logits(hidden[rows]))
        end = time.perf_counter()
        self.forward_seconds += end - start
        return self._priced(output.chunks, drafts, result, end - step_start)

    def _begin_step(self, output: SchedulerOutput) -> None:
        """The step's block copies (in the KV cache and a proposer's own) and the preempted requests' drafts."""
        proposer = self.proposer
        if output.block_copies:
            self.kv_cache.copy_blocks(output.block_copies)
            if proposer is not None:
                proposer.copy_blocks(output.block_copies)
        if proposer is not None:
            for request_id in output.preempted:  # its blocks, and a draft's KV in them, are gone
                proposer.forget(request_id)

    def _sample(self, chunks: list[ScheduledChunk], drafts: list[list[int]],
                draft_probs: list[torch.Tensor | None], ends: list[int],
                logits_of: Callable[[list[int]], torch.Tensor]) -> StepResult | None:
        """Sample the chunks that reach their request's end, verifying drafts where they rode along.

        ``ends[i]``: the end of chunk i's rows in the step's flat batch (drafts included); ``logits_of(rows)``:
        the target's fp32 logits ``[len(rows), vocab]`` at those rows, which are always among
        ``sample_rows(chunks, drafts, ends)``. Tells the proposer how many drafts the target kept."""
        sampling = [i for i, c in enumerate(chunks) if c.samples]
        if not sampling:
            return None
        if not any(drafts[i] for i in sampling):
            logits = logits_of([ends[i] - 1 for i in sampling])
            return StepResult.from_samples(
                self.sampler(logits, [self._sampling_state(chunks[i].request) for i in sampling]))
        result = self._verify(chunks, sampling, drafts, draft_probs, logits_of, ends)
        assert self.proposer is not None  # drafts came from it
        for row, i in enumerate(sampling):
            if drafts[i]:
                self.proposer.accept(chunks[i].request.request_id, result.num_accepted[row])
        return result

    def _priced(self, chunks: list[ScheduledChunk], drafts: list[list[int]], result: StepResult | None,
                seconds: float) -> StepResult | None:
        """A batch-1 decode step times a draft's cost (proposing + verifying); the result carries the estimate."""
        if result is None or not self.speculative.enabled or len(chunks) != 1 or chunks[0].num_tokens != 1:
            return result
        self.draft_cost.record(seconds, len(drafts[0]))
        return replace(result, draft_cost=self.draft_cost.cost)

    def _verify(self, chunks: list[ScheduledChunk], sampling: list[int], drafts: list[list[int]],
                draft_probs: list[torch.Tensor | None], logits_of: Callable[[list[int]], torch.Tensor],
                ends: list[int]) -> StepResult:
        """Plain sampling for chunks without drafts, exact verification for the others, in chunk order."""
        plain = [i for i in sampling if not drafts[i]]
        spec = [i for i in sampling if drafts[i]]
        tokens: dict[int, list[int]] = {}
        logprobs: dict[int, list[tuple[float, list[tuple[int, float]]]] | None] = {}
        accepted: dict[int, int] = {}
        if plain:
            logits = logits_of([ends[i] - 1 for i in plain])
            sampled = StepResult.from_samples(
                self.sampler(logits, [self._sampling_state(chunks[i].request) for i in plain]))
            for j, i in enumerate(plain):
                tokens[i], logprobs[i], accepted[i] = sampled.token_ids[j], sampled.logprobs[j], 0
        # request i scores its last k_i + 1 positions: the token before the drafts and each draft
        rows = [r for i in spec for r in range(ends[i] - len(drafts[i]) - 1, ends[i])]
        result = verify(logits_of(rows), [drafts[i] for i in spec],
                        [draft_probs[i] for i in spec], [self._sampling_state(chunks[i].request) for i in spec])
        for j, i in enumerate(spec):
            tokens[i], logprobs[i], accepted[i] = result.token_ids[j], None, result.num_accepted[j]
        return StepResult([tokens[i] for i in sampling], [logprobs[i] for i in sampling],
                          [len(drafts[i]) for i in sampling], [accepted[i] for i in sampling])

    def _propose(self, chunks: list[ScheduledChunk]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Draft tokens (and their distributions, for a sampled draft) per chunk; [] without slots."""
        drafts: list[list[int]] = [[] for _ in chunks]
        probs: list[torch.Tensor | None] = [None] * len(chunks)
        slots = [i for i, c in enumerate(chunks) if c.num_draft_slots]
        if slots and self.proposer is not None:
            self.proposer.propose(chunks, slots, drafts, probs, self._sampling_state)
        return drafts, probs

    def forward(self, output: SchedulerOutput,
                drafts: list[list[int]] | None = None) -> tuple[torch.Tensor, AttentionMetadata]:
        """The forward alone: hidden states ``[num_tokens, hidden]`` and the batch metadata."""
        batch = FlatBatch.of(output.chunks, drafts, self.block_size)
        graphs = self.decode_graphs
        if graphs is not None and graphs.applies(batch):
            replayed = graphs.run(batch)
            if replayed is not None:
                return replayed, graphs.step_meta(batch)
            self.decode_graphs = None  # the capture failed (logged): eager from now on
        meta = AttentionMetadata.build(batch.query_lens, batch.context_lens, batch.tables, self.block_size,
                                       self.device)
        hidden = self.model(
            torch.tensor(batch.input_ids, device=self.device),
            torch.tensor(batch.positions, device=self.device),
            meta,
            self.kv_cache,
        )
        return hidden, meta


def sample_rows(chunks: list[ScheduledChunk], drafts: list[list[int]], ends: list[int]) -> list[int]:
    """The flat-batch rows whose logits a step samples or verifies, ascending: a sampling chunk's last row,
    and with k drafts its last k + 1 (the token before the drafts and each draft)."""
    return [r for i, c in enumerate(chunks) if c.samples for r in range(ends[i] - len(drafts[i]) - 1, ends[i])]

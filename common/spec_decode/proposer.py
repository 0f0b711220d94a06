"""Speculative proposers behind one interface (vLLM's ``Proposer``), chosen once from the speculative config.

Each step the model runner asks its proposer for drafts for the chunks that have draft slots, runs them in
the target's forward, verifies them (``common.spec_decode.rejection``), and tells the proposer how many the
target kept; a request that ends or is preempted is forgotten. The proposers:

- ``NgramLookup``: prompt lookup in the request's own tokens (``ngram.py``); no model, no state.
- ``EarlyLayers``: the target's first L layers + final norm + LM head, run autoregressively over the
  target's own paged cache (layers < L of the target *are* the draft, so the context's KV is already there).
- ``DraftModel``: a separate model with its own KV, read through the target's block tables
  (``draft_model.py``'s ``DraftModelProposer``).
- ``LookupFirst``: the lookup where it finds a long enough match (no draft forward), a draft model elsewhere.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from common.attention.metadata import AttentionMetadata
from common.config.engine_config import SpeculativeConfig, SpeculativeMethod
from common.sampling.sampler import RequestSamplingState
from common.spec_decode.draft_model import DraftModelProposer, sample_drafts
from common.spec_decode.ngram import NgramProposer

if TYPE_CHECKING:
    from common.engine.request import Request
    from common.engine.scheduler_output import ScheduledChunk
    from common.kv.kv_cache import KVCache
    from common.model.llama import LlamaForCausalLM

SamplingStateOf = Callable[["Request"], RequestSamplingState]


class Proposer(ABC):
    """Drafts for a step's speculating chunks, and whatever it keeps per request between steps."""

    @abstractmethod
    def propose(self, chunks: list[ScheduledChunk], slots: list[int], drafts: list[list[int]],
                probs: list[torch.Tensor | None], sampling_state: SamplingStateOf) -> None:
        """Fill ``drafts[i]`` for every chunk index ``i`` in ``slots`` (at most its ``num_draft_slots``
        tokens), and ``probs[i]`` ``[len(drafts[i]), vocab]`` where the drafts were sampled from a distribution
        (None: a point mass, as a lookup's)."""

    def accept(self, request_id: str, num_accepted: int) -> None:  # noqa: B027 - stateless proposers keep nothing
        """After verification: the target kept ``num_accepted`` of this request's drafts."""

    def forget(self, request_id: str) -> None:  # noqa: B027
        """The request ended or lost its blocks (preempted)."""

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:  # noqa: B027
        """The target copied these KV blocks (src, dst): a proposer with its own KV copies them too."""


class NgramLookup(Proposer):
    """What followed the latest earlier match of the request's last n tokens (prompt lookup)."""

    def __init__(self, lookup: NgramProposer) -> None:
        self.lookup = lookup

    def propose(self, chunks: list[ScheduledChunk], slots: list[int], drafts: list[list[int]],
                probs: list[torch.Tensor | None], sampling_state: SamplingStateOf) -> None:
        for i in slots:
            drafts[i] = self.lookup.propose(chunks[i].request.all_token_ids, chunks[i].num_draft_slots)


class EarlyLayers(Proposer):
    """The target's first ``num_layers`` layers as its own draft, run for k steps over the speculating requests.

    The draft shares the target's paged cache and writes its own tokens' KV into the reserved draft slots,
    which the verification forward then overwrites (or truncation gives back). Each draft token is one pass
    (``draft_logits``): here in this process; a parallel node's ranks run it instead
    (common/parallel/executor.py ``RankEarlyLayers``)."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, block_size: int, num_layers: int) -> None:
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.num_layers = min(num_layers, model.config.num_layers)
        self.device = kv_cache.data.device

    def propose(self, chunks: list[ScheduledChunk], slots: list[int], drafts: list[list[int]],
                probs: list[torch.Tensor | None], sampling_state: SamplingStateOf) -> None:
        bs = self.block_size
        active = list(slots)
        step_probs: dict[int, list[torch.Tensor]] = {i: [] for i in slots}
        # The chunk's own token (the request's last), which need not be an output token: when a prefill chunk
        # stops one token short of the prompt's end, that last prompt token is scheduled as a decode.
        last = {i: chunks[i].request.token_slice(chunks[i].start, chunks[i].start + 1)[0] for i in slots}
        for j in range(max(chunks[i].num_draft_slots for i in slots)):
            active = [i for i in active if chunks[i].num_draft_slots > j]
            if not active:
                break
            positions = [chunks[i].start + j for i in active]
            tables = [chunks[i].block_ids[: p // bs + 1] for i, p in zip(active, positions, strict=True)]
            logits = self.draft_logits([last[i] for i in active], positions, tables)
            last.update(sample_drafts(logits, chunks, active, drafts, step_probs, sampling_state))
        for i in slots:
            probs[i] = torch.stack(step_probs[i]) if step_probs[i] else None

    def draft_logits(self, token_ids: list[int], positions: list[int], tables: list[list[int]]) -> torch.Tensor:
        """One token per sequence (at its position, its block table reaching it) through the first
        ``num_layers`` layers, the final norm and the LM head: logits ``[len(token_ids), vocab]`` fp32; the
        pass writes those layers' KV at the positions."""
        meta = AttentionMetadata.build([1] * len(token_ids), positions, tables, self.block_size, self.device)
        hidden = self.model(torch.tensor(token_ids, device=self.device), torch.tensor(positions, device=self.device),
                            meta, self.kv_cache, num_layers=self.num_layers)
        return self.model.compute_logits(hidden)


class DraftModel(Proposer):
    """A separate draft model (``DraftModelProposer``); ``limit``: the most tokens it proposes per chunk."""

    def __init__(self, draft: DraftModelProposer, limit: int | None = None) -> None:
        self.draft, self.limit = draft, limit

    def propose(self, chunks: list[ScheduledChunk], slots: list[int], drafts: list[list[int]],
                probs: list[torch.Tensor | None], sampling_state: SamplingStateOf) -> None:
        self.draft.propose(chunks, slots, drafts, probs, sampling_state, self.limit)

    def accept(self, request_id: str, num_accepted: int) -> None:
        self.draft.accept(request_id, num_accepted)

    def forget(self, request_id: str) -> None:
        self.draft.forget(request_id)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.draft.kv_cache.copy_blocks(copies)


class LookupFirst(DraftModel):
    """The lookup where it matches at least its ``min_n`` tokens (no draft forward), the draft model elsewhere.

    With the lookup's own limit (``ngram_first_max_tokens``) a chunk's slots may exceed k; the draft model
    still proposes at most ``limit``."""

    def __init__(self, lookup: NgramProposer, draft: DraftModelProposer, limit: int | None) -> None:
        super().__init__(draft, limit)
        self.lookup = lookup
        self.num_lookups = 0  # requests the lookup drafted for

    def propose(self, chunks: list[ScheduledChunk], slots: list[int], drafts: list[list[int]],
                probs: list[torch.Tensor | None], sampling_state: SamplingStateOf) -> None:
        rest = []
        for i in slots:
            found = self.lookup.propose(chunks[i].request.all_token_ids, chunks[i].num_draft_slots)
            if found:
                drafts[i] = found  # a point mass: probs stay None
                self.num_lookups += 1
            else:
                rest.append(i)
        if rest:
            super().propose(chunks, rest, drafts, probs, sampling_state)


def make_proposer(spec: SpeculativeConfig, model: LlamaForCausalLM, kv_cache: KVCache, block_size: int,
                  num_blocks: int, draft_model: LlamaForCausalLM | None = None) -> Proposer | None:
    """The proposer ``spec`` asks for (None: no speculation)."""
    method = spec.method
    if method is SpeculativeMethod.NONE:
        return None
    if method is SpeculativeMethod.NGRAM:
        return NgramLookup(NgramProposer(spec.ngram_min_n, spec.ngram_max_n,
                                         drafts_per_matched_token=spec.ngram_drafts_per_matched_token,
                                         continue_past_end=True))
    if method is SpeculativeMethod.DRAFT_LAYERS:
        return EarlyLayers(model, kv_cache, block_size, spec.draft_layers)
    assert draft_model is not None, "speculative draft_model needs the draft model loaded"
    # the target's own copy (a quantized self-draft: same config and dtype, so the same KV layout) starts from
    # the target's prompt K/V
    own_copy = draft_model.config == model.config and draft_model.dtype == model.dtype
    draft = DraftModelProposer(draft_model, num_blocks, block_size, kv_cache.data.device,
                               prompt_kv=kv_cache if own_copy else None)
    if not spec.ngram_first:
        return DraftModel(draft)
    # the lookup only for matches of >= ngram_first_min_n tokens
    first_n = max(spec.ngram_first_min_n, spec.ngram_min_n)
    lookup = NgramProposer(first_n, max(first_n, spec.ngram_max_n),
                           drafts_per_matched_token=spec.ngram_drafts_per_matched_token, continue_past_end=True)
    return LookupFirst(lookup, draft, spec.num_speculative_tokens if spec.ngram_first_max_tokens else None)

"""A separate draft model with its own paged KV cache, proposing tokens for the target (vLLM's draft model).

The draft's KV tensor has the target's block layout (same number of blocks, same block size; its own layer
count, heads and dtype), and the draft reads and writes it through the *target's* block tables. So a
request's draft KV lives in the blocks the target holds for it: when the target frees, truncates or is
preempted, the draft's KV goes with it, and no second block manager is needed.

Per request the proposer remembers ``computed``: how many leading tokens have draft KV. Each step it
catches up (one ragged forward over the tokens since then — the whole prompt the first time, which is how a
decode node gets the draft's prompt KV without any transfer) ending at the request's last token, whose logits
give the first draft; then k - 1 single-token steps. After verification ``accept`` keeps what the target
kept: the last token, the accepted drafts that the draft itself fed (its own KV for them is right), no more.

With a sliding window on every layer of both models the target frees a request's blocks behind the window
(``KVCacheManager.window``, which then covers the draft's usual lag too); their table slots are NULL_BLOCK. The
draft never reads one: when its catch-up would (its first step after a chunked prompt, a decode node's request
whose leading blocks were never held, a lag after speculation paused), it starts again from the first block the
table holds, in a frame of its own — positions counted from that block (``_base``), so its first queries see no
keys before it rather than freed ones. Rotary attention depends only on the distance between positions, so the
frame changes nothing but where the context starts; the draft's KV there is what the truncated context gives,
which changes only what it proposes, never what is accepted (so does another request's frame over a block both
share through the prefix cache).

The target's own copy as a draft (the same architecture and name: a quantized self-draft) starts from the
target's prompt KV instead (``prompt_kv``): its blocks are copied into the draft's cache, block for block,
and the catch-up forwards only the last token. Its own prefill of the prompt costs as many FLOPs as the
target's (measured on the 2-core AVX2 EPYC: a drafted token cost much more on 66-127-token input-grounded
prompts than on short ones; benchmarks/results/2026-12-02-avx2-step/RESULTS.md); the copy costs a memcpy,
and the draft then reads the target's (more exact) K/V, which changes only what it proposes, never what is
accepted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from common.attention.metadata import AttentionMetadata
from common.kv.kv_cache import KVCache, KVCacheSpec
from common.kv.kv_cache_manager import NULL_BLOCK
from common.sampling.sampler import DRAFT, RequestSamplingState, sample_from, seeded_uniform, target_probs

if TYPE_CHECKING:
    from collections.abc import Callable

    from common.engine.request import Request
    from common.engine.scheduler_output import ScheduledChunk
    from common.model.llama import LlamaForCausalLM


class DraftModelProposer:
    """Proposes up to ``num_draft_slots`` tokens per speculating chunk with ``model``."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, device: torch.device,
                 prompt_kv: KVCache | None = None) -> None:
        """``prompt_kv``: the target's cache, when this draft is the target's own copy (its prompt K/V is copied
        from there); it must have the draft's spec."""
        cfg = model.config
        spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size,
                           str(model.dtype).removeprefix("torch."))
        self.model = model
        self.block_size = block_size
        self.device = device
        self.kv_cache = KVCache(spec, num_blocks, device)
        # The target's cache may hold one block more than the draft's (CUDA graphs' padding block,
        # common/engine/cuda_graphs.py): the scheduler's block ids, all the copy reads, index both.
        if prompt_kv is not None and (prompt_kv.spec != spec or prompt_kv.num_blocks < num_blocks):
            raise ValueError("the draft copies the target's prompt K/V only with the same KV layout")
        self.prompt_kv = prompt_kv
        windows = cfg.layer_windows
        # the draft's largest window when every layer has one: its queries read no further back
        self.window = max(w for w in windows if w is not None) if windows and None not in windows else None
        self._computed: dict[str, int] = {}  # request id -> leading tokens with valid draft KV
        self._base: dict[str, int] = {}  # request id -> the draft's frame origin (a block's first position); 0: none
        self._fed: dict[str, int] = {}  # request id -> drafts this step whose own KV the draft wrote

    @torch.inference_mode()
    def propose(self, chunks: list[ScheduledChunk], slots: list[int], drafts: list[list[int]],
                probs: list[torch.Tensor | None], sampling_state: Callable[[Request], RequestSamplingState],
                limit: int | None = None) -> None:
        """Fill ``drafts[i]`` (and ``probs[i]``, the draft's distributions) for every chunk index in ``slots``:
        as many tokens as the chunk has draft slots, at most ``limit``."""
        bs = self.block_size
        wanted = {i: min(chunks[i].num_draft_slots, limit or chunks[i].num_draft_slots) for i in slots}
        # Catch up: tokens computed..start (the chunk's own, the request's last) in one ragged forward.
        starts = {i: min(self._computed.get(chunks[i].request.request_id, 0), chunks[i].start) for i in slots}
        bases = {i: self._base.get(chunks[i].request.request_id, 0) for i in slots}
        restart = [i for i in slots if self._reads_freed(chunks[i], starts[i], bases[i])]
        fresh: list[int] = []
        if self.prompt_kv is not None:  # new requests: the target's K/V of every token before the last
            fresh = [i for i in slots if (chunks[i].request.request_id not in self._computed or i in restart)
                     and chunks[i].start > 0]
            blocks = [b for i in fresh for b in chunks[i].block_ids[: -(-chunks[i].start // bs)] if b != NULL_BLOCK]
            if blocks:
                index = torch.tensor(blocks, device=self.device)
                self.kv_cache.data[index] = self.prompt_kv.data[index]
            for i in fresh:
                starts[i] = chunks[i].start
        for i in restart:
            if i not in fresh:  # the draft's own frame from the first block the table holds
                starts[i] = bases[i] = self._base[chunks[i].request.request_id] = self._first_held(chunks[i])
        input_ids: list[int] = []
        positions: list[int] = []
        for i in slots:
            c = chunks[i]
            input_ids += c.request.token_slice(starts[i], c.start + 1)
            positions += range(starts[i] - bases[i], c.start + 1 - bases[i])
        query_lens = [chunks[i].start + 1 - starts[i] for i in slots]
        tables = [chunks[i].block_ids[bases[i] // bs: chunks[i].start // bs + 1] for i in slots]
        meta = AttentionMetadata.build(query_lens, [starts[i] - bases[i] for i in slots], tables, bs, self.device)
        hidden = self.model(torch.tensor(input_ids, device=self.device), torch.tensor(positions, device=self.device),
                            meta, self.kv_cache)
        last_rows = meta.query_start_loc[1:] - 1
        step_probs: dict[int, list[torch.Tensor]] = {i: [] for i in slots}
        last = sample_drafts(self.model.compute_logits(hidden[last_rows]), chunks, slots, drafts, step_probs,
                             sampling_state)
        for i in slots:
            self._computed[chunks[i].request.request_id] = chunks[i].start + 1
            self._fed[chunks[i].request.request_id] = 0
        active = list(slots)
        for j in range(1, max(wanted.values())):
            active = [i for i in active if wanted[i] > j]
            if not active:
                break
            pos = [chunks[i].start + j - bases[i] for i in active]  # in the draft's frame
            tables = [chunks[i].block_ids[bases[i] // bs: bases[i] // bs + p // bs + 1]
                      for i, p in zip(active, pos, strict=True)]
            meta = AttentionMetadata.build([1] * len(active), pos, tables, bs, self.device)
            hidden = self.model(torch.tensor([last[i] for i in active], device=self.device),
                                torch.tensor(pos, device=self.device), meta, self.kv_cache)
            last = sample_drafts(self.model.compute_logits(hidden), chunks, active, drafts, step_probs,
                                 sampling_state)
            for i in active:
                self._fed[chunks[i].request.request_id] = j
        for i in slots:
            probs[i] = torch.stack(step_probs[i])

    def _reads_freed(self, chunk: ScheduledChunk, start: int, base: int) -> bool:
        """Would catching ``chunk``'s request up from ``start`` (in the frame from ``base``) read a freed block?"""
        held = self._first_held(chunk)
        if held <= base:
            return False
        return self.window is None or start - self.window + 1 < held

    def _first_held(self, chunk: ScheduledChunk) -> int:
        """The first position of the first block ``chunk``'s table holds (its leading freed slots are NULL_BLOCK)."""
        return next((j for j, b in enumerate(chunk.block_ids) if b != NULL_BLOCK), 0) * self.block_size

    def accept(self, request_id: str, num_accepted: int) -> None:
        """After verification: the target kept ``num_accepted`` drafts; the draft's KV is valid for those it
        fed itself (all but its last proposal)."""
        if request_id in self._computed:
            self._computed[request_id] += min(num_accepted, self._fed.pop(request_id, 0))

    def forget(self, request_id: str) -> None:
        """The request ended or lost its blocks (preempted): its draft KV is gone with them."""
        self._computed.pop(request_id, None)
        self._fed.pop(request_id, None)
        self._base.pop(request_id, None)


def sample_drafts(logits: torch.Tensor, chunks: list[ScheduledChunk], rows: list[int], drafts: list[list[int]],
                  step_probs: dict[int, list[torch.Tensor]],
                  sampling_state: Callable[[Request], RequestSamplingState]) -> dict[int, int]:
    """One draft token for each chunk index in ``rows`` (``logits``' rows ``[len(rows), vocab]`` fp32, in that
    order) from the draft's distribution (greedy requests: its argmax), appended to ``drafts`` and
    ``step_probs``; returns them."""
    params = [chunks[i].request.params for i in rows]
    p = target_probs(logits, params)
    out = {}
    for row, i in enumerate(rows):
        state = sampling_state(chunks[i].request)
        if params[row].greedy:
            token = int(p[row].argmax())
        elif state.seed is None:
            token = int(torch.multinomial(p[row], 1))
        else:  # the draft for output position t: seeded_uniform(seed, t, DRAFT) (common/sampling/sampler.py)
            u = seeded_uniform(state.seed, state.position + len(drafts[i]), DRAFT)
            token = int(sample_from(p[row : row + 1], torch.tensor([u], dtype=torch.float64, device=p.device)))
        drafts[i].append(token)
        step_probs[i].append(p[row])
        out[i] = token
    return out

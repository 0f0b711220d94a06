"""The token-budget scheduler every engine runs (pure Python: no torch).

Each request has ``num_tokens`` (prompt + outputs) and ``num_computed_tokens`` (those with KV). A step
gives every scheduled request a chunk of its uncomputed tokens, within a per-step token budget:

1. Decoding requests first, oldest first: 1 token each (plus draft slots when speculating). Decodes and
   prefill chunks share one batch (Sarathi-Serve), so a long prompt never stalls the running streams.
2. Then prefill chunks (at most ``max_prefill_chunk`` each) while the budget lasts, for the running
   requests still in prefill and the waiting ones (admitted when reached, as ``max_num_seqs`` and free
   blocks allow; their cached prefix is reused), in ``prefill_order``:
   - ``shortest`` (default): fewest uncomputed tokens first, so a short prompt is not stuck behind long
     ones (it gets its first token in the next step, not after every long prompt queued before it:
     shortest-remaining-first minimizes mean TTFT). Preempted requests come first, and so does a prompt
     passed over for ``max_prefill_skips`` steps in a row by later arrivals (then in arrival order), so a
     long prompt is delayed a bounded number of steps, never starved.
   - ``fcfs``: running prefills in admission order, then the queue in arrival order.
   Blocks are granted in the same order: when the first waiting request in that order does not fit, no
   request after it is admitted in this step (none takes the memory it waits for). A waiting prompt that shares
   full blocks with what a request before it computes in this step waits a step and takes them from the prefix
   cache instead (``defer_shared_prefill``, SGLang's in-batch prefix caching).

With a sliding window on every layer (``KVCacheManager.window``) a request computed here is admitted chunk by
chunk: admission takes its cached prefix and the blocks of its first chunk, each later chunk grows its table
(``_grow_chunk``) and the blocks that fall behind the window are freed after every step, so it never holds more
than the window and one chunk (``peak_blocks``), however long its prompt. Admission reserves that peak: a request
is admitted only while its peak fits beside what the windowed requests still in prefill may yet take.

When a running request cannot grow, the newest running request is preempted by **recompute**: its blocks
are freed (its full blocks stay in the prefix cache, so re-admission usually finds most of them) and it
goes back to the front of the queue. We chose recompute over swap: swap needs a second, host-side pool
and copies both ways, while recompute with prefix caching often costs nothing but a lookup. Preemptions
are counted per request and in ``num_preemptions``.

The scheduler knows no roles: a node's ``KVConnector`` (``common.engine.kv_connector``) says which
prompt tokens get their KV from elsewhere (those requests wait in ``waiting_for_kv`` with their blocks
allocated until ``kv_arrived``), whether a finished request's blocks are held for the connector (in
``held``, until ``free_held``), and whether requests end at their first token. Colocated, prefill and
decode nodes differ only in their connector. A preempted request whose KV came from elsewhere is simply
recomputed locally.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from typing import TYPE_CHECKING

from common.engine.kv_connector import KVConnector
from common.engine.request import FinishReason, Request, RequestOutput, RequestStatus
from common.engine.scheduler_output import ScheduledChunk, SchedulerOutput, StepResult
from common.engine.scheduling_policy import count_prefill_skips, prefill_priority
from common.spec_decode.policy import SpeculationPolicy

if TYPE_CHECKING:
    from common.config.engine_config import SchedulerConfig, SpeculativeConfig
    from common.kv.kv_cache_manager import Allocation, BlockCopy, KVCacheManager


# A waiting request shares at least this many full blocks of its prompt with what another request computes in the
# step (``Scheduler._computed_beside``): it waits a step and takes them from the prefix cache (SGLang: 32 tokens).
SHARED_PREFILL_BLOCKS = 2


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 connector: KVConnector | None = None, speculative: SpeculativeConfig | None = None) -> None:
        self.config = config
        self.connector = connector or KVConnector()
        self.speculative = speculative if speculative is not None and speculative.enabled else None
        # draft slots per request and step, acceptance estimates and counters (common/spec_decode/policy.py)
        self.speculation = SpeculationPolicy(self.speculative, max_model_len) if self.speculative else None
        self._pending_copies: list[BlockCopy] = []
        self._chunk_limit: int | None = config.max_prefill_chunk  # this step's (``_step_budget``)
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.waiting_for_kv: dict[str, Request] = {}  # blocks allocated, KV coming from another node
        self.held: dict[str, Request] = {}  # finished, blocks held for the connector until free_held
        # Queued requests the last schedule() moved to waiting_for_kv: their blocks, announced by update().
        self._reserved: list[RequestOutput] = []
        # The last schedule() could do nothing, and nothing changes until a caller does (add, abort, free,
        # KV arrived): with only queued requests left, the engine waits for a command instead of spinning.
        self._stalled = False
        self.num_preemptions = 0
        self._watermark_blocks = int(config.watermark * kv.pool.num_blocks)
        self._arrivals = itertools.count()

    # ---- admission -------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; it is admitted in the prefill order as the budget and free blocks allow."""
        assert request.num_tokens < self.max_model_len or self.connector.ends_at_first_token
        request.status = RequestStatus.WAITING
        request.arrival_seq = next(self._arrivals)
        self.waiting.append(request)
        self._stalled = False

    def admit_now(self, request: Request) -> Allocation | None:
        """Allocate ``request``'s blocks at once, ahead of the queue, or not at all (None: no room now).

        For requests whose KV comes from another node: they wait for that KV, not for compute here, so
        they never queue behind this node's compute. The watermark always holds: blocks stay free for
        the requests already running. It goes ahead of queued requests only when their blocks stay free too
        (none waits longer), so a prefill node is not left idle while this queue waits for the next step.
        """
        first_query = self._first_query(request)
        needed = (self.kv.blocks_needed(request.num_prompt_tokens) - self.kv.blocks_outside_window(first_query)
                  + self.blocks_waiting())
        if needed > self.kv.num_free_blocks - self._watermark_blocks:
            return None
        self._stalled = False
        # its KV arrives in whole blocks: a partly filled one kept in the tier would be written over
        allocation = self.kv.allocate(request.request_id, request.prompt_token_ids, first_query_pos=first_query,
                                      tail=False)
        if allocation is None:
            return None
        request.arrival_seq = next(self._arrivals)
        request.num_cached_tokens = allocation.num_cached_tokens
        request.num_computed_tokens = allocation.num_cached_tokens
        if self._start(request) is RequestStatus.RUNNING:
            self.running.append(request)
        else:
            self._announce(request)
        return allocation

    def blocks_waiting(self) -> int:
        """Blocks the requests waiting for admission need for their tokens so far (cached prefixes not
        subtracted: an upper bound; a windowed request computed here needs its ``peak_blocks``)."""
        return sum(self._peak(r) if self._chunked(r) else self.kv.blocks_needed(len(r.all_token_ids))
                   for r in self.waiting)

    def _announce(self, request: Request) -> None:
        """A request now waits for its remote KV in blocks reserved for it: say which, on its stream (once)."""
        self._reserved.append(RequestOutput(
            request.request_id, [], False, num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            reserved_block_ids=tuple(self.kv.block_table(request.request_id))))

    def take_announced(self) -> list[RequestOutput]:
        """The reservations announced since the last step (``update`` returns them too)."""
        announced, self._reserved = self._reserved, []
        return announced

    def kv_arrived(self, request_id: str, first_token: int) -> RequestOutput:
        """The KV of a request in ``waiting_for_kv`` has landed, and the remote prefill sampled ``first_token``."""
        request = self.waiting_for_kv.pop(request_id)
        self._stalled = False
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv.commit(request_id, request.prompt_token_ids)
        request.output_token_ids.append(first_token)
        reason = request.check_stop(self.max_model_len)
        if reason is not None:
            self._finish(request, reason)
        else:
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        return _output(request, [first_token], reason)

    # ---- the step --------------------------------------------------------------------------------

    def _step_budget(self) -> tuple[int, int | None]:
        """(tokens, prefill chunk) for this step (``SchedulerConfig.backlog_budget``): while no running request
        decodes, the backlog's tokens and no chunk limit (no stream's TPOT to keep short, and a prompt computed
        whole skips the steps and the re-read prefix of its chunks: a 1,300-token prompt alone on 2 Xeon cores,
        fp32, took 1.15x vLLM's time in 512-token chunks, 1.07x whole; a prefill node's steps are all of this
        kind); while more prompt tokens wait to be prefilled than the configured step holds, the backlog budget;
        else the configured one. (Until session 32 the backlog budget took over only past its own size, so a lone
        1,300-token prompt beside running decodes went in 256-token chunks over six steps: under vLLM's client at
        2 req/s its TTFT was 400-550 ms against ~300 ms whole.)"""
        config = self.config
        if config.backlog_budget is not None:
            tokens, chunk = config.backlog_budget
            if not any(r.num_tokens - r.num_computed_tokens <= 1 for r in self.running):
                return tokens, None
            backlog = 0
            for request in (*self.waiting, *self.running):
                backlog += max(0, request.num_tokens - request.num_computed_tokens - 1)
                if backlog > config.max_num_batched_tokens:
                    return tokens, chunk
        return config.max_num_batched_tokens, config.max_prefill_chunk

    def schedule(self) -> SchedulerOutput:
        budget, self._chunk_limit = self._step_budget()
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []

        speculation = self.speculation if self.speculation and self.speculation.speculates(self.running) else None
        prefilling: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            i += 1
            if request.num_tokens - request.num_computed_tokens > 1:
                prefilling.append(request)  # its chunk is given out below, in prefill order
                continue
            k = speculation.num_drafts(request, budget - 1) if speculation else 0
            if not self._grow(request, 1 + k, preempted):
                break  # `request` itself was preempted: everything after it already was
            chunks.append(ScheduledChunk(request, request.num_computed_tokens, 1,
                                         self.kv.block_table(request.request_id), k))
            budget -= 1 + k

        # No admissions in a step that had to preempt: memory is short, let running requests finish.
        candidates = prefilling if preempted else prefilling + list(self.waiting)
        if self.config.prefill_order == "shortest":
            candidates.sort(key=self._prefill_priority)
        admitting = True
        scheduled: list[Request] = []
        computing: list[tuple[Request, int, int]] = []  # (request, first, end) of the prompt tokens computed here
        for request in candidates:
            if budget <= 0:
                break
            if request.status is RequestStatus.WAITING:
                if not admitting:
                    continue  # also a request preempted in this loop: no admissions in a step that preempts
                if computing and self._computed_beside(request, computing):
                    continue  # next step its prefix is in the cache: one step's wait instead of computing it twice
                if len(self.running) >= self.config.max_num_seqs or not self._admit(request, budget):
                    admitting = False  # later ones in this order must not take the blocks it waits for
                    continue
                self.waiting.remove(request)
                if self._start(request) is RequestStatus.WAITING_FOR_KV:
                    self._announce(request)
                    continue
                self.running.append(request)
            n = self._chunk_size(request, budget)
            # Only a windowed request admitted chunk by chunk lacks slots for its chunk here (else its table holds
            # its whole prompt from admission on).
            if self.kv.num_tokens(request.request_id) < request.num_computed_tokens + n:
                grown = self._grow_chunk(request, n, chunks, preempted)
                if preempted:
                    admitting = False
                if not grown:
                    continue
            chunks.append(ScheduledChunk(request, request.num_computed_tokens, n,
                                         self.kv.block_table(request.request_id)))
            scheduled.append(request)
            if self.kv.enable_prefix_caching:
                computing.append((request, request.num_computed_tokens, request.num_computed_tokens + n))
            budget -= n
        count_prefill_skips(candidates, scheduled)
        copies, self._pending_copies = self._pending_copies, []
        self._stalled = not chunks
        return SchedulerOutput(chunks, preempted, copies)

    def _computed_beside(self, request: Request, computing: list[tuple[Request, int, int]]) -> bool:
        """Whether another request computes, in this step, at least ``SHARED_PREFILL_BLOCKS`` full blocks of the
        prompt prefix ``request`` shares with it, past what the cache holds: SGLang's in-batch prefix caching.
        Admitted beside it, ``request`` would compute those blocks a second time (prefix hits are known only for
        blocks computed in earlier steps); admitted a step later it takes them from the cache. 48 requests with
        one 512-token system prompt at once each computed it in the first steps until one had cached it. The
        wait is a step for each chunk of the shared part the other request still computes, so it is bounded;
        a request whose prompt KV comes from another node is never held back (it computes none of it)."""
        if not self.config.defer_shared_prefill:
            return False
        block_size = self.kv.block_size
        tokens = request.prompt_token_ids
        for other, first, end in computing:
            # Full blocks from the other's first computed token on: they are not cached (else it had hit them).
            shared = -(-first // block_size) * block_size + SHARED_PREFILL_BLOCKS * block_size
            if shared <= min(end, other.num_prompt_tokens, request.num_prompt_tokens) and \
                    tokens[:shared] == other.prompt_token_ids[:shared]:
                return self._first_query(request) == 0
        return False

    def _prefill_priority(self, request: Request) -> tuple[int, int, int]:
        """``shortest`` order: preempted and long-passed-over requests first (by arrival), then fewest
        uncomputed tokens (a waiting request's cached prefix is not known before its admission)."""
        return prefill_priority(request.num_tokens - request.num_computed_tokens, request.arrival_seq,
                                request.num_preemptions > 0 or request.prefill_skips >= self.config.max_prefill_skips)

    def update(self, output: SchedulerOutput, result: StepResult | None) -> list[RequestOutput]:
        """Account for a finished forward: advance computed tokens, append sampled tokens, stop.

        Also announces the requests this step's schedule moved from the queue to ``waiting_for_kv``: an
        output with their ``reserved_block_ids`` and no tokens.
        """
        outputs, self._reserved = self._reserved, []
        if result is not None and self.speculation is not None:
            self.speculation.record_cost(result.draft_cost)
        row = 0
        block_size = self.kv.block_size
        for chunk in output.chunks:
            request = chunk.request
            if not chunk.samples:
                self._advance(request, chunk.num_tokens, block_size)
                continue
            assert result is not None
            tokens, accepted, drafts = result.token_ids[row], result.num_accepted[row], result.num_drafts[row]
            logprobs = result.logprobs[row]
            row += 1
            # Accepted drafts' KV is valid; rejected drafts' slots are given back below.
            self._advance(request, chunk.num_tokens + accepted, block_size)
            if chunk.num_draft_slots:
                assert self.speculation is not None  # it granted the slots
                self.speculation.record(request, drafts, accepted)
                copies = self.kv.truncate(request.request_id, request.num_computed_tokens)
                assert copies is not None  # shrinking never needs a free block
                self._pending_copies.extend(copies)
            new_tokens: list[int] = []
            reason = None
            for token in tokens:
                request.output_token_ids.append(token)
                new_tokens.append(token)
                reason = request.check_stop(self.max_model_len)
                if reason is not None:
                    break  # tokens after a stop are dropped, as if never generated
            if reason is not None or self.connector.ends_at_first_token:
                self._finish(request, reason)
            outputs.append(_output(request, new_tokens, reason,
                                   None if logprobs is None else logprobs[: len(new_tokens)]))
        return outputs

    def _advance(self, request: Request, num_tokens: int, block_size: int) -> None:
        before = request.num_computed_tokens
        request.num_computed_tokens = before + num_tokens
        if request.num_computed_tokens // block_size > before // block_size:
            # A block just filled up: enter it in the prefix cache.
            self.kv.commit(request.request_id, request.token_slice(0, request.num_computed_tokens))
        # No later step queries below num_computed_tokens: blocks before every window are dead (a no-op without
        # one), unless a KV transfer still reads them.
        self.kv.free_outside_window(request.request_id, request.num_computed_tokens,
                                    self.connector.kv_read_from(request))

    # ---- ending ----------------------------------------------------------------------------------

    def abort(self, request_id: str) -> Request | None:
        """Drop a request wherever it is and free its blocks. Unknown or finished ids: None."""
        request = self.waiting_for_kv.pop(request_id, None) or self.held.pop(request_id, None)
        if request is None:
            request = next((r for r in self.running if r.request_id == request_id), None)
            if request is not None:
                self.running.remove(request)
        if request is None:
            request = next((r for r in self.waiting if r.request_id == request_id), None)
            if request is not None:
                self.waiting.remove(request)
        if request is None:
            return None
        self._stalled = False
        if self.kv.has_request(request_id):
            self.kv.free(request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = FinishReason.ABORT
        return request

    def free_held(self, request_id: str) -> None:
        """The connector is done with a finished request's blocks (e.g. KV transfer read them): free them."""
        request = self.held.pop(request_id, None)
        if request is not None:
            self.kv.free(request_id, self._computed_tokens(request))
            self._stalled = False

    @property
    def num_waiting(self) -> int:
        """Requests not running yet: queued for compute, or waiting for their KV to arrive."""
        return len(self.waiting) + len(self.waiting_for_kv)

    def has_work(self) -> bool:
        """Whether a step can make progress: something runs, or queued requests may be admitted now."""
        return bool(self.running) or (bool(self.waiting) and not self._stalled)

    # ---- speculative decoding: the counters the metrics read (SpecCounters), kept by the policy ----------

    @property
    def num_spec_steps(self) -> int:
        return self.speculation.num_spec_steps if self.speculation else 0

    @property
    def num_draft_tokens(self) -> int:
        return self.speculation.num_draft_tokens if self.speculation else 0

    @property
    def num_accepted_tokens(self) -> int:
        return self.speculation.num_accepted_tokens if self.speculation else 0

    # ---- internals -------------------------------------------------------------------------------

    def _chunk_size(self, request: Request, budget: int) -> int:
        left = request.num_tokens - request.num_computed_tokens
        chunked = self._chunked(request)
        whole = self.config.whole_prefill
        if whole is not None and request.num_tokens <= whole and left <= budget and not chunked:
            return left  # a short prompt that fits the step goes whole (SchedulerConfig.whole_prefill)
        n = min(left, self._chunk_cap(budget, chunked))
        assert n >= 1
        return n

    def _chunk_cap(self, budget: int, chunked: bool) -> int:
        """The most prompt tokens one request computes in this step: the budget, the step's chunk limit and, for a
        request admitted chunk by chunk, the largest chunk that fits the pool beside its window."""
        n = budget
        if self._chunk_limit is not None:
            n = min(n, self._chunk_limit)
        if chunked:
            n = min(n, self._window_chunk())
        return max(n, 1)

    # ---- sliding windows: a request computed here holds its window and one chunk, not its whole prompt ---------

    def _chunked(self, request: Request) -> bool:
        """Whether ``request`` is admitted chunk by chunk: every layer is windowed and all of its tokens are computed
        here (a decode node reserves a remote prompt's window whole, for the transfer to fill)."""
        return self.kv.window is not None and self._first_query(request) == 0

    def _window_chunk(self) -> int:
        """The largest prefill chunk a windowed request gets: the largest any step gives, capped so that the window
        and one chunk fit the pool (a request alone can always grow)."""
        config = self.config
        kv = self.kv
        assert kv.window is not None
        chunk = min(config.max_num_batched_tokens, config.max_prefill_chunk or config.max_num_batched_tokens)
        if config.backlog_budget is not None:
            chunk = max(chunk, min(config.backlog_budget))
        room = kv.pool.num_blocks * kv.block_size - (kv.window + kv.block_size - 2)
        return max(1, min(chunk, room))

    def peak_blocks(self, num_tokens: int, keep_from: int | None = None) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds at once if all of them are computed here: all of
        them without a window; with one, those of the window and one chunk (a chunk at p .. p+c-1 reads from
        p - window + 1, whose block starts up to block_size - 1 tokens earlier: blocks_needed(window + c +
        block_size - 2)), plus the dead blocks from ``keep_from`` on that a KV transfer still reads
        (``KVConnector.kv_read_from``); never more than all of them."""
        kv = self.kv
        whole = kv.blocks_needed(num_tokens)
        if kv.window is None:
            return whole
        peak = kv.blocks_needed(kv.window + self._window_chunk() + kv.block_size - 2)
        if keep_from is not None:
            peak += max(0, kv.blocks_outside_window(num_tokens) - keep_from)
        return min(whole, peak)

    def _peak(self, request: Request) -> int:
        return self.peak_blocks(len(request.all_token_ids), self.connector.kv_read_from(request))

    def _window_growth(self) -> int:
        """Blocks the running windowed requests still in prefill may yet take beyond those they hold."""
        return sum(max(0, self._peak(r) - self.kv.num_held_blocks(r.request_id)) for r in self.running
                   if r.num_tokens - r.num_computed_tokens > 1 and self._chunked(r))

    def _grow_chunk(self, request: Request, n: int, chunks: list[ScheduledChunk], preempted: list[str]) -> bool:
        """Slots for the next ``n`` prompt tokens of a request admitted chunk by chunk, preempting the newest running
        requests not scheduled in this step if needed (one already given a chunk keeps its blocks: the chunk writes
        them). A request a KV transfer may be reading (``KVConnector.can_preempt``) is never preempted.
        False: ``request`` gets no chunk in this step (it was preempted itself, or waits for blocks)."""
        needed = request.num_computed_tokens + n - self.kv.num_tokens(request.request_id)
        while self.kv.append_slots(request.request_id, needed) is None:
            scheduled = {chunk.request.request_id for chunk in chunks}
            victim = next((r for r in reversed(self.running)
                           if r.request_id not in scheduled and self.connector.can_preempt(r)), None)
            if victim is None:
                return False
            self.running.remove(victim)
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _grow(self, request: Request, n: int, preempted: list[str]) -> bool:
        """Make room for ``n`` more tokens of ``request``, preempting the newest requests if needed."""
        needed = request.num_computed_tokens + n - self.kv.num_tokens(request.request_id)
        while needed > 0 and self.kv.append_slots(request.request_id, needed) is None:
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _computed_tokens(self, request: Request) -> list[int] | None:
        """What ``KVCacheManager.free`` needs to keep a finished request's last, partly filled block, if it does."""
        return request.token_slice(0, request.num_computed_tokens) if self.kv.keeps_tails else None

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _first_query(self, request: Request) -> int:
        """The lowest position whose query this node computes for ``request`` before allocation: past the
        prompt tokens whose KV another node provides (a decode node's remote prefill), else 0."""
        return self.connector.get_num_new_matched_tokens(request, 0)

    def _admit(self, request: Request, budget: int) -> bool:
        tokens = request.all_token_ids
        first_query = self._first_query(request)
        hits = len(self.kv.get_computed_blocks(tokens)[0])
        # The watermark only holds back new work while others run; alone, a request may use it all.
        reserve = self._watermark_blocks if self.running else 0
        first_chunk: int | None = None  # None: the whole prompt's blocks now
        if self._chunked(request):
            # Its peak, less the hits it takes (those before its first query's window stay where they are), beside
            # the blocks the windowed requests already in prefill may yet take: growth then needs no preemption.
            live_hits = hits - min(self.kv.blocks_outside_window(hits * self.kv.block_size), hits)
            fresh = self._peak(request) - live_hits
            reserve += self._window_growth()
            first_chunk = self._chunk_cap(budget, True)
        else:
            fresh = self.kv.blocks_needed(len(tokens)) - max(hits, self.kv.blocks_outside_window(first_query))
        if fresh > self.kv.num_free_blocks - reserve:
            return False
        allocation = self.kv.allocate(request.request_id, tokens, first_query_pos=first_query,
                                      max_new_tokens=first_chunk)
        if allocation is None:
            return False
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
            request.num_cached_tokens = allocation.num_cached_tokens
        request.num_computed_tokens = allocation.num_cached_tokens
        return True

    def _start(self, request: Request) -> RequestStatus:
        """An admitted request runs, or waits for the KV its connector says comes from elsewhere."""
        if self.connector.get_num_new_matched_tokens(request, request.num_computed_tokens) > 0:
            request.status = RequestStatus.WAITING_FOR_KV
            self.waiting_for_kv[request.request_id] = request
        else:
            request.status = RequestStatus.RUNNING
        return request.status

    def _finish(self, request: Request, reason: FinishReason | None) -> None:
        if request in self.running:
            self.running.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if self.connector.request_finished(request):
            self.held[request.request_id] = request
        else:  # its last, partly filled block to the offload tier (if any), for a turn that goes on from it
            self.kv.free(request.request_id, self._computed_tokens(request))


def _output(request: Request, new_tokens: list[int], reason: FinishReason | None,
            logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None) -> RequestOutput:
    return RequestOutput(request.request_id, new_tokens, request.is_finished, reason, logprobs=logprobs,
                         num_prompt_tokens=request.num_prompt_tokens, num_cached_tokens=request.num_cached_tokens,
                         # on the first output (queue time) and the last (every counter)
                         counters=request.counters() if request.is_finished
                         or len(request.output_token_ids) == len(new_tokens) else None)

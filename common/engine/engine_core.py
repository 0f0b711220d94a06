"""The engine loop every node runs, and the one place where engine commands are dispatched.

``EngineCore.step`` is schedule -> run the model and sample -> post-process. The engine is the same for
every role; a node's role is its ``KVConnector`` (``common.engine.kv_connector``): the colocated engine
(prefill and decode in one process, the offline API's engine and the benchmarks' baseline) has the base
connector, prefill nodes a KV producer, decode nodes a KV consumer.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

from common.config.engine_config import CacheConfig, SchedulerConfig, SpeculativeConfig
from common.engine.commands import (
    AbortRequest,
    AddRequest,
    AttachDestination,
    EngineCommand,
    PrepareKernels,
    ReserveKV,
    SetKVEventSink,
    SnapshotKVBlocks,
)
from common.engine.cuda_graphs import DecodeGraphSpec
from common.engine.kv_connector import KVConnector
from common.engine.model_runner import ModelRunner, kv_cache_spec
from common.engine.request import Request, RequestOutput
from common.engine.scheduler import Scheduler
from common.errors import InvalidRequestError, QueueFullError
from common.kv.kv_cache_manager import KVCacheManager
from common.kv.kv_events import KVSnapshot

if TYPE_CHECKING:
    from common.engine.commands import KVEventSink
    from common.engine.scheduler_output import SchedulerOutput
    from common.kv.offload import OffloadTier
    from common.kv.shared_tier import SharedTier
    from common.model.llama import LlamaForCausalLM
    from common.parallel.executor import ParallelLaunch
    from common.sampling.params import SamplingParams

R = TypeVar("R")
log = logging.getLogger(__name__)


class EngineCore:
    """Continuous batching with chunked prefill mixed into decode steps, over one paged KV cache."""

    def __init__(self, model: LlamaForCausalLM, cache: CacheConfig | None = None,
                 scheduler: SchedulerConfig | None = None, speculative: SpeculativeConfig | None = None,
                 connector: KVConnector | None = None, draft_model: LlamaForCausalLM | None = None,
                 parallel: ParallelLaunch | None = None) -> None:
        """``parallel``: the model runs in T x P rank processes (``model`` is then its weightless skeleton)."""
        cache = cache or CacheConfig()
        scheduler = scheduler or SchedulerConfig()
        # The KV dtype is the activations', whatever the weights are packed in; a draft model's KV shares the
        # target's block ids, so each block costs both.
        block_bytes = kv_cache_spec(model, cache.block_size).bytes_per_block(model.dtype.itemsize)
        if draft_model is not None:
            block_bytes += kv_cache_spec(draft_model, cache.block_size).bytes_per_block(draft_model.dtype.itemsize)
        num_blocks = cache.resolve_num_blocks(block_bytes)
        self.model_config = model.config
        self.block_size = cache.block_size
        self.connector = connector or KVConnector()
        self.num_steps = self.step_prefill_tokens = self.step_decode_tokens = 0
        self.step_seconds = 0.0
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.kv.window = _kv_window(model, draft_model, speculative)
        # A sequence must fit in the cache on its own, or it could only ever preempt itself; with a window on every
        # layer it holds only the window and one chunk (validate checks Scheduler.peak_blocks), however long.
        self.max_model_len = scheduler.max_model_len or model.config.max_position_embeddings
        if self.kv.window is None:
            self.max_model_len = min(self.max_model_len, num_blocks * cache.block_size)
        self.scheduler = Scheduler(scheduler, self.kv, self.max_model_len, self.connector, speculative)
        if parallel is not None:
            from common.parallel.executor import ParallelModelRunner

            self.runner: ModelRunner = ParallelModelRunner(parallel, model, cache.block_size, num_blocks,
                                                           scheduler.max_num_seqs, speculative, draft_model)
        else:
            graphs = None
            if next(model.parameters()).device.type == "cuda" and not scheduler.enforce_eager:
                graphs = DecodeGraphSpec(scheduler.max_num_seqs, self.max_model_len)
            self.runner = ModelRunner(model, cache.block_size, num_blocks, speculative, draft_model,
                                      decode_graphs=graphs)
        self._kv_event_sink: KVEventSink | None = None  # set by SetKVEventSink while someone subscribes
        # Requests added before their KV destination (AddRequest.awaits_destination), until AttachDestination:
        # computing, by id -> prompt tokens; parked (not added yet: see _add_awaiting), by id -> the command.
        self._awaiting: dict[str, int] = {}
        self._parked: dict[str, AddRequest] = {}
        self.offload: OffloadTier | SharedTier | None = None
        if cache.kv_offload != "none":
            self.offload = self._offload_tier(cache, model, draft_model is not None)
            self.kv.set_offload(self.offload)

    # ---- commands --------------------------------------------------------------------------------

    def handle(self, command: EngineCommand[R]) -> R:
        """Apply one command between steps (on the engine thread) and return its typed reply."""
        try:
            return cast(R, self._dispatch(command))
        finally:
            self.publish_kv_events()  # a reservation or a release can evict or free cached blocks

    def _dispatch(self, command: EngineCommand[Any]) -> object:
        match command:
            case AddRequest():
                self._check_queue()
                if command.destination is not None:  # blocks a transfer reads are held beyond the window
                    self._check_sent_blocks(len(command.prompt_token_ids), command.destination.skip_blocks)
                if command.awaits_destination:
                    self._add_awaiting(command)
                    return None
                self.add_request(command.request_id, list(command.prompt_token_ids), command.params,
                                 command.eos_token_ids)
                if command.destination is not None:
                    self.connector.attach(command.request_id, command.destination, command.chunk_timings)
                return None
            case AttachDestination():
                return self._attach_destination(command)
            case AbortRequest():
                return self.abort(command.request_id)
            case ReserveKV():
                self.reserve(command)
                return None
            case SetKVEventSink():
                self._set_kv_event_sink(command)
                return None
            case SnapshotKVBlocks():
                self.publish_kv_events()
                sequence = self._kv_event_sink.last_sequence if self._kv_event_sink is not None else 0
                return KVSnapshot(tuple(self.kv.pool.cached_hashes()), self.kv.pool.digest, sequence)
            case PrepareKernels():
                from common.kernels.cpu import paged_decode_kernel

                ready = command.decode and paged_decode_kernel() is not None
                self._warm_gemm_buckets()
                return ready
        raise TypeError(f"unknown engine command {command!r}")

    def _warm_gemm_buckets(self) -> None:
        """oneDNN's bf16 GEMM kernels for every row bucket a step can reach, built now (a first step at a new
        bucket cost 15-20 ms more in session 33) on the thread that steps."""
        from common.model.gemv import warm_onednn_buckets

        config = self.scheduler.config
        max_rows = max(config.max_num_batched_tokens, config.backlog_budget[0] if config.backlog_budget else 0)
        started = time.perf_counter()
        calls = warm_onednn_buckets(self.runner.model, max_rows)
        threads = self.runner.model.layer_threads
        if threads is not None:
            with threads.borrowing():  # and at the thread count of the layers run on a decode node's cores
                calls += warm_onednn_buckets(self.runner.model, max_rows)
        if calls:
            log.info("oneDNN's GEMM warmed at %d row counts up to %d rows in %.2f s", calls, max_rows,
                     time.perf_counter() - started)

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
        # With a window on every layer a request holds its window and one chunk, however long (peak_blocks).
        if self.scheduler.peak_blocks(len(prompt_token_ids) + 1) > self.kv.pool.num_blocks:
            raise InvalidRequestError("prompt", f"{len(prompt_token_ids)} tokens exceed the KV cache "
                                      f"({self.kv.pool.num_blocks} blocks of {self.kv.block_size})")

    def _check_sent_blocks(self, num_prompt_tokens: int, skip_blocks: int) -> None:
        need = self.scheduler.peak_blocks(num_prompt_tokens, keep_from=skip_blocks)
        if need > self.kv.pool.num_blocks:
            raise InvalidRequestError("destination.first_block", f"sending the prompt's blocks from block "
                                      f"{skip_blocks} on needs {need} KV blocks here at once; this node has "
                                      f"{self.kv.pool.num_blocks}")

    def _add_awaiting(self, command: AddRequest) -> None:
        """A request whose destination comes later (``AttachDestination``). Until then every block it computes is
        kept (any may be sent): with a window on every layer a prompt whose blocks the pool cannot hold all at once
        is parked instead, and added once its destination says which blocks need not be kept."""
        prompt = list(command.prompt_token_ids)
        if self.scheduler.peak_blocks(len(prompt), keep_from=0) > self.kv.pool.num_blocks:
            self.validate(prompt, command.params)
            self._check_new_id(command.request_id)
            self._parked[command.request_id] = command
            return
        self.add_request(command.request_id, prompt, command.params, command.eos_token_ids)
        self.connector.await_destination(command.request_id, command.chunk_timings)
        self._awaiting[command.request_id] = len(prompt)

    def _attach_destination(self, command: AttachDestination) -> bool:
        """Where an awaiting (or parked) request's KV goes; False if the request is gone (aborted). A destination
        this node cannot serve raises, and the request stays awaiting (its servicer aborts it)."""
        rid, dest = command.request_id, command.destination
        parked = self._parked.get(rid)
        num_tokens = len(parked.prompt_token_ids) if parked is not None else self._awaiting.get(rid)
        if num_tokens is None:
            return False
        self._check_sent_blocks(num_tokens, dest.skip_blocks)
        if parked is not None:
            del self._parked[rid]
            self.add_request(rid, list(parked.prompt_token_ids), parked.params, parked.eos_token_ids)
            self.connector.attach(rid, dest, parked.chunk_timings)
            return True
        del self._awaiting[rid]
        self.connector.attach_destination(rid, dest)
        return True

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    eos_token_ids: tuple[int, ...] = ()) -> None:
        self.validate(prompt_token_ids, params)
        self._check_new_id(request_id)
        self.scheduler.add_request(Request(request_id, list(prompt_token_ids), params, tuple(eos_token_ids)))

    def reserve(self, command: ReserveKV) -> None:
        """Blocks for a prompt whose KV another node computes (reusing this node's prefix cache) now, when
        they are free beside those the queued requests need; else the request queues for them. Either way
        they are announced on the request's stream (``take_announced``, or the step that admits it)."""
        prompt = list(command.prompt_token_ids)
        self.validate(prompt, command.params)
        self._check_new_id(command.request_id)
        request = Request(command.request_id, prompt, command.params, tuple(command.eos_token_ids),
                          remote_prefill=True)
        if self.scheduler.admit_now(request) is None:  # ahead of the queue only where nobody waits longer
            self._check_queue()
            self.scheduler.add_request(request)
        self.connector.track_load(command.request_id, command.transfer_id)

    def take_announced(self) -> list[RequestOutput]:
        """Reservations made outside a step (by ``ReserveKV``): their outputs, for the requests' streams."""
        return self.scheduler.take_announced()

    def _check_new_id(self, request_id: str) -> None:
        if (self.kv.has_request(request_id) or request_id in self._parked
                or any(r.request_id == request_id for r in self.scheduler.waiting)):
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use on this node")

    def _check_queue(self) -> None:
        limit = self.scheduler.config.max_waiting
        if len(self.scheduler.waiting) >= limit:
            raise QueueFullError(f"{len(self.scheduler.waiting)} requests already wait for admission "
                                 f"(the limit is max_waiting = {limit})")

    def abort(self, request_id: str) -> bool:
        self.runner.forget(request_id)
        self.connector.forget(request_id)
        self._awaiting.pop(request_id, None)
        parked = self._parked.pop(request_id, None) is not None
        return self.scheduler.abort(request_id) is not None or parked

    # ---- the loop --------------------------------------------------------------------------------

    def step(self, publish_kv_events: bool = True) -> list[RequestOutput]:
        """One iteration: schedule -> run the model and sample -> append tokens and stop.

        ``publish_kv_events=False``: the caller hands the outputs on first and then calls
        ``publish_kv_events`` (the serving loop: a KV event's fan-out is not on any request's critical path)."""
        start_ns = time.time_ns()
        arrived = self._finish_transfers()
        scheduled = self.scheduler.schedule()
        sampled = None
        if not scheduled.is_empty:
            started = time.perf_counter()
            sampled = self.runner.execute(scheduled)
            self._count_step(scheduled, time.perf_counter() - started)
        self.connector.save_kv(scheduled, start_ns)
        outputs = arrived + self.scheduler.update(scheduled, sampled)
        for out in outputs:
            if out.finished:
                self.runner.forget(out.request_id)
        if publish_kv_events:
            self.publish_kv_events()
        return outputs

    def _finish_transfers(self) -> list[RequestOutput]:
        """Apply the transfers the connector saw end since the last step: a send's held blocks are freed, a
        failed load's request aborted, a landed one starts decoding (its output: the prefill's first token)."""
        done = self.connector.get_finished()
        if not done:
            return []
        for rid in done.sent:
            self.connector.forget(rid)
            self.scheduler.free_held(rid)
        for rid, reason in done.failed:
            log.info("request %s: its KV transfer failed (%s); aborted, blocks freed", rid, reason)
            self.abort(rid)
        return [self.scheduler.kv_arrived(rid, token) for rid, token in done.loaded
                if rid in self.scheduler.waiting_for_kv]

    def _count_step(self, scheduled: SchedulerOutput, seconds: float) -> None:
        """The step counters (``tandem:engine_*``): forwards, their seconds, and the tokens they computed
        (prefill: prompt tokens; decode: the tokens past the prompt, draft slots included)."""
        self.num_steps += 1
        self.step_seconds += seconds
        prefill = sum(max(0, min(c.start + c.num_tokens, c.request.num_prompt_tokens) - c.start)
                      for c in scheduled.chunks)
        self.step_prefill_tokens += prefill
        self.step_decode_tokens += scheduled.num_tokens - prefill  # num_tokens counts the draft slots

    def publish_kv_events(self) -> None:
        # One attribute test per step when nobody subscribes.
        if self._kv_event_sink is not None:
            batch = self.kv.drain_events()
            if batch is not None:
                self._kv_event_sink.publish(batch)

    def _set_kv_event_sink(self, command: SetKVEventSink) -> None:
        self._kv_event_sink = command.sink
        if command.sink is None:
            self.kv.disable_events()
        else:
            self.kv.enable_events(command.capacity)

    def _offload_tier(self, cache: CacheConfig, model: LlamaForCausalLM, drafts: bool) -> OffloadTier | SharedTier:
        """The KV offload tier under the pool (``--kv-offload``); refused where a draft model keeps its own KV at
        the same block ids (the tier would restore the target's KV without the draft's). ``shared``: the directory
        every node of the deployment reads and writes (common/kv/shared_tier.py), namespaced by this model."""
        import tempfile
        from pathlib import Path

        from common.kv.offload import OffloadTier

        if drafts:
            raise ValueError("--kv-offload with --speculative draft_model is not supported: the draft model's KV "
                             "at the same blocks is not offloaded")
        if cache.kv_offload == "shared":
            from common.kv.shared_tier import SharedTier, model_fingerprint

            return SharedTier(self.runner.kv_cache, Path(cache.kv_offload_dir), cache.kv_offload_gb,
                              model_fingerprint(model))
        directory = Path(cache.kv_offload_dir or tempfile.gettempdir())
        return OffloadTier.create(cache.kv_offload, self.runner.kv_cache, cache.kv_offload_gb, directory)

    def close(self) -> None:
        """Stop what the engine started (a parallel node's rank processes, the offload tier's file)."""
        self.runner.close()
        if self.offload is not None:
            self.kv.set_offload(None)
            self.offload.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self.connector.finished)

    def stats(self) -> EngineStats:
        kv = self.kv
        return EngineStats(
            num_blocks=kv.pool.num_blocks, free_blocks=kv.num_free_blocks, used_blocks=kv.num_used_blocks,
            block_size=kv.block_size, num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_waiting,
            prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
            offload_hits=kv.offload_hits, offload_blocks=len(self.offload) if self.offload is not None else 0,
            kv_shared_tier=getattr(self.offload, "id", ""),
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps, step_seconds=self.step_seconds,
            step_prefill_tokens=self.step_prefill_tokens, step_decode_tokens=self.step_decode_tokens,
            peak_used_blocks=kv.pool.peak_used_blocks,
        )


@dataclass(frozen=True)
class EngineStats:
    num_blocks: int
    free_blocks: int
    used_blocks: int
    block_size: int
    num_running: int
    num_waiting: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int = 0  # forwards run (steps with scheduled work)
    step_seconds: float = 0.0  # their time: model, sampling and the runner's inputs
    step_prefill_tokens: int = 0  # prompt tokens they computed
    step_decode_tokens: int = 0  # decode tokens (draft slots included) they computed
    offload_hits: int = 0  # prompt tokens restored from the offload tier (a part of prefix_cache_hits)
    offload_blocks: int = 0  # blocks the offload tier holds
    peak_used_blocks: int = 0  # the most blocks requests held at once since the engine started
    kv_shared_tier: str = ""  # the shared offload tier's id (common/kv/shared_tier.py); "": none


class ColocatedEngine(EngineCore):
    """Prefill and decode in one process (Sarathi-Serve style mixed batches): the base connector."""


def _kv_window(model: LlamaForCausalLM, draft_model: LlamaForCausalLM | None,
               speculative: SpeculativeConfig | None = None) -> int | None:
    """The window past which a request's KV blocks are freed early (KVCacheManager.window), or None.

    Only when every layer is windowed (a model with any full-attention layer reads every block), on every role
    and in T x P ranks too (a freed slot travels to them as NULL_BLOCK): a decode node reserves no block for the
    prompt's leading blocks outside the window at its first query and frees the rest as decoding moves on; a
    prefill node frees a chunked prompt's dead blocks as it goes, but never one its KV transfer still reads
    (``KVConnector.kv_read_from``: it sends only the blocks the decode node's window reads).

    With a draft model, every layer of the draft must be windowed too (it writes its KV through the same block
    tables and reads its own window); the window then also covers the draft's usual lag behind the target (it
    catches up from the last token it computed, at most the step's drafts behind), so it rarely finds its window
    freed; when it does (its first step after a chunked prompt, or after speculation paused), it starts again from
    the first block the table still holds (``DraftModelProposer``).
    """
    windows = list(model.config.layer_windows or ())
    if draft_model is not None:
        windows += list(draft_model.config.layer_windows or ()) or [None]
    if not windows or any(w is None for w in windows):
        return None
    window = max(w for w in windows if w is not None)
    if draft_model is not None:
        window += (speculative.num_speculative_tokens if speculative is not None else 0) + 1
    return window

"""Pure-decode steps as CUDA graphs, one per batch-size bucket (vLLM's CUDAGraphRunner, in Tandem's terms).

A decode step's forward launches hundreds of small kernels; at small batch the GPU waits on the host that
launches them. A graph captured once per bucket replays them all in one launch. What a captured forward reads
lives in static buffers, sized for the largest bucket: token ids, positions, sequence lengths, slot mapping and
block tables padded to the width of the longest sequence the engine admits. A step copies its inputs into
them, pads its batch up to the bucket (padding rows: length 1 in the pad block, a block of the KV cache no
request owns, so their K/V writes land nowhere that is read), replays, and slices its rows off the output.

Only pure decode steps of at most the largest bucket's rows run here; prefill, chunked prefill, speculative
verification (more than one row per sequence) and larger batches run eager. The metadata a captured forward
sees is built from the static buffers alone; its host-side lengths are the table's capacity, so nothing in the
captured region reads a step's real lengths on the host (a kernel masks by the ``seq_lens`` tensor). A backend
whose forward needs real host lengths (``AttentionBackend.capturable`` False: the torch backend's per-sequence
loops, FlashInfer's host-side plan) is declined at start, logged once, and every step runs eager.

Without CUDA (``capture=False``) the same static-buffer path runs eagerly: each "replay" calls the forward on
the static buffers, with the step's real host lengths (padding rows: 1), so tests on CPU check that padded
static buffers give the eager forward's logits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from common.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    from common.engine.flat_batch import FlatBatch
    from common.kv.kv_cache import KVCache
    from common.model.llama import LlamaDecoderLayer, LlamaForCausalLM

log = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """The captured batch sizes: 1, 2, 4, 8, then every multiple of 16, up to and including ``max_batch``
    (itself a bucket when it is none of those, so every batch up to it has one)."""
    assert max_batch >= 1
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch]
    sizes.extend(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return tuple(sizes)


@dataclass(frozen=True)
class DecodeGraphSpec:
    """What the engine tells the runner to capture: batches up to ``max_batch`` sequences (the scheduler's
    max_num_seqs), each at most ``max_model_len`` tokens long (the block tables' fixed width follows)."""

    max_batch: int
    max_model_len: int

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"decode graphs' max_batch must be >= 1, got {self.max_batch}")
        if self.max_model_len < 1:
            raise ValueError(f"decode graphs' max_model_len must be >= 1, got {self.max_model_len}")


def capture_refusal(model: LlamaForCausalLM) -> str | None:
    """Why the model's decode forward cannot be captured, or None when it can."""
    if model.config.moe is not None:
        return "MoE routing reads its experts' row counts on the host"
    if model.config.embed_scale is not None:
        return "the embedding scale is made from a host number in every forward"
    backend = cast("LlamaDecoderLayer", model.layers[0]).self_attn.backend  # every layer shares the model's
    if not backend.capturable:
        return f"attention backend {backend.name!r} reads host-side lengths per step"
    if model.decode_step is not None:
        return "the one-call CPU decode step is not capturable"
    return None


class DecodeGraphs:
    """Static buffers and one graph per bucket for the pure-decode forward of ``model`` over ``kv_cache``.

    ``pad_block``: a block of ``kv_cache`` that no request is ever given (padding rows write there).
    ``capture``: record CUDA graphs (on CUDA only); False runs the static-buffer forward eagerly per step.
    """

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, block_size: int, spec: DecodeGraphSpec,
                 pad_block: int, capture: bool) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.pad_block = pad_block
        self.buckets = batch_buckets(spec.max_batch)
        self.max_batch = self.buckets[-1]
        self.width = -(-spec.max_model_len // block_size)  # block-table columns: the longest sequence's blocks
        self.capture = capture
        device = kv_cache.data.device
        n = self.max_batch
        # The static inputs: every captured kernel reads these addresses, a step only overwrites them.
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # decode: one row each
        self.block_tables = torch.full((n, self.width), pad_block, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((n,), pad_block * block_size, dtype=torch.int64, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # bucket -> its graph's hidden states [bucket, hidden]
        self._pool: _POOL_HANDLE | None = None  # one memory pool shared by every bucket's graph
        self.num_replays = 0

    @property
    def captured_buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest bucket holding ``num_seqs`` sequences; None above the largest."""
        return next((b for b in self.buckets if b >= num_seqs), None)

    def applies(self, batch: FlatBatch) -> bool:
        """A pure decode step (one row per sequence, every sequence with cached context) that fits a bucket and
        the tables' width: anything else runs eager."""
        n = len(batch.query_lens)
        return (1 <= n <= self.max_batch and all(q == 1 for q in batch.query_lens)
                and all(c >= 1 for c in batch.context_lens) and all(len(t) <= self.width for t in batch.tables))

    def _meta(self, bucket: int, seq_lens_cpu: tuple[int, ...]) -> AttentionMetadata:
        """Metadata over the static buffers' first ``bucket`` rows (views: no copies, no host syncs)."""
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            context_lens=self.context_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            slot_mapping=self.slot_mapping[:bucket],
            query_lens_cpu=(1,) * bucket,
            seq_lens_cpu=seq_lens_cpu,
        )

    def step_meta(self, batch: FlatBatch) -> AttentionMetadata:
        """The last step's metadata, its own rows only (views of the static buffers ``run`` filled)."""
        return self._meta(len(batch.query_lens), tuple(p + 1 for p in batch.positions))

    def _forward(self, bucket: int, seq_lens_cpu: tuple[int, ...]) -> torch.Tensor:
        return self.model(self.input_ids[:bucket], self.positions[:bucket], self._meta(bucket, seq_lens_cpu),
                          self.kv_cache)

    def _load(self, batch: FlatBatch, bucket: int) -> None:
        """Copy the step's inputs into the static buffers; rows ``len(batch) .. bucket`` become padding."""
        n = len(batch.query_lens)
        device = self.input_ids.device
        # Only the columns this step's longest table reaches: a row's kernel reads no block past its length, so
        # what older steps left further right is never read. A slot freed outside a sliding window (NULL_BLOCK,
        # -1) reads as block 0: the window masks it.
        used = max(len(t) for t in batch.tables)
        pad_row = [self.pad_block] * used
        tables = torch.tensor([[max(b, 0) for b in t] + pad_row[len(t):] for t in batch.tables]
                              + [pad_row] * (bucket - n), dtype=torch.int32)
        slots = [t[p // self.block_size] * self.block_size + p % self.block_size
                 for t, p in zip(batch.tables, batch.positions, strict=True)]
        pad = bucket - n
        host = torch.tensor([batch.input_ids + [0] * pad, batch.positions + [0] * pad,
                             slots + [self.pad_block * self.block_size] * pad], dtype=torch.int64)
        lens = torch.tensor([[p + 1 for p in batch.positions] + [1] * pad, batch.context_lens + [0] * pad],
                            dtype=torch.int32)
        non_blocking = device.type == "cuda"
        self.input_ids[:bucket].copy_(host[0], non_blocking=non_blocking)
        self.positions[:bucket].copy_(host[1], non_blocking=non_blocking)
        self.slot_mapping[:bucket].copy_(host[2], non_blocking=non_blocking)
        self.seq_lens[:bucket].copy_(lens[0], non_blocking=non_blocking)
        self.context_lens[:bucket].copy_(lens[1], non_blocking=non_blocking)
        self.block_tables[:bucket, :used].copy_(tables, non_blocking=non_blocking)

    def run(self, batch: FlatBatch) -> torch.Tensor | None:
        """The step's hidden states ``[num_seqs, hidden]``, through its bucket's graph (captured on first use)
        or, without capture, the static-buffer forward run eagerly. ``applies(batch)`` must hold.

        None when the bucket's capture fails (logged): the caller runs the step, and every later one, eager.
        The failed attempt's forwards wrote the step's own K/V into its own slots, which the eager run rewrites."""
        n = len(batch.query_lens)
        bucket = self.bucket(n)
        assert bucket is not None and self.applies(batch)
        self._load(batch, bucket)
        if not self.capture:
            self.num_replays += 1
            return self._forward(bucket, tuple(p + 1 for p in batch.positions) + (1,) * (bucket - n))[:n]
        graph = self._graphs.get(bucket)
        if graph is None:
            try:
                graph = self._capture(bucket)
            except Exception as exc:  # an op that syncs or allocates from the host under capture, an old driver
                log.warning("CUDA graph capture of the batch-%d decode step failed (%s: %s); decode steps run eager",
                            bucket, type(exc).__name__, exc)
                return None
        graph.replay()
        self.num_replays += 1
        return self._outputs[bucket][:n]

    def _capture(self, bucket: int) -> torch.cuda.CUDAGraph:
        # Host lengths at the tables' capacity: the split heuristic and the rotary table see the longest case,
        # the kernels mask by the seq_lens buffer.
        capacity = (self.width * self.block_size,) * bucket
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside capture: lazy tables, Triton's compile, allocator
            for _ in range(2):
                self._forward(bucket, capacity)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # thread_local: a capture mid-serving must not fail (or fail) another thread's CUDA calls (KV transfer,
        # the offload tier's copies); only this thread's unsafe calls are refused while it captures.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._outputs[bucket] = self._forward(bucket, capacity)
        self._graphs[bucket] = graph
        return graph

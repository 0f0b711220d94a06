"""Engine settings: KV cache size and scheduling limits, as frozen dataclasses.

These fields are where the engine's defaults live. A field made with ``knob`` is also a setting: nodes and
the offline ``LLM`` read it from the flag ``--<field>`` and the variable ``TANDEM_<FIELD>``, generated from the
field (``common.config.settings.EngineSettings``) with its default, help and choices. The step budget's
default depends on the device; ``scheduler_config`` resolves it, for every entry point.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

PREFILL_ORDERS = ("shortest", "fcfs")


def knob(default: Any, help: str, choices: tuple[Any, ...] = ()) -> Any:
    """A config field that is also a setting: its default, the text ``--help`` shows, its choices (checked
    where the setting is read, named by flag and variable)."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = knob(16, "tokens per KV block (a power of two)")
    num_blocks: int | None = knob(None, "blocks in the paged KV cache (unset or 0: derived from "
                                        "--kv-cache-memory-gb and the model's bytes per block)")
    kv_cache_memory_gb: float = knob(1.0, "GiB of KV cache when --num-blocks is unset")
    enable_prefix_caching: bool = knob(True, "reuse cached full blocks of a prompt's prefix")
    # The tier under the pool (common/kv/offload.py): evicted full blocks kept by their prefix-cache hash and
    # restored on a hit instead of recomputed.
    kv_offload: str = knob("none", "KV offload tier under the pool: none | cpu (host memory) | disk (a file) | "
                           "shared (block files in --kv-offload-dir that every node of the deployment reads)",
                           ("none", "cpu", "disk", "shared"))
    kv_offload_gb: float = knob(4.0, "GiB of the KV offload tier (shared: of the blocks this node writes there)")
    kv_offload_dir: str = knob("", "directory of the disk tier's file ('': the system's temporary directory); "
                                   "shared: the directory the deployment's nodes share (required)")

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.kv_offload not in ("none", "cpu", "disk", "shared"):
            raise ValueError(f"kv_offload must be none, cpu, disk or shared, got {self.kv_offload!r}")
        if self.kv_offload == "shared" and not self.kv_offload_dir:
            raise ValueError("kv_offload shared needs kv_offload_dir: the directory every node of the deployment "
                             "shares (one host, or a shared filesystem)")
        if self.kv_offload != "none" and self.kv_offload_gb <= 0:
            raise ValueError(f"kv_offload_gb must be > 0, got {self.kv_offload_gb}")
        if self.kv_offload != "none" and not self.enable_prefix_caching:
            raise ValueError("kv_offload needs prefix caching: the tier is indexed by the prefix cache's block hashes")

    def resolve_num_blocks(self, bytes_per_block: int) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        return max(1, int(self.kv_cache_memory_gb * 2**30) // bytes_per_block)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = knob(128, "running requests (sequences per step)")
    # The step budget: what a GPU gets by default; other devices' defaults are DEVICE_STEP_BUDGETS'.
    max_num_batched_tokens: int = knob(2048, "tokens per step: decode tokens + prefill chunks")
    # A single prefill chunk takes at most this many tokens, so one long prompt cannot hold decodes back
    # for a whole step (Sarathi-Serve's stall-free batching). None: limited by the step budget only.
    max_prefill_chunk: int | None = knob(512, "tokens per prefill chunk")
    # Load-aware: (tokens per step, prefill chunk) for the steps that find more prompt tokens still to prefill
    # (queued or part-done) than max_num_batched_tokens. A backlog waits in the queue whatever the step size, and
    # larger steps drain it faster (bigger matmuls); a light load keeps the small steps its streams' TPOT needs.
    # A step in which no running request decodes takes the backlog's tokens with no chunk limit (nothing to keep
    # short: a prompt alone goes whole). None: the budget above, always.
    backlog_budget: tuple[int, int] | None = None
    # A request of at most this many tokens gets those it has left to prefill in one chunk where the step's
    # budget holds them, whatever max_prefill_chunk says (vLLM schedules a prompt that fits its step whole):
    # splitting it adds a step and re-reads the first part's KV, and its decodes wait as long either way. A longer
    # prompt keeps the chunk limit to its last token (its tail too). None: never.
    whole_prefill: int | None = None
    # Which prefill gets the step's budget first (common/engine/scheduler.py): "shortest" (fewest uncomputed
    # tokens; a prompt passed over max_prefill_skips steps in a row by later arrivals goes first) or "fcfs".
    prefill_order: str = knob("shortest", "which prompt's prefill goes first: shortest (fewest tokens left; one "
                              "passed over too many steps in a row goes first) | fcfs (arrival order)",
                              PREFILL_ORDERS)
    max_prefill_skips: int = 8
    # A waiting request whose prompt shares full blocks with what another request computes in this step waits a
    # step and takes them from the prefix cache instead of computing them beside it (SGLang's in-batch prefix
    # caching; common/engine/scheduler.py). Nothing to share without prefix caching.
    defer_shared_prefill: bool = knob(True, "a waiting prompt whose prefix another request computes in this step "
                                            "waits a step and reuses it from the prefix cache")
    # Keep this fraction of blocks free when admitting new work, so running requests can grow without
    # preempting each other straight away.
    watermark: float = 0.01
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # Requests queued for admission (a decode node's pending reservations included); one more is refused.
    max_waiting: int = knob(1024, "requests queued for admission (a decode node's reservations included); one "
                            "more is refused (RESOURCE_EXHAUSTED)")
    # vLLM's name. On CUDA, pure decode steps of up to max_num_seqs sequences replay CUDA graphs captured per
    # batch-size bucket (common/engine/cuda_graphs.py); on other devices every step is eager whatever this says.
    enforce_eager: bool = knob(False, "run every step eager: no CUDA graphs for decode steps (CUDA only)")

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.backlog_budget is not None and min(self.backlog_budget) < 1:
            raise ValueError(f"backlog_budget must be two numbers >= 1, got {self.backlog_budget}")
        if self.whole_prefill is not None and self.whole_prefill < 1:
            raise ValueError(f"whole_prefill must be >= 1, got {self.whole_prefill}")
        if self.max_prefill_chunk is not None and self.max_prefill_chunk < 1:
            raise ValueError(f"max_prefill_chunk must be >= 1, got {self.max_prefill_chunk}")
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"prefill_order must be one of {', '.join(PREFILL_ORDERS)}, got {self.prefill_order!r}")
        if self.max_prefill_skips < 1:
            raise ValueError(f"max_prefill_skips must be >= 1, got {self.max_prefill_skips}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


# The step budget by device where none is set (max_num_batched_tokens, max_prefill_chunk). On a CPU core a step
# with 2,048 tokens of prefill takes well past a TPOT SLO (SmolLM2, bf16), and every stream on the node waits
# for it: 512 / 256 kept the mixed workload's TPOT p99 under its 200 ms SLO and cut short chats' TTFT under
# issue 16's burst, at the same throughput (benchmarks/results/2026-12-02-srpt/RESULTS.md). Other devices
# (GPUs) take SchedulerConfig's defaults, vLLM's 2,048 (their step time is flat well past it).
DEVICE_STEP_BUDGETS: dict[str, tuple[int, int]] = {"cpu": (512, 256)}
# ... and while a backlog of prompt tokens waits (SchedulerConfig.backlog_budget), a larger one: with 48
# requests of 384 -> 128 tokens at once (SmolLM2 fp32, 2 AVX2 cores, vLLM's client), 2,048 / 512 served more
# output tokens a second than 512 / 256 (2026-12-03: benchmarks/results/2026-12-03-serve-vllm/RESULTS.md,
# benchmarks/results/figures-from-code.md). Its chunk limit is the step (a prompt of up to 2,048 tokens goes
# whole, as in vLLM's 2,048-token steps): 512-token chunks split a long prompt over four steps, each paying the
# running decodes again, and under vLLM's client at 4 req/s (SmolLM2 bf16, 2-core Xeon, alternating, 2 rounds)
# 2,048 / 2,048 against 2,048 / 512 took the mixed workload's TTFT p99 from 1.88x to 1.31x vLLM's, 384 -> 128's
# TTFT p50 from 1.20x to 0.99x and its TPOT p50 from 0.90x to 0.76x (benchmarks/results/2026-12-06-fused-rounding).
# A budget that is set is used as it is, whatever the load.
DEVICE_BACKLOG_BUDGETS: dict[str, tuple[int, int]] = {"cpu": (2048, 2048)}
# ... and a prompt of up to 512 tokens (the light step) is not split by its 256-token chunk limit
# (SchedulerConfig.whole_prefill): with 384 -> 128 tokens at 0.6 req/s under vLLM's client (SmolLM2 fp32, 2-core
# Xeon, alternating runs) a prompt took 1.96-2.04 steps and its prefill 522-546 ms in the engine, against 1.12-1.17
# steps and 427-445 ms whole.
DEVICE_WHOLE_PREFILL: dict[str, int] = {"cpu": 512}


def scheduler_config(device: str, max_num_batched_tokens: int | None = None, max_prefill_chunk: int | None = None,
                     **fields: Any) -> SchedulerConfig:
    """The scheduler's config for an engine on ``device`` (``cpu``, ``cuda:1``, ...): the one place the step
    budget's default is resolved, for nodes, ``tandem serve colocated``, the offline ``LLM`` and the planner.

    A budget field that is given is used as given; one that is not (None) is the device's
    (``DEVICE_STEP_BUDGETS``, else SchedulerConfig's default); and when neither is given, the device's load-aware
    backlog budget and whole-prompt size apply too (``DEVICE_BACKLOG_BUDGETS``, ``DEVICE_WHOLE_PREFILL``).
    ``fields``: SchedulerConfig's other fields.
    """
    kind = device.split(":")[0]
    tokens, chunk = DEVICE_STEP_BUDGETS.get(kind, (SchedulerConfig.max_num_batched_tokens,
                                                   SchedulerConfig.max_prefill_chunk))
    if max_num_batched_tokens is None and max_prefill_chunk is None:
        fields.setdefault("backlog_budget", DEVICE_BACKLOG_BUDGETS.get(kind))
        fields.setdefault("whole_prefill", DEVICE_WHOLE_PREFILL.get(kind))
    return SchedulerConfig(max_num_batched_tokens=tokens if max_num_batched_tokens is None else max_num_batched_tokens,
                           max_prefill_chunk=chunk if max_prefill_chunk is None else max_prefill_chunk, **fields)


class SpeculativeMethod(enum.Enum):
    NONE = "none"
    NGRAM = "ngram"  # prompt lookup: propose what followed the latest earlier match of the last n tokens
    DRAFT_LAYERS = "draft_layers"  # the target's first L layers + final norm + LM head as the draft model
    DRAFT_MODEL = "draft_model"  # a separate small model (or the target, quantized) with its own paged KV


@dataclass(frozen=True)
class DraftEconomics:
    """What adaptive k assumes about a proposer's drafts (``common.spec_decode.policy.adaptive_num_drafts``)."""

    # One more draft in a step, relative to a plain decode step at small batch.
    cost: float
    # P(draft j + 1 accepted | drafts 1..j were). None: as likely as the first draft (independent drafts).
    continuation: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.cost < 1.0:
            raise ValueError(f"draft cost must be in (0, 1), got {self.cost}")
        if self.continuation is not None and not 0.0 < self.continuation <= 1.0:
            raise ValueError(f"draft continuation must be in (0, 1], got {self.continuation}")


# Priors, measured with SmolLM2 on a 2-core CPU (benchmarks/bench_speculative.py). While serving, the
# runner measures a draft's real cost at batch 1 (common/spec_decode/draft_cost.py) and each request its own
# continuation, and those replace the priors; SpeculativeConfig.economics pins a cost instead. An n-gram
# draft only adds a query row to the verification forward, which at small batch is bound by reading the
# weights: a few percent of a step per row (more on a CPU whose fast memory leaves more to compute, as on a
# 2-core Zen 5: benchmarks/results/2026-12-01-zen5/RESULTS.md). Its drafts come in runs: a proposal whose
# first token is right is usually a span being copied, and each next draft is then mostly accepted. An
# early-layer draft runs L target layers and the LM head once more per draft (a third of a step or more),
# and its drafts are roughly independent. The measured priors: benchmarks/results/figures-from-code.md.
DEFAULT_DRAFT_ECONOMICS: dict[SpeculativeMethod, DraftEconomics] = {
    SpeculativeMethod.NGRAM: DraftEconomics(cost=0.03, continuation=0.9),
    SpeculativeMethod.DRAFT_LAYERS: DraftEconomics(cost=0.3, continuation=None),
    # A separate draft model: one of its decode steps per draft (the target quantized to int4: a large share of
    # a target step on a CPU, benchmarks/results/2026-12-01-zen5/RESULTS.md). A draft that agrees with the
    # target on one token mostly agrees on the next.
    SpeculativeMethod.DRAFT_MODEL: DraftEconomics(cost=0.3, continuation=0.9),
}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: SpeculativeMethod = SpeculativeMethod.NONE
    num_speculative_tokens: int = 4  # the most drafts per request per step (k)
    ngram_min_n: int = 1
    ngram_max_n: int = 4
    draft_layers: int = 8  # DRAFT_LAYERS: how many of the target's first layers draft
    # DRAFT_MODEL: a Llama-family directory (or the bundled model's name) with the target's tokenizer, and the
    # quantization its weights load with (the target itself as int4 is a cheap draft that agrees with it).
    draft_model: str = ""
    draft_quantization: str = "none"
    # DRAFT_MODEL: look the continuation up in the request's own tokens first (n-gram, free) and run the draft
    # model only for requests where the lookup finds nothing (input-grounded text: long exact runs for free).
    ngram_first: bool = False
    # ... taking the lookup's drafts only after a match of at least this many tokens: a 1-token match's first
    # draft is mostly rejected, a 3+-token match's is accepted nearly as often as the int4 self-draft's
    # (measured: benchmarks/results/figures-from-code.md).
    ngram_first_min_n: int = 3
    # ... and proposing up to this many tokens (None: num_speculative_tokens). A lookup's drafts cost only
    # their verification, so a long copied span can run past the draft model's k (input-grounded text).
    ngram_first_max_tokens: int | None = None
    # Above this many decoding requests a step is compute-bound and speculation stops paying: switch it off.
    max_batch_size: int = 8
    adaptive: bool = True  # per-request k follows the observed acceptance rate
    # What adaptive k assumes a draft costs and how drafts continue; None: DEFAULT_DRAFT_ECONOMICS[method].
    economics: DraftEconomics | None = None
    # An n-gram match of n tokens proposes at most this many drafts per matched token: on SmolLM2's chat
    # outputs the first draft after a 1-token match is mostly rejected and the third more often still, while
    # after a 4+-token match most drafts are accepted, and a draft costs a few percent of a step to verify
    # (measured: benchmarks/results/figures-from-code.md).
    ngram_drafts_per_matched_token: int = 3

    def __post_init__(self) -> None:
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if self.ngram_min_n < 1 or self.ngram_max_n < self.ngram_min_n:
            raise ValueError(f"need 1 <= ngram_min_n <= ngram_max_n, got {self.ngram_min_n}, {self.ngram_max_n}")
        if self.method is SpeculativeMethod.DRAFT_MODEL and not self.draft_model:
            raise ValueError("--speculative draft_model needs --draft-model (a model directory or the bundled "
                             "model's name)")
        if self.ngram_first and self.method is not SpeculativeMethod.DRAFT_MODEL:
            raise ValueError("--speculative-ngram-first goes with --speculative draft_model (n-gram lookup first, "
                             f"the draft model where it finds nothing), not {self.method.value}")
        if self.ngram_first_min_n < 1:
            raise ValueError(f"ngram_first_min_n must be >= 1, got {self.ngram_first_min_n}")
        if self.ngram_first_max_tokens is not None:
            if not self.ngram_first:
                raise ValueError("--speculative-ngram-max-tokens goes with --speculative-ngram-first")
            if not 1 <= self.ngram_first_max_tokens <= 16:
                raise ValueError("--speculative-ngram-max-tokens must be in [1, 16], "
                                 f"got {self.ngram_first_max_tokens}")
        if self.draft_layers < 1:
            raise ValueError(f"draft_layers must be >= 1, got {self.draft_layers}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.ngram_drafts_per_matched_token < 1:
            raise ValueError(f"ngram_drafts_per_matched_token must be >= 1, got {self.ngram_drafts_per_matched_token}")

    @property
    def enabled(self) -> bool:
        return self.method is not SpeculativeMethod.NONE

    @property
    def max_drafts_per_step(self) -> int:
        """Draft slots a request may get per step: k, or the n-gram lookup's own limit where it drafts first."""
        if self.ngram_first and self.ngram_first_max_tokens is not None:
            return max(self.num_speculative_tokens, self.ngram_first_max_tokens)
        return self.num_speculative_tokens

    @property
    def draft_economics(self) -> DraftEconomics:
        assert self.enabled, "no drafts without a speculative method"
        return self.economics or DEFAULT_DRAFT_ECONOMICS[self.method]

"""Conversions between protobuf messages and the engine's frozen dataclasses (the one edge per service).

Pure Python (no torch): the gateway uses it too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.engine.request import FinishReason
from common.sampling.params import SamplingParams
from tandem.v1 import common_pb2

if TYPE_CHECKING:
    from common.engine.engine_core import EngineStats

_FINISH_TO_PROTO = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}


def sampling_from_proto(msg: common_pb2.SamplingParams, default_max_tokens: int = 16,
                        resumed_output_tokens: int = 0) -> SamplingParams:
    """Unset optional fields take SamplingParams' defaults; validation errors name the field.

    ``resumed_output_tokens``: a node's request says it beside the sampling (``DecodeRequest``,
    ``PrefillRequest``): a migrated request's prompt ends with that many of its own output tokens."""
    defaults = SamplingParams()
    return SamplingParams(
        temperature=msg.temperature if msg.HasField("temperature") else defaults.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else defaults.top_p,
        top_k=msg.top_k if msg.HasField("top_k") and msg.top_k > 0 else None,
        min_p=msg.min_p if msg.HasField("min_p") else defaults.min_p,
        repetition_penalty=(msg.repetition_penalty if msg.HasField("repetition_penalty")
                            else defaults.repetition_penalty),
        presence_penalty=msg.presence_penalty if msg.HasField("presence_penalty") else 0.0,
        frequency_penalty=msg.frequency_penalty if msg.HasField("frequency_penalty") else 0.0,
        seed=msg.seed if msg.HasField("seed") else None,
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else default_max_tokens,
        min_tokens=msg.min_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        num_speculative_tokens=msg.num_speculative_tokens if msg.HasField("num_speculative_tokens") else None,
        resumed_output_tokens=resumed_output_tokens,
    )


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=params.temperature, top_p=params.top_p, min_p=params.min_p,
        repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, max_tokens=params.max_tokens, min_tokens=params.min_tokens,
        stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
    )
    if params.top_k is not None:
        msg.top_k = params.top_k
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.num_speculative_tokens is not None:
        msg.num_speculative_tokens = params.num_speculative_tokens
    return msg


def finish_reason_to_proto(reason: FinishReason | None) -> common_pb2.FinishReason:
    return _FINISH_TO_PROTO[reason]  # type: ignore[return-value]


def logprob_to_proto(token_id: int, logprob: float, top: list[tuple[int, float]]) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=token_id, logprob=logprob,
        top=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top],
    )


def stats_to_proto(stats: EngineStats, node_id: str, role: str) -> common_pb2.NodeStats:
    return common_pb2.NodeStats(
        node_id=node_id, role=role, num_blocks=stats.num_blocks, free_blocks=stats.free_blocks,
        used_blocks=stats.used_blocks, num_running=stats.num_running, num_waiting=stats.num_waiting,
        prefix_cache_queries=stats.prefix_cache_queries, prefix_cache_hits=stats.prefix_cache_hits,
        num_preemptions=stats.num_preemptions, block_size=stats.block_size,
        offload_hits=stats.offload_hits, offload_blocks=stats.offload_blocks,
        peak_used_blocks=stats.peak_used_blocks, kv_shared_tier=stats.kv_shared_tier,
    )

"""The spans of one request, their attribute keys, and helpers to make spans from recorded timings.

One trace per request::

    generate                    gateway, SERVER: request id, model, prompt/completion/cached tokens, finish
    ├── prefill                 prefill node, SERVER: queue and compute seconds, cached tokens
    │   ├── prefill.queue       arrival -> first scheduled
    │   ├── prefill.chunk       one per chunk: its engine step's start and end (recorded on the engine thread)
    │   └── kv_transfer.send    PRODUCER: bytes, blocks, chunks, seconds, GB/s
    │       └── kv_transfer.receive   decode node, CONSUMER (context from the KV control messages)
    └── decode                  decode node, SERVER
        ├── decode.reserve      blocks reserved, tokens already cached
        ├── decode.wait_kv      reservation sent -> prompt KV landed
        └── decode.stream       first token -> finish: steps, tokens, preemptions, speculative acceptance

Attribute keys follow OpenTelemetry's GenAI conventions where one exists (``gen_ai.*``), else ``tandem.*``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from common.telemetry.logs import log_event

# ``StatusInterceptor.status_for`` of the service (common.serving.status): the status an exception becomes.
StatusFor = Callable[[BaseException], tuple[grpc.StatusCode, str]]

# Span names.
GENERATE = "generate"
PREFILL = "prefill"
PREFILL_QUEUE = "prefill.queue"
PREFILL_CHUNK = "prefill.chunk"
KV_SEND = "kv_transfer.send"
KV_RECEIVE = "kv_transfer.receive"
DECODE = "decode"
DECODE_RESERVE = "decode.reserve"
DECODE_WAIT_KV = "decode.wait_kv"
DECODE_STREAM = "decode.stream"

# Attribute keys.
REQUEST_ID = "gen_ai.request.id"
MODEL = "gen_ai.request.model"
MAX_TOKENS = "gen_ai.request.max_tokens"
TEMPERATURE = "gen_ai.request.temperature"
PROMPT_TOKENS = "gen_ai.usage.input_tokens"
COMPLETION_TOKENS = "gen_ai.usage.output_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
CACHED_TOKENS = "tandem.cached_tokens"
LOCAL_PREFILL = "tandem.local_prefill"  # conditional disaggregation: the decode node prefilled the prompt
STATUS_CODE = "rpc.grpc.status_code"
STATUS = "tandem.status"
NODE = "tandem.node"
PREFILL_NODE = "tandem.prefill_node"
DECODE_NODE = "tandem.decode_node"
TTFT_S = "tandem.time_to_first_token_s"
QUEUE_S = "tandem.queue_s"
COMPUTE_S = "tandem.compute_s"
E2E_S = "tandem.e2e_s"
CHUNK_START = "tandem.chunk.start_token"
CHUNK_TOKENS = "tandem.chunk.num_tokens"
CHUNK_INDEX = "tandem.chunk.index"
STEP_TOKENS = "tandem.step.num_tokens"
TRANSFER_ID = "tandem.kv.transfer_id"
KV_BYTES = "tandem.kv.bytes"
KV_BLOCKS = "tandem.kv.blocks"
KV_CHUNKS = "tandem.kv.chunks"
KV_SECONDS = "tandem.kv.seconds"
KV_GBPS = "tandem.kv.gb_per_s"
KV_PEER = "tandem.kv.peer"
DEST_CACHED_TOKENS = "tandem.kv.destination_cached_tokens"  # prompt tokens the decode node had: not sent
RESERVED_BLOCKS = "tandem.reserved_blocks"
NUM_STEPS = "tandem.decode.num_steps"
PREEMPTIONS = "tandem.num_preemptions"
SPEC_DRAFT_TOKENS = "tandem.spec.draft_tokens"
SPEC_ACCEPTED_TOKENS = "tandem.spec.accepted_tokens"
SPEC_ACCEPTANCE = "tandem.spec.acceptance_rate"
MIGRATIONS = "tandem.migrations"  # times the request continued on other nodes after losing one
LOST_ROLE = "tandem.migration.lost_role"  # prefill | decode: the node lost
STREAMED_TOKENS = "tandem.migration.streamed_tokens"  # tokens the client had when its node was lost

SERVER = SpanKind.SERVER
PRODUCER = SpanKind.PRODUCER
CONSUMER = SpanKind.CONSUMER


def record_span(tracer: trace.Tracer, name: str, start_ns: int, end_ns: int,
                attributes: Mapping[str, AttributeValue] | None = None, parent: Context | None = None,
                kind: SpanKind = SpanKind.INTERNAL, links: Sequence[Link] = ()) -> trace.Span:
    """A span that already happened (timings recorded elsewhere, e.g. on the engine thread)."""
    span = tracer.start_span(name, context=parent, kind=kind, attributes=attributes, links=links,
                             start_time=start_ns)
    span.end(end_time=max(end_ns, start_ns))
    return span


def transfer_attributes(num_bytes: int, seconds: float, num_blocks: int) -> dict[str, AttributeValue]:
    gbps = num_bytes / seconds / 1e9 if seconds > 0 else 0.0
    return {KV_BYTES: num_bytes, KV_SECONDS: seconds, KV_BLOCKS: num_blocks, KV_GBPS: round(gbps, 4)}


# OpenTelemetry's gRPC conventions: a server span is an error only when the server is at fault; a bad
# request, a cancelled call or an exhausted limit leave its status unset (the code is still recorded).
SERVER_FAULTS = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNIMPLEMENTED,
                           grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS})


def set_error(span: trace.Span, exc: BaseException, code: grpc.StatusCode) -> None:
    """Record on ``span`` the gRPC status its RPC ends with; ERROR status for server faults only."""
    if not span.is_recording():
        return
    span.set_attribute(STATUS_CODE, code.value[0])
    span.set_attribute(STATUS, code.name)
    if code != grpc.StatusCode.CANCELLED:  # a caller going away is no exception
        span.record_exception(exc)
    if code in SERVER_FAULTS:
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {exc}" if str(exc) else code.name))


def log_level_for(code: grpc.StatusCode) -> int:
    """How loud a failed RPC's log line is: server faults warn, caller mistakes inform, cancellations whisper."""
    if code in SERVER_FAULTS:
        return logging.WARNING
    return logging.DEBUG if code == grpc.StatusCode.CANCELLED else logging.INFO


def record_failure(span: trace.Span, exc: BaseException, status_for: StatusFor, logger: logging.Logger,
                   what: str) -> grpc.StatusCode:
    """An RPC's handler is failing with ``exc``: mark its span, log one line; return the status it ends with."""
    code = failure_code(exc, status_for)
    set_error(span, exc, code)
    log_event(logger, log_level_for(code), what, status=code.name, error=str(exc) or type(exc).__name__)
    return code


def set_ok(span: trace.Span) -> None:
    if span.is_recording():
        span.set_attribute(STATUS_CODE, grpc.StatusCode.OK.value[0])
        span.set_attribute(STATUS, grpc.StatusCode.OK.name)


def failure_code(exc: BaseException, status_for: StatusFor) -> grpc.StatusCode:
    """The status an RPC ends with when ``exc`` escapes its handler (``status_for``: the service's mapping)."""
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return grpc.StatusCode.CANCELLED
    return status_for(exc)[0]

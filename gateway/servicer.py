"""The public ``tandem.v1.Tandem`` service: admission, validation, deadline; the flow is the backend's.

Observability hooks in at this edge: one root span (``generate``) and the request metrics per ``Generate``
wrap its body (the last chunk carries usage and timings), plus one structured log line per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc
from opentelemetry import trace

from common.errors import InvalidRequestError
from common.serving.errors import DeadlineExceededError, ResourceExhaustedError
from common.serving.status import StatusInterceptor
from common.telemetry import spans
from common.telemetry.logs import log_event, request_scope
from common.telemetry.metrics import GatewayMetrics
from common.telemetry.tracing import get_tracer
from gateway.backend import GenerateBackend
from gateway.model import ServedModel
from gateway.output import OutputChunk
from gateway.request import GatewayRequest, chat_token_ids
from gateway.settings import GatewaySettings
from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Tandem"].full_name

log = logging.getLogger(__name__)
_tracer = get_tracer(__name__)


class TandemServicer(generate_pb2_grpc.TandemServicer):
    """Generate, Tokenize, ModelInfo; errors are raised and mapped to statuses by the interceptor.

    ``backend`` produces the tokens: the gateway's ``Coordinator`` over prefill and decode nodes, or the
    colocated server's engine. ``status_for`` is the interceptor's mapping, so that the root span and the
    failure counter carry the status the client gets.
    """

    def __init__(self, model: ServedModel, backend: GenerateBackend, settings: GatewaySettings,
                 metrics: GatewayMetrics | None = None, status_for: spans.StatusFor | None = None) -> None:
        self._model = model
        self._backend = backend
        self._settings = settings
        self._metrics = metrics or GatewayMetrics()
        self._status_for = status_for or StatusInterceptor().status_for
        self.num_inflight = 0

    async def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        with (_tracer.start_as_current_span(spans.GENERATE, kind=spans.SERVER, record_exception=False,
                                            set_status_on_exception=False) as span,
              contextlib.ExitStack() as log_scope):
            try:
                await self._generate(request, context, span, log_scope)
            except BaseException as exc:
                code = spans.record_failure(span, exc, self._status_for, log, "request failed")
                self._metrics.request_failed(code.name)
                raise

    async def _generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
                        span: trace.Span, log_scope: contextlib.ExitStack) -> None:
        limit = self._settings.max_inflight
        if self.num_inflight >= limit:
            raise ResourceExhaustedError(f"too many requests in flight: the limit is max_inflight={limit}; retry later")
        self.num_inflight += 1
        self._metrics.num_requests_running.inc()
        try:
            arrival = time.monotonic()
            if request.request_id:  # the client's id, for the logs and span of a request that fails validation
                span.set_attribute(spans.REQUEST_ID, request.request_id)
                log_scope.enter_context(request_scope(request.request_id))
            req = GatewayRequest.from_proto(request, self._model)
            if req.request_id != request.request_id:
                log_scope.enter_context(request_scope(req.request_id))  # until Generate has logged its end
            if span.is_recording():
                span.set_attributes({spans.REQUEST_ID: req.request_id, spans.MODEL: self._model.name,
                                     spans.PROMPT_TOKENS: len(req.prompt_token_ids),
                                     spans.MAX_TOKENS: req.sampling.max_tokens,
                                     spans.TEMPERATURE: req.sampling.temperature})
            client_remaining = context.time_remaining()
            timeout = self._settings.request_timeout_s
            if client_remaining is not None:
                timeout = min(timeout, client_remaining)
            scope = asyncio.timeout(timeout)
            last: OutputChunk | None = None
            try:
                async with scope:
                    chunks = self._backend.generate(req, arrival, arrival + timeout)
                    # aclosing: a cancel or a timeout while we write still cancels both legs right away.
                    async with contextlib.aclosing(chunks):
                        async for chunk in chunks:
                            await context.write(_to_proto(chunk, req))
                            last = chunk
                self._finished(last, span)
            except TimeoutError:
                if not scope.expired():
                    raise
                raise DeadlineExceededError(
                    f"request {req.request_id} did not finish within {timeout:.3g} s (request_timeout_s="
                    f"{self._settings.request_timeout_s:g}, or the client's deadline when sooner)") from None
        finally:
            self.num_inflight -= 1
            self._metrics.num_requests_running.dec()

    def _finished(self, last: OutputChunk | None, span: trace.Span) -> None:
        """Record the finished request: root span attributes, metrics, one log line."""
        assert last is not None and last.usage is not None and last.timings is not None  # the backend's contract
        u, t = last.usage, last.timings
        reason = _finish_reason_name(last.finish_reason)
        self._metrics.request_finished(reason, u.prompt_tokens, u.completion_tokens, t.time_to_first_token,
                                       t.e2e_seconds, t.queue_seconds)
        if span.is_recording():
            span.set_attributes({
                spans.COMPLETION_TOKENS: u.completion_tokens, spans.CACHED_TOKENS: u.cached_tokens,
                spans.FINISH_REASONS: [reason], spans.TTFT_S: t.time_to_first_token, spans.QUEUE_S: t.queue_seconds,
                spans.E2E_S: t.e2e_seconds, spans.PREFILL_NODE: t.prefill_node, spans.DECODE_NODE: t.decode_node,
                spans.KV_BYTES: t.kv_transfer_bytes, spans.KV_SECONDS: t.kv_transfer_seconds,
            })
            spans.set_ok(span)
        log_event(log, logging.INFO, "request finished", finish_reason=reason, prompt_tokens=u.prompt_tokens,
                  completion_tokens=u.completion_tokens, cached_tokens=u.cached_tokens,
                  ttft_s=round(t.time_to_first_token, 6), e2e_s=round(t.e2e_seconds, 6),
                  prefill_node=t.prefill_node, decode_node=t.decode_node)

    async def Tokenize(self, request: generate_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> generate_pb2.TokenizeResponse:
        tokenizer = self._model.tokenizer
        kind = request.WhichOneof("input")
        if kind == "text":
            ids = tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
        elif kind == "chat":
            ids = chat_token_ids(request.chat, self._model)
        else:
            raise InvalidRequestError("input", "one of text or chat is required")
        return generate_pb2.TokenizeResponse(token_ids=ids, tokens=tokenizer.convert_ids_to_tokens(ids))

    async def ModelInfo(self, request: generate_pb2.ModelInfoRequest,
                        context: grpc.aio.ServicerContext) -> generate_pb2.ModelInfoResponse:
        m, config = self._model, self._model.config
        return generate_pb2.ModelInfoResponse(
            model=m.name, vocab_size=m.vocab_size, max_model_len=m.max_model_len, num_layers=config.num_layers,
            num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
            dtype=m.dtype, block_size=self._settings.block_size,
            num_prefill_nodes=len(self._settings.prefill_targets), num_decode_nodes=len(self._settings.decode_targets),
            eos_token_ids=m.eos_token_ids, has_chat_template=m.tokenizer.chat_template is not None,
        )


def _to_proto(chunk: OutputChunk, req: GatewayRequest) -> generate_pb2.GenerateResponse:
    msg = generate_pb2.GenerateResponse(
        request_id=req.request_id,
        text="" if req.skip_text else chunk.text,
        token_ids=chunk.token_ids if req.include_token_ids else (),
        logprobs=chunk.logprobs,
        finish_reason=chunk.finish_reason or common_pb2.FINISH_REASON_UNSPECIFIED,
        stop_string=chunk.stop_string,
    )
    if chunk.usage is not None:
        u = chunk.usage
        msg.usage.CopyFrom(generate_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                              cached_tokens=u.cached_tokens))
    if chunk.timings is not None:
        t = chunk.timings
        msg.timings.CopyFrom(generate_pb2.Timings(
            queue_seconds=t.queue_seconds, time_to_first_token=t.time_to_first_token, e2e_seconds=t.e2e_seconds,
            kv_transfer_seconds=t.kv_transfer_seconds, kv_transfer_bytes=t.kv_transfer_bytes,
            prefill_node=t.prefill_node, decode_node=t.decode_node))
    return msg


def _finish_reason_name(reason: int | None) -> str:
    """``FINISH_REASON_LENGTH`` -> ``length``: the label value and span attribute."""
    return common_pb2.FinishReason.Name(reason or common_pb2.FINISH_REASON_UNSPECIFIED).removeprefix(
        "FINISH_REASON_").lower()

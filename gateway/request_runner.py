"""One public request from validation to its last chunk: what the gRPC and HTTP fronts share.

Both fronts (``gateway/servicer.py`` for ``tandem.v1.Tandem``, ``gateway/http_api.py`` for the OpenAI
API) turn their input into a ``GatewayRequest`` and hand it here with a ``write`` for their wire format.
The runner owns admission (the in-flight limit), the deadline, the fan-out of ``n`` samples, explicit
aborts, and telemetry (one root span, the request metrics, one log line per sample); the backend owns
where the tokens come from. Errors are raised (``InvalidRequestError``, ``ServiceError``); each front maps
them to its own statuses with ``status_for``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import grpc
from opentelemetry import trace

from common.serving.errors import DeadlineExceededError, ResourceExhaustedError, ServiceError
from common.serving.status import StatusInterceptor
from common.telemetry import spans
from common.telemetry.logs import log_event, request_scope
from common.telemetry.metrics import GatewayMetrics
from common.telemetry.tracing import get_tracer
from gateway.admission import AdmissionQueue
from gateway.backend import GenerateBackend
from gateway.model import ServedModel
from gateway.output import OutputChunk
from gateway.request import GatewayRequest
from gateway.settings import GatewaySettings
from tandem.v1 import common_pb2

log = logging.getLogger(__name__)
_tracer = get_tracer(__name__)

# A front's writer: send ``chunk`` of sample ``req`` (``req.index``) to its client.
Write = Callable[[OutputChunk, GatewayRequest], Awaitable[None]]


class AbortedError(ServiceError):
    """The request was cancelled by an ``Abort`` call."""

    code = grpc.StatusCode.CANCELLED


class RequestRunner:
    """Runs validated requests on ``backend``; one per gateway process, shared by both fronts."""

    def __init__(self, model: ServedModel, backend: GenerateBackend, settings: GatewaySettings,
                 metrics: GatewayMetrics | None = None, status_for: spans.StatusFor | None = None) -> None:
        self.model = model
        self.settings = settings
        self.backend = backend
        self._metrics = metrics or GatewayMetrics()
        self.status_for = status_for or StatusInterceptor().status_for
        # samples in flight (both fronts together) and the requests queued for a slot
        self.admission = AdmissionQueue(settings.max_inflight, settings.max_queued, settings.queue_timeout_s)
        self._open: dict[str, asyncio.Task[object]] = {}  # client request id -> the task running it
        self._aborting: set[str] = set()

    async def run(self, build: Callable[[], GatewayRequest], write: Write, client_timeout_s: float | None = None,
                  client_request_id: str = "") -> None:
        """Validate (``build``), admit and run one request, writing each sample's chunks with ``write``.

        ``client_timeout_s``: the client's own deadline, when it sent one; ``client_request_id`` labels the
        span and logs of a request that fails validation.
        """
        with (_tracer.start_as_current_span(spans.GENERATE, kind=spans.SERVER, record_exception=False,
                                            set_status_on_exception=False) as span,
              contextlib.ExitStack() as log_scope):
            try:
                await self._run(build, write, client_timeout_s, client_request_id, span, log_scope)
            except BaseException as exc:
                code = spans.record_failure(span, exc, self.status_for, log, "request failed")
                self._metrics.request_failed(code.name)
                raise

    def abort(self, request_ids: list[str]) -> list[str]:
        """Cancel the named requests in flight (all samples of each); return the ids that were running."""
        found = []
        for rid in request_ids:
            task = self._open.get(rid)
            if task is not None and rid not in self._aborting:
                self._aborting.add(rid)
                task.cancel()
                found.append(rid)
        return found

    async def _run(self, build: Callable[[], GatewayRequest], write: Write, client_timeout_s: float | None,
                   client_request_id: str, span: trace.Span, log_scope: contextlib.ExitStack) -> None:
        arrival = time.monotonic()
        if client_request_id:  # the client's id, for the logs and span of a request that fails validation
            span.set_attribute(spans.REQUEST_ID, client_request_id)
            log_scope.enter_context(request_scope(client_request_id))
        req = build()
        if req.request_id != client_request_id:
            log_scope.enter_context(request_scope(req.request_id))  # until the request has logged its end
        if req.request_id in self._open:
            raise ResourceExhaustedError(f"request_id {req.request_id!r} is already in flight; send another id")
        if span.is_recording():
            span.set_attributes({spans.REQUEST_ID: req.request_id, spans.MODEL: self.model.name,
                                 spans.PROMPT_TOKENS: len(req.prompt_token_ids),
                                 spans.MAX_TOKENS: req.sampling.max_tokens,
                                 spans.TEMPERATURE: req.sampling.temperature})
        timeout = self.settings.request_timeout_s
        if client_timeout_s is not None:
            timeout = min(timeout, client_timeout_s)
        task = asyncio.current_task()
        assert task is not None
        self._open[req.request_id] = task
        # The deadline counts from arrival: time queued for a slot is part of it.
        scope = asyncio.timeout_at(asyncio.get_running_loop().time() + timeout)
        try:
            async with self.admission.slots(req.n, timeout) as queued_s:
                if queued_s and span.is_recording():
                    span.add_event("admitted", {spans.QUEUE_S: queued_s})
                self._metrics.num_requests_running.inc(req.n)
                try:
                    async with scope:
                        lasts = await self._samples(req, write, arrival, arrival + timeout)
                finally:
                    self._metrics.num_requests_running.dec(req.n)
            self._finished(lasts, span)
        except TimeoutError:
            if not scope.expired():
                raise
            raise DeadlineExceededError(
                f"request {req.request_id} did not finish within {timeout:.3g} s (request_timeout_s="
                f"{self.settings.request_timeout_s:g}, or the client's deadline when sooner)") from None
        except asyncio.CancelledError:
            if req.request_id in self._aborting and task.uncancel() == 0:  # only our Abort cancelled it
                raise AbortedError(f"request {req.request_id} was aborted") from None
            raise
        finally:
            self._open.pop(req.request_id, None)
            self._aborting.discard(req.request_id)

    async def _samples(self, req: GatewayRequest, write: Write, arrival: float, deadline: float,
                       ) -> list[OutputChunk]:
        """Run every sample; return each one's last chunk. With n > 1 the first sample runs alone until its
        first token (its prompt's KV is then in the prefix cache), then the others start and reuse it."""
        samples = req.samples()
        if len(samples) == 1:
            return [await self._sample(samples[0], write, arrival, deadline, None)]
        first_token = asyncio.Event()
        lock = asyncio.Lock()

        async def serialized(chunk: OutputChunk, sample: GatewayRequest) -> None:
            async with lock:  # the samples run concurrently; a front writes one message at a time
                await write(chunk, sample)

        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._sample(samples[0], serialized, arrival, deadline, first_token))]
                await first_token.wait()
                tasks += [group.create_task(self._sample(s, serialized, arrival, deadline, None))
                          for s in samples[1:]]
        except BaseExceptionGroup as group_error:
            # One sample's failure ended them all: the client gets that failure, as with a single sample.
            raise _first_cause(group_error) from None
        return [t.result() for t in tasks]

    async def _sample(self, req: GatewayRequest, write: Write, arrival: float, deadline: float,
                      first_token: asyncio.Event | None) -> OutputChunk:
        last: OutputChunk | None = None
        try:
            chunks = self.backend.generate(req, arrival, deadline)
            # aclosing: a cancel or a timeout while we write still cancels both legs right away.
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    if first_token is not None:
                        first_token.set()
                    await write(chunk, req)
                    last = chunk
        finally:
            if first_token is not None:
                first_token.set()  # the others may start (or see the failure) even without a first token
        assert last is not None and last.usage is not None and last.timings is not None  # the backend's contract
        return last

    def _finished(self, lasts: list[OutputChunk], span: trace.Span) -> None:
        """Record the finished samples: root span attributes, metrics, one log line each."""
        reasons = []
        for last in lasts:
            assert last.usage is not None and last.timings is not None
            u, t = last.usage, last.timings
            reason = finish_reason_name(last.finish_reason)
            reasons.append(reason)
            self._metrics.request_finished(reason, u.prompt_tokens, u.completion_tokens, t.time_to_first_token,
                                           t.e2e_seconds, t.queue_seconds)
            log_event(log, logging.INFO, "request finished", finish_reason=reason, prompt_tokens=u.prompt_tokens,
                      completion_tokens=u.completion_tokens, cached_tokens=u.cached_tokens,
                      ttft_s=round(t.time_to_first_token, 6), e2e_s=round(t.e2e_seconds, 6),
                      prefill_node=t.prefill_node, decode_node=t.decode_node)
        if span.is_recording():
            first = lasts[0]
            assert first.usage is not None and first.timings is not None
            u, t = first.usage, first.timings
            span.set_attributes({
                spans.COMPLETION_TOKENS: sum(x.usage.completion_tokens for x in lasts if x.usage is not None),
                spans.CACHED_TOKENS: u.cached_tokens, spans.FINISH_REASONS: reasons,
                spans.TTFT_S: t.time_to_first_token, spans.QUEUE_S: t.queue_seconds,
                spans.E2E_S: max(x.timings.e2e_seconds for x in lasts if x.timings is not None),
                spans.PREFILL_NODE: t.prefill_node, spans.DECODE_NODE: t.decode_node,
                spans.KV_BYTES: t.kv_transfer_bytes, spans.KV_SECONDS: t.kv_transfer_seconds,
            })
            spans.set_ok(span)


def _first_cause(group: BaseExceptionGroup) -> BaseException:
    """The error to report for a group: the first that is not a sibling's cancellation."""
    leaves: list[BaseException] = []
    stack: list[BaseException] = [group]
    while stack:
        exc = stack.pop(0)
        if isinstance(exc, BaseExceptionGroup):
            stack[:0] = list(exc.exceptions)
        else:
            leaves.append(exc)
    return next((e for e in leaves if not isinstance(e, asyncio.CancelledError)), leaves[0])


def finish_reason_name(reason: int | None) -> str:
    """``FINISH_REASON_LENGTH`` -> ``length``: the label value, span attribute and OpenAI finish reason."""
    return common_pb2.FinishReason.Name(reason or common_pb2.FINISH_REASON_UNSPECIFIED).removeprefix(  # type: ignore[arg-type]
        "FINISH_REASON_").lower()

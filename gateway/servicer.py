"""The public ``tandem.v1.Tandem`` service: admission, validation, deadline; the flow is the coordinator's.

Observability hooks in at this edge: one root span and the request metrics per ``Generate`` wrap the
body of ``Generate`` (the last chunk carries usage and timings).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from common.errors import InvalidRequestError
from common.serving.errors import DeadlineExceededError, ResourceExhaustedError
from gateway.coordinator import Coordinator
from gateway.model import ServedModel
from gateway.output import OutputChunk
from gateway.request import GatewayRequest, chat_token_ids
from gateway.settings import GatewaySettings
from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Tandem"].full_name


class TandemServicer(generate_pb2_grpc.TandemServicer):
    """Generate, Tokenize, ModelInfo; errors are raised and mapped to statuses by the interceptor."""

    def __init__(self, model: ServedModel, coordinator: Coordinator, settings: GatewaySettings) -> None:
        self._model = model
        self._coordinator = coordinator
        self._settings = settings
        self.num_inflight = 0

    async def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        limit = self._settings.max_inflight
        if self.num_inflight >= limit:
            raise ResourceExhaustedError(f"too many requests in flight: the limit is max_inflight={limit}; retry later")
        self.num_inflight += 1
        try:
            arrival = time.monotonic()
            req = GatewayRequest.from_proto(request, self._model)
            client_remaining = context.time_remaining()
            timeout = self._settings.request_timeout_s
            if client_remaining is not None:
                timeout = min(timeout, client_remaining)
            scope = asyncio.timeout(timeout)
            try:
                async with scope:
                    chunks = self._coordinator.generate(req, arrival, arrival + timeout)
                    # aclosing: a cancel or a timeout while we write still cancels both legs right away.
                    async with contextlib.aclosing(chunks):
                        async for chunk in chunks:
                            await context.write(_to_proto(chunk, req))
            except TimeoutError:
                if not scope.expired():
                    raise
                raise DeadlineExceededError(
                    f"request {req.request_id} did not finish within {timeout:.3g} s (request_timeout_s="
                    f"{self._settings.request_timeout_s:g}, or the client's deadline when sooner)") from None
        finally:
            self.num_inflight -= 1

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

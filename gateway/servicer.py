"""The public ``tandem.v1.Tandem`` service: the gRPC front of ``RequestRunner``.

Admission, deadline, the ``n`` samples and telemetry (one root span and the request metrics per
``Generate``, one log line per sample) are the runner's, shared with the HTTP front; this servicer only
converts at its edge: ``GatewayRequest.from_proto`` in, ``_to_proto`` out.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from common.errors import InvalidRequestError
from gateway.output import OutputChunk
from gateway.request import GatewayRequest, chat_token_ids
from gateway.request_runner import RequestRunner
from gateway.router import Router
from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Tandem"].full_name

log = logging.getLogger(__name__)


class TandemServicer(generate_pb2_grpc.TandemServicer):
    """Generate, Tokenize, ModelInfo, Abort, GetLoads, SubscribeKvEvents; errors are raised and mapped to
    statuses by the interceptor (whose mapping the runner was given, so that the root span carries the client's status).

    ``router`` is the gateway's view of its nodes (``GetLoads``); the colocated server has none and reports
    its own engine through ``loads`` instead.
    """

    def __init__(self, runner: RequestRunner, router: Router | None = None,
                 loads: LoadsSource | None = None, kv_events: KvEventsSource | None = None) -> None:
        self._runner = runner
        self._model = runner.model
        self._settings = runner.settings
        self._router = router
        self._loads = loads
        self._kv_events = kv_events

    @property
    def num_inflight(self) -> int:
        return self._runner.admission.num_inflight

    async def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        async def write(chunk: OutputChunk, req: GatewayRequest) -> None:
            await context.write(_to_proto(chunk, req))

        await self._runner.run(lambda: GatewayRequest.from_proto(request, self._model), write,
                               context.time_remaining(), request.request_id)

    async def Abort(self, request: generate_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> generate_pb2.AbortResponse:
        return generate_pb2.AbortResponse(aborted=self._runner.abort(list(request.request_ids)))

    async def GetLoads(self, request: generate_pb2.GetLoadsRequest,
                       context: grpc.aio.ServicerContext) -> generate_pb2.GetLoadsResponse:
        admission = self._runner.admission
        if self._loads is not None:
            nodes = await self._loads()
        else:
            nodes = router_loads(self._router) if self._router is not None else []
        return generate_pb2.GetLoadsResponse(nodes=nodes, num_inflight=admission.num_inflight,
                                             num_queued=admission.num_queued)

    async def SubscribeKvEvents(self, request: common_pb2.SubscribeKvEventsRequest,
                                context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.KvEventBatch]:
        if self._kv_events is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this server publishes no KV events")
            return
        async for batch in self._kv_events(request):
            yield batch

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
            dtype=m.dtype, block_size=self._runner.backend.block_size,
            num_prefill_nodes=len(self._settings.prefill_targets), num_decode_nodes=len(self._settings.decode_targets),
            eos_token_ids=m.eos_token_ids, has_chat_template=m.tokenizer.chat_template is not None,
        )


def _to_proto(chunk: OutputChunk, req: GatewayRequest) -> generate_pb2.GenerateResponse:
    msg = generate_pb2.GenerateResponse(
        request_id=req.client_request_id,
        index=req.index,
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



LoadsSource = Callable[[], Awaitable[list[generate_pb2.NodeLoad]]]
# the subscriber's request -> prefix-cache event batches (gateway.kv_event_merger: every node's, merged)
KvEventsSource = Callable[[common_pb2.SubscribeKvEventsRequest], AsyncIterator[common_pb2.KvEventBatch]]


def router_loads(router: Router) -> list[generate_pb2.NodeLoad]:
    """Every node's load as the last Stats poll saw it, with the gateway's own in-flight count."""
    out = []
    for role, targets in (("prefill", router.prefill), ("decode", router.decode)):
        for target in targets:
            node = router.node(target)
            msg = generate_pb2.NodeLoad(target=target, node_id=node.node_id, role=role, reachable=node.reachable,
                                        num_inflight=node.inflight, draining=node.draining)
            if node.load is not None:
                load = node.load
                msg.num_running, msg.num_waiting = load.num_running, load.num_waiting
                msg.num_blocks, msg.free_blocks = load.num_blocks, load.free_blocks
                msg.kv_usage = 1.0 - load.free_blocks / load.num_blocks if load.num_blocks else 0.0
                msg.prefix_cache_queries, msg.prefix_cache_hits = load.prefix_cache_queries, load.prefix_cache_hits
                msg.offload_hits, msg.offload_blocks = load.offload_hits, load.offload_blocks
                msg.kv_shared_tier = load.shared_tier
            out.append(msg)
    return out

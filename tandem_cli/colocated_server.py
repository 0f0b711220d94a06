"""``tandem serve colocated``: the public ``tandem.v1.Tandem`` API over a colocated engine, in one process.

Prefill and decode share one engine (continuous batching with chunked prefill mixed into decode steps,
``common.engine``), so no KV moves between processes. It serves small deployments, and it is the baseline
of ``tandem bench serve``: clients see exactly the gateway's API, because the gateway's servicer,
validation and output processing (detokenization, stop strings, coalescing) are reused as they are; only
where the tokens come from differs.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.engine.async_engine import AsyncEngine
from common.engine.commands import AbortRequest, AddRequest
from common.engine.kv_event_publisher import KVEventPublisher
from common.engine.request import RequestCounters, RequestOutput
from common.protocol import finish_reason_to_proto, logprob_to_proto
from common.serving.server import RunningServer, serve_until_signal
from common.telemetry.metrics import snapshot_of
from gateway.model import ServedModel
from gateway.output import Delta, OutputChunk, OutputProcessor, Timings, Usage, coalesced_chunks
from gateway.server import serve_fronts
from tandem.v1 import common_pb2, generate_pb2

if TYPE_CHECKING:
    from common.config.engine_config import SpeculativeConfig
    from common.config.settings import ModelSettings, NodeSettings, SecuritySettings
    from gateway.request import GatewayRequest
    from gateway.settings import GatewaySettings

log = logging.getLogger(__name__)


class ColocatedCoordinator:
    """The colocated ``GenerateBackend``: every request runs on one engine in this process, so none of the
    gateway's node machinery (router, node pool, KV reservations) exists here."""

    def __init__(self, model: ServedModel, engine: AsyncEngine, node_id: str, block_size: int) -> None:
        self._model = model
        self._engine = engine
        self._node_id = node_id
        self.block_size = block_size  # the engine's (GenerateBackend.block_size)
        # Engine-side ids stay unique even when two clients send the same request_id.
        self._ids = itertools.count()

    async def generate(self, req: GatewayRequest, arrival: float, deadline: float,
                       ) -> AsyncGenerator[OutputChunk, None]:
        """``GenerateBackend.generate`` on the engine; a client that goes away (or a stop string) aborts it.

        The engine bounds no wait by ``deadline``: the servicer's timeout closes this generator instead.
        """
        engine = self._engine
        engine_id = f"{req.request_id}#{next(self._ids)}"
        prompt = req.prompt_token_ids
        queue = engine.open_stream(engine_id)
        # out.source_finished: the engine finished the request, nothing to abort.
        out = OutputProcessor(self._model.tokenizer, prompt, req.stop, req.include_stop_string)
        received = _Received()
        try:
            # Caller mistakes (a prompt or max_tokens past the engine's limits) raise InvalidRequestError here.
            await engine.call(AddRequest(engine_id, prompt, req.sampling, self._model.eos_token_ids))
            first_token_time: float | None = None
            async for chunk in coalesced_chunks(out, queue, received.delta, req):
                if first_token_time is None:
                    first_token_time = time.monotonic()
                if out.finished:
                    counters = received.counters
                    scheduled = (counters.first_scheduled_time if counters else None) or arrival
                    chunk.usage = Usage(prompt_tokens=len(prompt), completion_tokens=out.num_tokens,
                                        cached_tokens=received.num_cached_tokens)
                    chunk.timings = Timings(
                        queue_seconds=max(scheduled - arrival, 0.0),
                        time_to_first_token=first_token_time - arrival,
                        e2e_seconds=time.monotonic() - arrival,
                        # Nothing moves: prefill and decode share the cache.
                        kv_transfer_seconds=0.0, kv_transfer_bytes=0,
                        prefill_node=self._node_id, decode_node=self._node_id,
                    )
                yield chunk
        finally:
            engine.close_stream(engine_id)
            if not out.source_finished:  # cancelled, timed out, failed, or a stop string ended it early
                engine.submit(AbortRequest(engine_id))


@dataclass
class _Received:
    """What a colocated request's engine outputs said besides their tokens (for its usage and timings)."""

    num_cached_tokens: int = 0
    counters: RequestCounters | None = None  # on the last output

    def delta(self, item: RequestOutput | Exception) -> Delta:
        if isinstance(item, Exception):  # the engine thread died
            raise item
        self.num_cached_tokens = item.num_cached_tokens or self.num_cached_tokens
        self.counters = item.counters or self.counters
        return Delta(item.new_token_ids, _logprobs(item), finish_reason_to_proto(item.finish_reason) or None)


def _logprobs(out: RequestOutput) -> list[common_pb2.TokenLogprob]:
    if not out.logprobs:
        return []
    return [logprob_to_proto(t, lp, top) for t, (lp, top) in zip(out.new_token_ids, out.logprobs, strict=True)]


async def serve_colocated(model_settings: ModelSettings, node: NodeSettings, settings: GatewaySettings,
                          speculative: SpeculativeConfig | None = None,
                          security: SecuritySettings | None = None) -> RunningServer:
    """Load the model, start the engine thread and serve ``tandem.v1.Tandem`` on ``settings.address``.

    ``node`` sizes the engine (KV cache, batch limits); ``settings`` is the public side (address, limits).
    """
    from common.engine.core_lending import check_lending_role

    check_lending_role("colocated", node, model_settings)
    from common.engine.engine_core import ColocatedEngine
    from common.engine.node_setup import (
        engine_configs,
        load_draft_model,
        load_node_model,
        prepare_kernels,
    )

    loaded = load_node_model(model_settings)
    cache, scheduler = engine_configs(node, model_settings.device)
    core = ColocatedEngine(loaded.model, cache, scheduler, speculative=speculative,
                           draft_model=load_draft_model(speculative, model_settings, loaded.model_dir),
                           parallel=loaded.parallel)
    engine = AsyncEngine(core, name="colocated-engine")
    await prepare_kernels(model_settings, engine)
    dtype = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
    max_model_len = min(settings.max_model_len or core.max_model_len, core.max_model_len)
    model = ServedModel.load(loaded.model_dir, settings.served_model_name, max_model_len, dtype)
    node_id = node.node_id or f"colocated-{settings.port}"

    async def loads() -> list[generate_pb2.NodeLoad]:  # GetLoads: the engine's own load
        stats = engine.engine.stats()  # read without queueing, as the nodes' Stats do
        usage = stats.used_blocks / stats.num_blocks if stats.num_blocks else 0.0
        return [generate_pb2.NodeLoad(target=settings.address, node_id=node_id, role="colocated", reachable=True,
                                      num_running=stats.num_running, num_waiting=stats.num_waiting,
                                      num_blocks=stats.num_blocks, free_blocks=stats.free_blocks, kv_usage=usage,
                                      prefix_cache_queries=stats.prefix_cache_queries,
                                      prefix_cache_hits=stats.prefix_cache_hits, offload_hits=stats.offload_hits,
                                      offload_blocks=stats.offload_blocks)]

    try:
        # The gateway's public fronts (gRPC, HTTP, /metrics) over this process's engine.
        backend = ColocatedCoordinator(model, engine, node_id, cache.block_size)
        running = await serve_fronts(model, backend, settings, loads=loads,
                                     security=security,
                                     kv_events=KVEventPublisher(engine, node_id, "colocated").subscribe,
                                     engine_snapshot=lambda: snapshot_of(core.stats(), core.scheduler))
    except BaseException:
        engine.shutdown()
        raise

    async def shutdown() -> None:
        engine.shutdown()

    running.add_shutdown_hook(shutdown)
    running.engine = engine
    log.info("colocated server %s (%s, %s) on %s", node_id, model.name, dtype, running.address)
    return running


def run_colocated(model_settings: ModelSettings, node: NodeSettings, settings: GatewaySettings,
                  speculative: SpeculativeConfig | None = None, security: SecuritySettings | None = None) -> None:
    """Serve until SIGINT/SIGTERM, then drain in-flight streams for ``shutdown_grace_s`` and exit."""

    async def main() -> None:
        running = await serve_colocated(model_settings, node, settings, speculative, security)
        http = f", OpenAI-compatible HTTP API on {running.http_url}/v1" if running.http_url else ""
        print(f"colocated server listening on {running.address}{http}", flush=True)
        await serve_until_signal(running, settings.shutdown_grace_s)

    asyncio.run(main())

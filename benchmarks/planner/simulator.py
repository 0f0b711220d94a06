"""A discrete-event simulation of a deployment serving a workload, step by step, with a fitted step cost.

Each simulated node runs the engine's own scheduler: a ``common.engine.scheduler.Scheduler`` over a
``KVCacheManager``, with the node's ``KVConnector`` (the base one colocated, ``KVProducer`` on a prefill
node, ``KVConsumer`` on a decode node). A step is the engine's loop with the model left out:
``schedule()``, then the step's cost (``CostModel.step_s`` of the scheduled chunks' ``StepShape``), then
``update()`` with one sampled token for each chunk that samples. So what the scheduler does is modelled as
it does it: the token budget (and the backlog budget), the prefill chunk limit, the prefill order,
``max_num_seqs``, admission by free blocks and the watermark, preemption by recompute, and prefix caching
of the workload's token ids (shared prefixes hit as they would). Commands that reach a busy node (a new
request, a reservation, KV arrived, KV released) apply after its step, as on the engine thread; requests
that arrive during a step wait for the next one.

Around the nodes:

- colocated: N replicas, each request to the one with the fewest outstanding requests (the client's rule).
- disaggregated: the gateway picks a decode node (fewest outstanding), which reserves blocks for the
  prompt (``Scheduler.admit_now``, else queued until admitted); then a prefill node (most cached blocks of
  the prompt, then fewest outstanding) prefills it, and its ``KVProducer`` pushes each block as a chunk
  completes it on the node's link (``kv_transfer_per_token_s`` per token, not the blocks the decode node
  had cached, one push at a time per link). When the last block has landed, the first token reaches the
  client, the decode node gets ``Scheduler.kv_arrived`` and decodes, and the prefill node frees the blocks
  it held (``Scheduler.free_held``).
- conditional: the same, but the gateway's rule (``gateway.prefill_policy.local_wins``: prefill backlogs in
  tokens, as the gateway counts them) decides which prompts the decode node prefills itself, chunks mixed
  into its decode steps: those of at most ``local_prefill_max_tokens`` unless it is busy prefilling long
  ones, and longer ones when it gives the first token sooner and nothing waits there.

Not modelled: what the model says (every step samples the same token and no stop token is set, so a
request ends at its ``output_len`` or at ``max_model_len``), speculative decoding, the serving work
beside the steps other than ``per_streamed_token_s`` (tokenizing, gRPC, the gateway), network latency
other than the KV link, the decode side of a transfer, queue limits (``max_waiting``), timeouts and
cancellation. The KV cache is ``cache.num_blocks`` per node, or, when that is None, enough blocks for every
request at once (then nothing waits for memory).
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from benchmarks.planner.cost_model import CostModel, StepShape
from benchmarks.slo import SLO, Attainment
from common.config.engine_config import CacheConfig, SchedulerConfig
from common.engine.commands import KVDestination
from common.engine.kv_connector import KVConnector
from common.engine.request import Request
from common.engine.scheduler import Scheduler
from common.engine.scheduler_output import SchedulerOutput, StepResult
from common.kv.kv_cache_manager import KVCacheManager
from common.sampling.params import SamplingParams
from decode_service.kv_consumer import KVConsumer
from gateway.prefill_policy import LocalPrefillPolicy, local_wins
from prefill_service.kv_producer import KVProducer

if TYPE_CHECKING:
    from benchmarks.workloads import TimedRequest
    from common.engine.request import RequestOutput

SAMPLED_TOKEN = 0  # what every simulated step samples (no request has a stop token: they end by length)


@dataclass(frozen=True)
class Deployment:
    """``num_prefill`` 0: ``num_decode`` colocated replicas. ``local_prefill_max_tokens`` 0: off."""

    num_prefill: int
    num_decode: int
    local_prefill_max_tokens: int = 0

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1 or self.local_prefill_max_tokens < 0:
            raise ValueError(f"need num_prefill >= 0, num_decode >= 1, local_prefill_max_tokens >= 0: {self}")
        if self.num_prefill == 0 and self.local_prefill_max_tokens:
            raise ValueError("a colocated deployment has no local-prefill threshold")

    @property
    def colocated(self) -> bool:
        return self.num_prefill == 0

    @property
    def num_nodes(self) -> int:
        return self.num_prefill + self.num_decode

    @property
    def name(self) -> str:
        if self.colocated:
            return f"colocated x{self.num_decode}"
        split = f"{self.num_prefill}P:{self.num_decode}D"
        return f"{split} local<={self.local_prefill_max_tokens}" if self.local_prefill_max_tokens else split


@dataclass(frozen=True)
class RequestTiming:
    index: int
    kind: str
    arrival_s: float
    first_token_s: float
    finish_s: float
    num_tokens: int

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        return (self.finish_s - self.first_token_s) / (self.num_tokens - 1) if self.num_tokens > 1 else None


@dataclass(frozen=True)
class SimResult:
    deployment: Deployment
    timings: tuple[RequestTiming, ...]  # in request order

    @property
    def duration_s(self) -> float:
        """First arrival to last token, as the benchmark's client measures a run."""
        return max(t.finish_s for t in self.timings) - min(t.arrival_s for t in self.timings)

    def attainment(self, slo: SLO) -> Attainment:
        return Attainment.of(slo, [(t.ttft_s, t.tpot_s) for t in self.timings], self.duration_s)


@dataclass(eq=False)
class _Node:
    index: int
    scheduler: Scheduler
    connector: KVConnector
    legs: dict[str, _Leg] = field(default_factory=dict)  # by request id: the requests on this node
    busy: bool = False  # a step is in flight
    commands: list[Callable[[], None]] = field(default_factory=list)  # arrived during the step: applied after it
    outstanding: int = 0
    prefill_backlog: int = 0  # the gateway's view: prompt tokens sent here still without their first token
    link_free_s: float = 0.0  # a prefill node's KV link

    def cached_tokens(self, prompt: Sequence[int]) -> int:
        """Prompt tokens this node's prefix cache holds (full blocks; the last prompt token is always computed)."""
        return self.scheduler.kv.get_computed_blocks(prompt)[1]


@dataclass(eq=False)
class _Leg:
    """One request on one node, as the simulation follows it."""

    request: TimedRequest
    node: _Node
    backlog: int = 0  # tokens it adds to its node's prefill backlog until its first token (as the gateway counts)
    first_token_s: float | None = None
    num_tokens: int = 0  # tokens streamed to the client so far
    decode: _Leg | None = None  # a prefill leg's: the decode node's leg its KV goes to
    push: _KVPush | None = None  # a prefill leg's: its KV transfer


@dataclass(eq=False)
class _KVPush:
    """A prefill leg's KV destination, as the ``KVProducer`` pushes to it (a ``KVPushTarget``): each push
    occupies the prefill node's link for the tokens it carries. The destination's block ids are the blocks'
    positions in the prompt (the link times tokens, not ids)."""

    clock: _Simulation
    node: _Node
    prompt_len: int
    block_size: int
    landed_s: float | None = None  # when the prompt's last block has landed
    on_finished: list[Callable[[], None]] = field(default_factory=list)

    def when_finished(self, callback: Callable[[], None]) -> None:
        self.on_finished.append(callback)

    def finish(self) -> None:
        for callback in self.on_finished:
            callback()

    def push(self, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
        bs = self.block_size
        end = min((dst_block_ids[-1] + 1) * bs, self.prompt_len)
        node = self.node
        node.link_free_s = (max(node.link_free_s, self.clock.now)
                            + self.clock.cost.kv_transfer_per_token_s * (end - dst_block_ids[0] * bs))
        if end == self.prompt_len:
            self.landed_s = node.link_free_s


def simulate(requests: Sequence[TimedRequest], deployment: Deployment, cost: CostModel,
             scheduler: SchedulerConfig | None = None, cache: CacheConfig | None = None) -> SimResult:
    """Run ``requests`` (arrival times in seconds) through ``deployment``, every node with ``scheduler`` and
    ``cache`` (their defaults when None; ``cache.num_blocks`` None: enough for every request at once)."""
    return _Simulation(requests, deployment, cost, scheduler or SchedulerConfig(), cache or CacheConfig()).run()


class _Simulation:
    def __init__(self, requests: Sequence[TimedRequest], deployment: Deployment, cost: CostModel,
                 scheduler: SchedulerConfig, cache: CacheConfig) -> None:
        self.requests = requests
        self.deployment = deployment
        self.cost = cost
        self.now = 0.0
        self.block_size = cache.block_size
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._rotation = itertools.count()
        self._done: dict[int, RequestTiming] = {}
        self._policy = LocalPrefillPolicy(max_tokens=deployment.local_prefill_max_tokens)
        # Every request at once, and the watermark on top: no node can run short of blocks. A larger cache
        # behaves the same, and a pool of a serving node's size can take longer to build than the simulation.
        enough = 1 + sum(-(-(len(r.prompt_token_ids) + r.output_len) // cache.block_size) for r in requests)
        enough = int(enough / (1 - scheduler.watermark)) + 1
        num_blocks = min(cache.num_blocks, enough) if cache.num_blocks is not None else enough
        # As the engine: a sequence must fit in the cache on its own.
        self._max_model_len = min(scheduler.max_model_len or num_blocks * cache.block_size,
                                  num_blocks * cache.block_size)
        too_long = [r.index for r in requests if len(r.prompt_token_ids) >= self._max_model_len]
        if too_long:
            raise ValueError(f"requests {too_long[:5]} have prompts of max_model_len = {self._max_model_len} tokens "
                             "or more: a node refuses them")

        def node(index: int, connector: KVConnector) -> _Node:
            kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
            return _Node(index, Scheduler(scheduler, kv, self._max_model_len, connector), connector)

        self.prefill_nodes = [node(i, KVProducer(cache.block_size)) for i in range(deployment.num_prefill)]
        self.serve_nodes = [node(i, KVConnector() if deployment.colocated else KVConsumer())
                            for i in range(deployment.num_decode)]

    def run(self) -> SimResult:
        for req in self.requests:
            self._at(req.arrival_s, functools.partial(self._arrive, req))
        while self._events:
            self.now, _, action = heapq.heappop(self._events)
            action()
        assert len(self._done) == len(self.requests), f"{len(self.requests) - len(self._done)} requests never finished"
        return SimResult(self.deployment, tuple(self._done[r.index] for r in self.requests))

    def _at(self, t: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._order), action))

    # ---- the gateway -----------------------------------------------------------------------------

    def _arrive(self, req: TimedRequest) -> None:
        prompt = req.prompt_token_ids
        decode = self._least_loaded(self.serve_nodes)
        decode.outstanding += 1
        local = self.deployment.colocated or self._prefill_here(decode, prompt)
        leg = _Leg(req, decode, backlog=len(prompt) if local and not self.deployment.colocated else 0)
        decode.legs[_request_id(req)] = leg
        decode.prefill_backlog += leg.backlog
        if local:
            self._command(decode, lambda: decode.scheduler.add_request(self._request(req)))
        else:
            self._command(decode, functools.partial(self._reserve, leg))

    def _least_loaded(self, nodes: list[_Node], prompt: Sequence[int] | None = None) -> _Node:
        start = next(self._rotation)
        return min(nodes, key=lambda n: (-n.cached_tokens(prompt) if prompt else 0, n.outstanding,
                                         (n.index - start) % len(nodes)))

    def _prefill_here(self, decode: _Node, prompt: Sequence[int]) -> bool:
        """Conditional disaggregation: the gateway's rule (``gateway.prefill_policy``) on the simulated backlogs."""
        if self._policy.max_tokens == 0:
            return False
        return local_wins(self._policy, len(prompt), decode.prefill_backlog,
                          [(p.prefill_backlog, p.cached_tokens(prompt)) for p in self.prefill_nodes])

    def _send_prefill(self, leg: _Leg, num_cached_tokens: int) -> None:
        """The decode node reserved blocks for ``leg`` (its first ``num_cached_tokens`` cached there): prefill it."""
        req = leg.request
        prompt = req.prompt_token_ids
        node = self._least_loaded(self.prefill_nodes, prompt)  # prefix-cache affinity first, then load
        node.outstanding += 1
        push = _KVPush(self, node, len(prompt), self.block_size)
        prefill = _Leg(req, node, backlog=max(1, len(prompt) - node.cached_tokens(prompt)), decode=leg, push=push)
        node.legs[_request_id(req)] = prefill
        node.prefill_backlog += prefill.backlog
        num_blocks = -(-len(prompt) // self.block_size)
        destination = KVDestination(push, tuple(range(num_blocks)), num_cached_tokens // self.block_size)

        def add() -> None:
            node.scheduler.add_request(self._request(req))
            node.connector.attach(_request_id(req), destination, None)

        self._command(node, add)

    # ---- a node's commands (between steps, as on the engine thread) ---------------------------------

    def _command(self, node: _Node, command: Callable[[], None]) -> None:
        if node.busy:
            node.commands.append(command)
            return
        command()
        self._step(node)

    def _reserve(self, leg: _Leg) -> None:
        """``EngineCore.reserve``: blocks now when they are free beside the queue's, else queued for them."""
        request = self._request(leg.request, remote_prefill=True)
        if leg.node.scheduler.admit_now(request) is None:
            leg.node.scheduler.add_request(request)
        # The reservation is announced once, as an output: now (take_announced), or by the step that admits it.
        self._handle(leg.node, leg.node.scheduler.take_announced())

    def _kv_landed(self, prefill: _Leg, first_token: int) -> None:
        """The prefill's last block is on the decode node: the first token goes out, the blocks are released."""
        node, leg, rid = prefill.node, prefill.decode, _request_id(prefill.request)
        assert leg is not None
        node.prefill_backlog -= prefill.backlog  # the Prefill call answers
        del node.legs[rid]

        def release() -> None:  # the transfer's end reaches the producer; the next step frees the blocks
            assert prefill.push is not None
            prefill.push.finish()
            for sent in node.connector.get_finished().sent:
                node.connector.forget(sent)
                node.scheduler.free_held(sent)

        self._command(node, release)
        leg.first_token_s = self.now
        self._command(leg.node, lambda: self._handle(leg.node, [leg.node.scheduler.kv_arrived(rid, first_token)]))

    def _request(self, req: TimedRequest, remote_prefill: bool = False) -> Request:
        return Request(_request_id(req), list(req.prompt_token_ids),
                       SamplingParams(max_tokens=req.output_len, ignore_eos=True), remote_prefill=remote_prefill)

    # ---- a node's steps ------------------------------------------------------------------------------

    def _step(self, node: _Node) -> None:
        if node.busy:
            return
        output = node.scheduler.schedule()
        if output.is_empty:
            self._handle(node, node.scheduler.update(output, None))  # announces queued reservations, if any
            return
        node.busy = True
        shape = StepShape.of((c.start, c.num_tokens, c.start >= c.request.num_prompt_tokens) for c in output.chunks)
        self._at(self.now + self.cost.step_s(shape), functools.partial(self._step_done, node, output))

    def _step_done(self, node: _Node, output: SchedulerOutput) -> None:
        node.busy = False
        node.connector.save_kv(output, 0)  # a prefill node pushes the blocks this step completed
        sampling = sum(1 for c in output.chunks if c.samples)
        result = StepResult([[SAMPLED_TOKEN]] * sampling, [None] * sampling, [0] * sampling, [0] * sampling)
        self._handle(node, node.scheduler.update(output, result))
        commands, node.commands = node.commands, []
        for command in commands:
            command()
        self._step(node)

    def _handle(self, node: _Node, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            leg = node.legs[out.request_id]
            if out.reserved_block_ids is not None:  # a queued reservation was admitted
                self._send_prefill(leg, out.num_cached_tokens)
            elif leg.push is not None:  # a prefill node's request ends at its first token; its KV is on the way
                node.outstanding -= 1
                assert out.finished and leg.push.landed_s is not None
                self._at(leg.push.landed_s, functools.partial(self._kv_landed, leg, out.new_token_ids[0]))
            else:
                leg.num_tokens += len(out.new_token_ids)
                if leg.first_token_s is None and out.new_token_ids:
                    leg.first_token_s = self.now
                    node.prefill_backlog -= leg.backlog
                if out.finished:
                    self._finish(leg)

    def _finish(self, leg: _Leg) -> None:
        req = leg.request
        assert leg.first_token_s is not None
        leg.node.outstanding -= 1
        del leg.node.legs[_request_id(req)]
        self._done[req.index] = RequestTiming(req.index, req.kind, req.arrival_s, leg.first_token_s, self.now,
                                              leg.num_tokens)


def _request_id(req: TimedRequest) -> str:
    return str(req.index)

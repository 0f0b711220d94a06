"""A discrete-event simulation of a deployment serving a workload, step by step, with a fitted step cost.

Each node runs the token-budget scheduler (``common.engine.scheduler``) as a model: decoding requests
first, oldest first (1 token each), then prefill chunks of at most ``max_prefill_chunk`` for the running
prompts and the waiting ones (admitted when reached, as ``max_num_seqs`` allows) in the scheduler's
``prefill_order`` (its sort key and pass-over count, shared), while the budget (``max_num_batched_tokens``)
lasts; a step costs ``CostModel.step_s`` of what it computes, and requests that arrive
during a step wait for the next one. KV memory is not modelled (the admission queue makes a full cache
wait, not fail). Prefix caching: a node skips the full blocks of a prompt it has computed before.

- colocated: N replicas, each request to the one with the fewest outstanding requests (the client's rule).
- disaggregated: a prefill node (most cached blocks of the prompt, then fewest outstanding) prefills,
  pushing each chunk's KV on its link as the chunk completes (``kv_transfer_per_token_s`` per token not
  already cached on the decode node, one transfer at a time per link); the first token reaches the client
  when the last chunk's KV has landed, and the request joins the decode node's running batch then.
- conditional: the same, but the gateway's rule (``gateway.prefill_policy.local_wins``: prefill backlogs in
  tokens) decides which prompts the decode node prefills itself, chunks mixed into its decode steps: those
  of at most ``local_prefill_max_tokens`` unless it is busy prefilling long ones, and longer ones when it
  gives the first token sooner and nothing waits there.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from benchmarks.planner.cost_model import CostModel, StepShape
from benchmarks.slo import SLO, Attainment
from common.config.engine_config import SchedulerConfig
from common.engine.scheduling_policy import count_prefill_skips, prefill_priority
from gateway.prefill_policy import LocalPrefillPolicy, local_wins

if TYPE_CHECKING:
    from benchmarks.workloads import TimedRequest


@dataclass(frozen=True)
class NodeLimits:
    """The scheduler's knobs (``SchedulerConfig``'s defaults; `tandem plan` passes a serving node's, by device)."""

    max_num_batched_tokens: int = 2048
    max_prefill_chunk: int | None = 512
    max_num_seqs: int = 128
    block_size: int = 16
    prefix_caching: bool = True
    prefill_order: str = SchedulerConfig.prefill_order
    max_prefill_skips: int = SchedulerConfig.max_prefill_skips


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
class _Job:
    request: TimedRequest
    keys: list[int]  # chained hashes of the prompt's full blocks (what a prefix cache matches)
    prompt_len: int
    target: int  # tokens this node takes it to: prompt + outputs, or the prompt + 1 sampled on a prefill node
    computed: int = 0
    outputs: int = 0
    first_token_s: float | None = None
    decode_node: _Node | None = None  # a prefill node's job: where its KV goes
    backlog: int = 0  # tokens it adds to its node's prefill backlog until its first token (as the gateway counts)
    arrival_seq: int = 0  # its node's arrival order (the scheduler's prefill order uses it)
    prefill_skips: int = 0
    admitted: bool = False

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.outputs


@dataclass(eq=False)
class _Node:
    index: int
    prefill_only: bool  # ends requests at their first token and pushes their KV
    waiting: deque[_Job] = field(default_factory=deque)
    running: list[_Job] = field(default_factory=list)
    busy: bool = False
    outstanding: int = 0
    cached: set[int] = field(default_factory=set)  # block keys computed here (no eviction)
    link_free_s: float = 0.0  # a prefill node's KV link
    prefill_backlog: int = 0  # the gateway's view: prompt tokens sent here still without their first token

    def cached_tokens(self, keys: list[int], prompt_len: int, block: int) -> int:
        """Tokens of the prompt's leading full blocks cached here; the last prompt token is always computed."""
        n = 0
        for key in keys[: (prompt_len - 1) // block]:
            if key not in self.cached:
                break
            n += block
        return n


def block_keys(prompt: Sequence[int], block: int) -> list[int]:
    """Chained hashes of ``prompt``'s full blocks: equal keys mean equal prefixes (as ``common.kv`` hashes)."""
    keys: list[int] = []
    for end in range(block, len(prompt) + 1, block):
        keys.append(hash((keys[-1] if keys else None, tuple(prompt[end - block : end]))))
    return keys


def simulate(requests: Sequence[TimedRequest], deployment: Deployment, cost: CostModel,
             limits: NodeLimits | None = None) -> SimResult:
    """Run ``requests`` (arrival times in seconds) through ``deployment``; every request completes."""
    limits = limits or NodeLimits()
    prefill_nodes = [_Node(i, prefill_only=True) for i in range(deployment.num_prefill)]
    serve_nodes = [_Node(i, prefill_only=False) for i in range(deployment.num_decode)]
    events: list[tuple[float, int, Callable[[float], None]]] = []
    order = itertools.count()
    rotation = itertools.count()
    arrivals = itertools.count()
    done: dict[int, RequestTiming] = {}
    block = limits.block_size
    policy = LocalPrefillPolicy(max_tokens=deployment.local_prefill_max_tokens)

    def at(t: float, action: Callable[[float], None]) -> None:
        heapq.heappush(events, (t, next(order), action))

    def least_loaded(nodes: list[_Node], keys: list[int] | None = None, prompt_len: int = 0) -> _Node:
        start = next(rotation)
        return min(nodes, key=lambda n: (-n.cached_tokens(keys, prompt_len, block) if keys else 0,
                                         n.outstanding, (n.index - start) % len(nodes)))

    def arrive(req: TimedRequest, now: float) -> None:
        n = len(req.prompt_token_ids)
        keys = block_keys(req.prompt_token_ids, block) if limits.prefix_caching else []
        decode = least_loaded(serve_nodes)
        decode.outstanding += 1
        if deployment.colocated or prefill_here(decode, keys, n):
            job = _Job(req, keys, n, n + req.output_len, backlog=0 if deployment.colocated else n,
                       arrival_seq=next(arrivals))
            decode.prefill_backlog += job.backlog
            decode.waiting.append(job)
            kick(decode, now)
            return
        node = least_loaded(prefill_nodes, keys, n)  # prefix-cache affinity first, then load
        node.outstanding += 1
        job = _Job(req, keys, n, n + 1, decode_node=decode, backlog=max(1, n - node.cached_tokens(keys, n, block)),
                   arrival_seq=next(arrivals))
        node.prefill_backlog += job.backlog
        node.waiting.append(job)
        kick(node, now)

    def prefill_here(decode: _Node, keys: list[int], n: int) -> bool:
        """Conditional disaggregation: the gateway's rule (``gateway.prefill_policy``) on the simulated backlogs."""
        if policy.max_tokens == 0:
            return False
        return local_wins(policy, n, decode.prefill_backlog,
                                                 [(p.prefill_backlog, p.cached_tokens(keys, n, block))
                                                  for p in prefill_nodes])

    def kick(node: _Node, now: float) -> None:
        if node.busy:
            return
        chunks = schedule(node)
        if not chunks:
            return
        node.busy = True
        shape = StepShape.of((start, n, job.computed >= job.prompt_len) for job, start, n in chunks)
        at(now + cost.step_s(shape), lambda t: step_done(node, chunks, t))

    def schedule(node: _Node) -> list[tuple[_Job, int, int]]:
        budget = limits.max_num_batched_tokens
        chunks: list[tuple[_Job, int, int]] = []
        prefilling: list[_Job] = []
        for job in node.running:
            if budget <= 0:
                break
            if job.num_tokens - job.computed > 1:
                prefilling.append(job)
                continue
            chunks.append((job, job.computed, 1))
            budget -= 1
        candidates = prefilling + list(node.waiting)
        if limits.prefill_order == "shortest":
            candidates.sort(key=lambda j: prefill_priority(j.num_tokens - j.computed, j.arrival_seq,
                                                           j.prefill_skips >= limits.max_prefill_skips))
        scheduled: list[_Job] = []
        for job in candidates:
            if budget <= 0:
                break
            if not job.admitted:
                if len(node.running) >= limits.max_num_seqs:
                    continue
                node.waiting.remove(job)
                job.admitted = True
                job.computed = node.cached_tokens(job.keys, job.prompt_len, block)
                node.running.append(job)
            n = chunk_size(job, budget)
            chunks.append((job, job.computed, n))
            scheduled.append(job)
            budget -= n
        count_prefill_skips(candidates, scheduled)
        return chunks

    def chunk_size(job: _Job, budget: int) -> int:
        n = min(job.num_tokens - job.computed, budget)
        return min(n, limits.max_prefill_chunk) if n > 1 and limits.max_prefill_chunk is not None else n

    def step_done(node: _Node, chunks: list[tuple[_Job, int, int]], now: float) -> None:
        node.busy = False
        for job, start, n in chunks:
            job.computed = start + n
            node.cached.update(job.keys[: min(job.computed, job.prompt_len) // block])
            if node.prefill_only:
                push_kv(node, job, start, n, now)
            if job.computed < job.num_tokens:
                continue  # a prefill chunk that does not reach the end samples nothing
            job.outputs += 1
            if job.first_token_s is None and not node.prefill_only:
                job.first_token_s = now
                node.prefill_backlog -= job.backlog
            if node.prefill_only or job.outputs == job.request.output_len:
                node.running.remove(job)
                node.outstanding -= 1
                if not node.prefill_only:
                    finish(job, now)
        kick(node, now)

    def push_kv(node: _Node, job: _Job, start: int, n: int, now: float) -> None:
        decode = job.decode_node
        assert decode is not None
        # The decode node's own prefix cache holds some blocks already: those are not sent.
        have = decode.cached_tokens(job.keys, job.prompt_len, block)
        end = min(start + n, job.prompt_len)
        node.link_free_s = max(node.link_free_s, now) + cost.kv_transfer_per_token_s * max(0, end - max(start, have))
        if start + n >= job.prompt_len:
            at(node.link_free_s, lambda t: kv_arrived(node, decode, job, t))

    def kv_arrived(prefill: _Node, decode: _Node, job: _Job, now: float) -> None:
        job.first_token_s = now
        prefill.prefill_backlog -= job.backlog  # the Prefill call answers
        decode.cached.update(job.keys)
        if job.request.output_len == 1:
            decode.outstanding -= 1
            finish(job, now)
            return
        # Joins the running batch with its prompt's KV and the first token (decoding from here on).
        decoding = _Job(job.request, job.keys, job.prompt_len, job.prompt_len + job.request.output_len,
                        computed=job.prompt_len, outputs=1, first_token_s=now, admitted=True)
        decode.running.append(decoding)
        kick(decode, now)

    def finish(job: _Job, now: float) -> None:
        assert job.first_token_s is not None
        done[job.request.index] = RequestTiming(job.request.index, job.request.kind, job.request.arrival_s,
                                                job.first_token_s, now, job.request.output_len)

    for req in requests:
        at(req.arrival_s, functools.partial(arrive, req))
    while events:
        t, _, action = heapq.heappop(events)
        action(t)
    assert len(done) == len(requests), f"{len(requests) - len(done)} requests never finished"
    return SimResult(deployment, tuple(done[r.index] for r in requests))

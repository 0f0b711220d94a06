"""The serving benchmark's client: sends a workload's requests over gRPC and records what it saw of each.

Open loop: each request leaves at its ``arrival_s`` whatever the answers do (a system slower than the
load builds a queue, as in production). Closed loop: ``concurrency`` requests in flight at all times, sent
in the workload's order. Every time is the client's ``time.perf_counter``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.workloads import TimedRequest
    from tandem.v1.generate_pb2_grpc import TandemStub


@dataclass
class RequestRecord:
    """What the client saw of one request (``time.perf_counter`` seconds)."""

    index: int
    kind: str
    prompt_len: int
    expected_tokens: int
    target: str = ""
    sent: float = 0.0
    first: float | None = None  # the first message carrying tokens
    last: float | None = None
    num_tokens: int = 0
    num_messages: int = 0
    gaps: list[float] = field(default_factory=list)  # between consecutive token-carrying messages
    # The server's own account, from the last message's timings: admission to the start of the prefill
    # compute, and the KV transfer from prefill to decode node (0 when colocated).
    queue_s: float | None = None
    kv_transfer_s: float | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.first is not None

    @property
    def ttft_s(self) -> float | None:
        """Sent -> first token; None unless the request completed."""
        return self.first - self.sent if self.ok and self.first is not None else None

    @property
    def tpot_s(self) -> float | None:
        """(last token - first token) / (tokens - 1); None unless completed with two tokens or more."""
        if not self.ok or self.first is None or self.last is None or self.num_tokens < 2:
            return None
        return (self.last - self.first) / (self.num_tokens - 1)

    @property
    def e2e_s(self) -> float | None:
        return self.last - self.sent if self.ok and self.last is not None else None


async def _send(stub: TandemStub, req: TimedRequest, record: RequestRecord, timeout_s: float) -> None:
    import grpc

    from tandem.v1 import common_pb2, generate_pb2

    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=req.prompt_token_ids),
        sampling=common_pb2.SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True),
        stream=generate_pb2.StreamOptions(include_token_ids=True, skip_text=True),
    )
    record.sent = time.perf_counter()
    try:
        async for response in stub.Generate(request, timeout=timeout_s):
            if response.HasField("timings"):
                record.queue_s = response.timings.queue_seconds
                record.kv_transfer_s = response.timings.kv_transfer_seconds
            n = len(response.token_ids)
            if not n:
                continue
            now = time.perf_counter()
            if record.last is not None:
                record.gaps.append(now - record.last)
            record.first = record.first or now
            record.last = now
            record.num_tokens += n
            record.num_messages += 1
    except grpc.aio.AioRpcError as exc:
        record.error = f"{exc.code().name}: {exc.details()}"


async def drive(targets: Sequence[str], requests: Sequence[TimedRequest], concurrency: int | None,
                timeout_s: float = 600.0) -> tuple[list[RequestRecord], float]:
    """Send ``requests`` at their ``arrival_s`` (open loop, ``concurrency`` None) or ``concurrency`` at a
    time in their order (closed loop); return the records and the run's duration (first send to last
    answer)."""
    import grpc

    from tandem.v1 import generate_pb2_grpc

    channels = [grpc.aio.insecure_channel(t) for t in targets]
    stubs = [generate_pb2_grpc.TandemStub(c) for c in channels]
    outstanding = [0] * len(targets)
    rotation = itertools.count()
    records = [RequestRecord(r.index, r.kind, len(r.prompt_token_ids), r.output_len) for r in requests]

    async def one(i: int) -> None:
        # Fewest outstanding requests first; ties rotate, so an idle pair of replicas shares the load.
        start = next(rotation)
        k = min(range(len(targets)), key=lambda j: (outstanding[j], (j - start) % len(targets)))
        outstanding[k] += 1
        records[i].target = targets[k]
        try:
            await _send(stubs[k], requests[i], records[i], timeout_s)
        finally:
            outstanding[k] -= 1

    began = time.perf_counter()
    try:
        if concurrency is not None:
            pending = iter(range(len(requests)))

            async def worker() -> None:
                for i in pending:
                    await one(i)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:

            async def at(i: int) -> None:
                await asyncio.sleep(max(0.0, began + requests[i].arrival_s - time.perf_counter()))
                await one(i)

            await asyncio.gather(*(at(i) for i in range(len(requests))))
    finally:
        await asyncio.gather(*(c.close() for c in channels))
    return records, time.perf_counter() - began

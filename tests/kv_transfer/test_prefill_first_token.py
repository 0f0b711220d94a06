"""The prefill node answers its caller with the first token before anything of the KV transfer: before the
engine has replied to the destination's attach, and before the decode node is told the prompt is done (the
transfer's ``complete``). The servicer over a scripted engine and sender, so each step can be held."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import grpc

from common.engine.commands import AbortRequest, AddRequest, AttachDestination
from common.engine.request import RequestOutput
from common.serving.errors import ServiceError
from kv_transfer.transfer_handle import TransferStats
from prefill_service.kv_producer import KVProducer
from prefill_service.servicer import PrefillServicer
from tandem.v1 import common_pb2, prefill_pb2

BLOCK = 16
PROMPT = list(range(3, 43))  # 40 tokens: 3 blocks
FIRST_TOKEN = 42


class _Engine:
    """What the servicer uses of ``AsyncEngine``: the prompt's first token comes as soon as it is added; the
    attach replies only once ``attach_reply`` is set (with ``attached``)."""

    def __init__(self, attached: bool = True) -> None:
        self.engine = SimpleNamespace(connector=KVProducer(BLOCK), block_size=BLOCK, stats=lambda: None)
        self.log: list[str]
        self.attach_reply = asyncio.Event()
        self.attached = attached
        self.submitted: list[object] = []
        self._queues: dict[str, asyncio.Queue[RequestOutput | Exception]] = {}

    def open_stream(self, request_id: str) -> asyncio.Queue[RequestOutput | Exception]:
        q: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._queues[request_id] = q
        return q

    def close_stream(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def stream(self, request_id: str, q: asyncio.Queue[RequestOutput | Exception]
                     ) -> AsyncIterator[RequestOutput]:
        while True:
            item = await q.get()
            assert isinstance(item, RequestOutput)
            yield item
            if item.finished:
                return

    async def call(self, command: object) -> Any:
        if isinstance(command, AddRequest):
            self._queues[command.request_id].put_nowait(RequestOutput(
                command.request_id, [FIRST_TOKEN], finished=True, num_prompt_tokens=len(PROMPT)))
            return None
        assert isinstance(command, AttachDestination)
        await self.attach_reply.wait()
        self.log.append("attached")
        return self.attached

    def submit(self, command: object) -> None:
        self.submitted.append(command)


class _Handle:
    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.transfer_id = "t-1"

    def complete(self, first_token: int, first_logprob: object, cached: int) -> None:
        self.log.append("complete")

    async def wait(self, timeout_s: float) -> TransferStats:
        return TransferStats(bytes=3 * 1024, seconds=0.001, num_chunks=1, num_sends=1)

    def abort(self, reason: str) -> None:
        self.log.append("abort")


class _Sender:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def open(self, transfer_id: str, dest: object, trace_context: object) -> _Handle:
        return _Handle(self.log)


class _Context:
    """A server context that records what is written to the caller."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.answers: list[prefill_pb2.PrefillResponse] = []

    async def write(self, message: prefill_pb2.PrefillResponse) -> None:
        self.answers.append(message)
        self.log.append("early" if message.kv_pending else "final")

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def cancelled(self) -> bool:
        return False


async def _messages() -> AsyncIterator[prefill_pb2.PrefillMessage]:
    yield prefill_pb2.PrefillMessage(request=prefill_pb2.PrefillRequest(
        request_id="r-1", prompt_token_ids=PROMPT,
        sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0)))
    yield prefill_pb2.PrefillMessage(destination=prefill_pb2.KVDestination(
        kv_endpoint="127.0.0.1:1", node_id="decode-0", transfer_id="t-1", block_ids=[7, 8, 9]))


async def _serve(engine: _Engine) -> tuple[asyncio.Task[None], _Context, list[str]]:
    log: list[str] = []
    engine.log = log
    context = _Context(log)
    servicer = PrefillServicer(engine, _Sender(log), "prefill-0", transfer_timeout_s=5.0)  # type: ignore[arg-type]
    task = asyncio.ensure_future(servicer.PrefillStream(_messages(), context))  # type: ignore[arg-type]
    deadline = asyncio.get_running_loop().time() + 10.0  # until the early answer is out (bounded)
    while not log and not task.done() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.005)
    return task, context, log


def test_the_first_token_is_answered_before_the_attach_replies_and_the_transfer_completes() -> None:
    async def run() -> tuple[list[str], list[str], _Context]:
        engine = _Engine()
        task, context, log = await _serve(engine)
        before = list(log)  # the attach is still held here
        engine.attach_reply.set()
        await asyncio.wait_for(task, timeout=10)
        return before, log, context

    before, log, context = asyncio.run(run())
    assert before == ["early"]
    assert log == ["early", "attached", "complete", "final"]
    early, final = context.answers
    assert early.kv_pending and early.first_token == FIRST_TOKEN
    assert not final.kv_pending and final.first_token == FIRST_TOKEN and final.transfer_bytes == 3 * 1024


def test_a_failed_attach_after_the_first_token_ends_the_call_and_aborts_the_transfer() -> None:
    async def run() -> tuple[list[str], _Engine, BaseException | None]:
        engine = _Engine(attached=False)
        task, _, log = await _serve(engine)
        engine.attach_reply.set()
        done, _ = await asyncio.wait({task}, timeout=10)
        assert done, "the call did not end"
        return log, engine, task.exception()

    log, engine, failure = asyncio.run(run())
    assert isinstance(failure, ServiceError) and failure.code == grpc.StatusCode.INTERNAL
    assert "left the prefill engine" in str(failure)
    assert log == ["early", "attached", "abort"]  # the caller has the first token; the decode node hears the abort
    assert [type(c) for c in engine.submitted] == [AbortRequest]

"""``coalesced_chunks``: what both backends (coordinator, colocated server) send the client, over SmolLM2 tokens."""

from __future__ import annotations

import asyncio

import pytest

from common.sampling.params import SamplingParams
from gateway.model import ServedModel
from gateway.output import Delta, OutputChunk, OutputProcessor, coalesced_chunks
from gateway.request import GatewayRequest
from tandem.v1 import common_pb2
from tests.gateway.scripted_nodes import run_async

LENGTH = common_pb2.FINISH_REASON_LENGTH


class _Failed(Exception):
    pass


def _to_delta(item: Delta | Exception) -> Delta:
    if isinstance(item, Exception):
        raise item
    return item


async def _collect(out: OutputProcessor, items: list[Delta | Exception], req: GatewayRequest,
                   first: OutputChunk | None = None) -> list[OutputChunk]:
    queue: asyncio.Queue[Delta | Exception] = asyncio.Queue()
    for item in items:  # all queued before the first read: they coalesce into one chunk
        queue.put_nowait(item)
    return [chunk async for chunk in coalesced_chunks(out, queue, _to_delta, req, first)]


def _processor(model: ServedModel, req: GatewayRequest) -> OutputProcessor:
    return OutputProcessor(model.tokenizer, req.prompt_token_ids, req.stop, req.include_stop_string)


@pytest.mark.real_model
def test_queued_deltas_coalesce_and_the_source_finishes(served_model: ServedModel) -> None:
    tok = served_model.tokenizer
    ids = tok.encode(" one two three", add_special_tokens=False)
    req = GatewayRequest("r", tuple(tok.encode("Count:")), SamplingParams())
    out = _processor(served_model, req)
    chunks = run_async(_collect(out, [Delta(ids[:1]), Delta(ids[1:]), Delta([], (), LENGTH)], req))
    assert len(chunks) == 1  # three deltas, one message
    assert chunks[0].text == " one two three" and chunks[0].token_ids == ids
    assert chunks[0].finish_reason == LENGTH and out.source_finished and out.num_tokens == len(ids)


@pytest.mark.real_model
def test_first_chunk_at_once_then_only_visible_ones(served_model: ServedModel) -> None:
    tok = served_model.tokenizer
    ids = tok.encode(" a b", add_special_tokens=False)
    # skip_text without token ids: the client sees nothing until the finish
    req = GatewayRequest("r", (1,), SamplingParams(), skip_text=True)
    out = _processor(served_model, req)

    async def scenario() -> list[OutputChunk]:
        queue: asyncio.Queue[Delta] = asyncio.Queue()
        stream = coalesced_chunks(out, queue, _to_delta, req)
        queue.put_nowait(Delta(ids[:1]))
        chunks = [await anext(stream)]  # the first batch, invisible but at once: the time to first token
        queue.put_nowait(Delta(ids[1:]))
        rest = asyncio.ensure_future(anext(stream))
        while not queue.empty():  # let the stream take the second delta on its own
            await asyncio.sleep(0)
        queue.put_nowait(Delta([], (), LENGTH))
        chunks.append(await rest)
        chunks.extend([chunk async for chunk in stream])
        return chunks

    chunks = run_async(scenario())
    # The second delta's chunk showed nothing to this client, so it was not sent on its own.
    assert [(c.token_ids, c.finish_reason) for c in chunks] == [(ids[:1], None), ([], LENGTH)]
    assert out.num_tokens == len(ids)


@pytest.mark.real_model
def test_given_first_chunk_leads_and_a_stop_string_leaves_the_source_running(served_model: ServedModel) -> None:
    tok = served_model.tokenizer
    ids = tok.encode(" go now stop here", add_special_tokens=False)
    req = GatewayRequest("r", (1,), SamplingParams(), stop=("stop",))
    out = _processor(served_model, req)
    first = OutputChunk()
    out.add(first, ids[:1])  # as from a prefill node's answer
    chunks = run_async(_collect(out, [Delta(ids[1:]), Delta([], (), LENGTH)], req, first))
    assert chunks[0] is first
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_STOP and chunks[-1].stop_string == "stop"
    assert not out.source_finished  # the backend must abort the rest
    assert "".join(c.text for c in chunks) == " go now "


@pytest.mark.real_model
def test_a_failed_source_ends_the_stream(served_model: ServedModel) -> None:
    req = GatewayRequest("r", (1,), SamplingParams())
    out = _processor(served_model, req)
    with pytest.raises(_Failed):
        run_async(_collect(out, [Delta([42]), _Failed()], req))
    assert not out.finished and not out.source_finished

"""Turn generated token ids into what the client sees: text deltas, stop strings, finish, usage, timings.

Token logprobs stay ``TokenLogprob`` protos: the gateway relays them from the nodes to the client untouched.
Both backends (the gateway's coordinator and the colocated server) queue what their source produces and
turn it into client messages with ``coalesced_chunks``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from common.detokenizer import IncrementalDetokenizer
from common.tokenizer import Tokenizer
from gateway.stop_strings import StopStringMatcher
from tandem.v1 import common_pb2

if TYPE_CHECKING:
    from gateway.request import GatewayRequest

FinishReason = common_pb2.FinishReason
FINISH_STOP = common_pb2.FINISH_REASON_STOP

T = TypeVar("T")  # what a backend queues: a decode node's message, an engine output, or the error that ended it


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens the prefill node did not recompute (its prefix cache)


@dataclass(frozen=True)
class Timings:
    queue_seconds: float  # gateway admission to the start of the prefill compute
    time_to_first_token: float  # gateway admission to the first token handed to gRPC
    e2e_seconds: float
    kv_transfer_seconds: float
    kv_transfer_bytes: int
    prefill_node: str
    decode_node: str


@dataclass
class OutputChunk:
    """One message to the client: everything produced since the previous one (several engine steps when
    the client reads slower than the engine generates). ``finish_reason`` is set on the last one only."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_string: str = ""
    usage: Usage | None = None
    timings: Timings | None = None


@dataclass(frozen=True)
class Delta:
    """New tokens from the source (a decode node, an engine); ``finish_reason`` on its last delta only."""

    token_ids: Sequence[int]
    logprobs: Sequence[common_pb2.TokenLogprob] = ()
    finish_reason: FinishReason | None = None


class OutputProcessor:
    """Detokenizes incrementally and applies stop strings for one request."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = (),
                 include_stop_string: bool = False) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, list(prompt_token_ids))
        self._matcher = StopStringMatcher(stop, include_stop_string) if stop else None
        self.num_tokens = 0  # completion tokens, up to the one that completed a stop string
        # Every token taken (each one's text is sent, or held back for a stop string): what a request that
        # loses its node continues after (gateway/coordinator.py's migration).
        self.token_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        # The source sent its finish reason, so its stream ends by itself; when a stop string (or a failure)
        # ends the request first, the backend must abort what still runs.
        self.source_finished = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, chunk: OutputChunk, token_ids: Sequence[int], logprobs: Sequence[common_pb2.TokenLogprob] = (),
            finish_reason: FinishReason | None = None) -> None:
        """Append new tokens (and the engine's finish reason, if this is its last delta) to ``chunk``.

        A stop string ends the generation at the token that completed it; later tokens are dropped.
        """
        assert not self.finished, "tokens after the generation finished"
        if finish_reason:
            self.source_finished = True
        for i, token_id in enumerate(token_ids):
            self.num_tokens += 1
            self.token_ids.append(token_id)
            chunk.token_ids.append(token_id)
            if i < len(logprobs):
                chunk.logprobs.append(logprobs[i])
            piece = self._detok.add([token_id])
            if self._matcher is None:
                chunk.text += piece
                continue
            emit, stop = self._matcher.feed(piece)
            chunk.text += emit
            if stop is not None:
                self.finish_reason = chunk.finish_reason = FINISH_STOP
                chunk.stop_string = stop
                return
        if finish_reason:
            if self._matcher is not None:
                chunk.text += self._matcher.flush()
            self.finish_reason = chunk.finish_reason = finish_reason


def visible(chunk: OutputChunk, req: GatewayRequest) -> bool:
    """Whether the client would see anything in ``chunk`` (text may be held back for a stop string)."""
    return bool((chunk.text and not req.skip_text) or (chunk.token_ids and req.include_token_ids) or chunk.logprobs)


async def coalesced_chunks(out: OutputProcessor, queue: asyncio.Queue[T], to_delta: Callable[[T], Delta],
                           req: GatewayRequest, first: OutputChunk | None = None,
                           ) -> AsyncGenerator[OutputChunk, None]:
    """``req``'s output chunks, made by ``out`` from what the backend queues, until ``out`` finishes.

    Each chunk carries everything that queued up while the previous one was written, so the source never
    waits for a slow client. The first chunk is yielded at once, even when its text is held back (it is the
    time to first token): ``first`` when the first token came another way (a prefill node's answer), else
    the queue's first batch. Later chunks are yielded when the client would see something in them, and the
    finishing one (``out.finished``) always; the caller adds usage and timings to that last one.
    ``to_delta`` raises to end the request (a failed source); what came before the failure is yielded first
    (when the client would see it), so a backend that continues the request elsewhere loses no token.
    """
    if first is not None:
        yield first
    at_once = first is None
    while not out.finished:
        chunk = OutputChunk()
        items = [await queue.get()]
        while not queue.empty():  # coalesce whatever arrived while the previous chunk was written
            items.append(queue.get_nowait())
        for item in items:
            try:
                delta = to_delta(item)
            except BaseException:
                if visible(chunk, req):
                    yield chunk
                raise
            out.add(chunk, delta.token_ids, delta.logprobs, delta.finish_reason)
            if out.finished:
                break
        if at_once or out.finished or visible(chunk, req):
            yield chunk
        at_once = False

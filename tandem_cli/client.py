"""A small gRPC streaming client for a running gateway (``tandem generate --url``)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc


@dataclass(frozen=True)
class StreamResult:
    text: str
    num_tokens: int
    finish_reason: str
    ttft_s: float
    total_s: float
    usage: generate_pb2.Usage


def build_request(prompt: str, chat: bool, max_tokens: int, temperature: float, top_p: float,
                  top_k: int | None, seed: int | None, stop: list[str] | None = None) -> generate_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p)
    if top_k is not None:
        sampling.top_k = top_k
    if seed is not None:
        sampling.seed = seed
    request = generate_pb2.GenerateRequest(sampling=sampling, stop=stop or [],
                                           stream=generate_pb2.StreamOptions(include_token_ids=True))
    if chat:
        request.chat.messages.append(generate_pb2.ChatMessage(role="user", content=prompt))
    else:
        request.text = prompt
    return request


def stream_generate(target: str, request: generate_pb2.GenerateRequest, timeout_s: float = 600.0,
                    out: object = sys.stdout) -> StreamResult:
    """Stream one generation from the gateway at ``target``, writing text as it arrives."""
    start = time.perf_counter()
    first: float | None = None
    pieces: list[str] = []
    tokens = 0
    finish = "unspecified"
    usage = generate_pb2.Usage()
    with grpc.insecure_channel(target) as channel:
        stub = generate_pb2_grpc.TandemStub(channel)
        responses: Iterator[generate_pb2.GenerateResponse] = stub.Generate(request, timeout=timeout_s)
        for response in responses:
            if first is None and (response.text or response.token_ids):
                first = time.perf_counter()
            tokens += len(response.token_ids)
            if response.text:
                pieces.append(response.text)
                out.write(response.text)  # type: ignore[attr-defined]
                out.flush()  # type: ignore[attr-defined]
            if response.finish_reason:
                finish = common_pb2.FinishReason.Name(response.finish_reason).removeprefix("FINISH_REASON_").lower()
                usage = response.usage
    end = time.perf_counter()
    return StreamResult("".join(pieces), tokens, finish, (first or end) - start, end - start, usage)

"""Small streaming clients for a running server (``tandem generate --url``): gRPC (``host:port``) or the
OpenAI-compatible HTTP API (``http://host:port``, standard library only)."""

from __future__ import annotations

import json
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from common.config.settings import SecuritySettings
from common.serving.security import bearer_metadata, channel_credentials
from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc


@dataclass(frozen=True)
class StreamResult:
    text: str  # sample 0's
    num_tokens: int  # all samples together
    finish_reason: str  # each sample's, comma-separated
    ttft_s: float
    total_s: float
    usage: generate_pb2.Usage  # completion tokens of all samples
    samples: tuple[str, ...] = ()  # every sample's text, by index


@dataclass(frozen=True)
class ClientSecurity:
    """What ``tandem generate --url`` (and the demo) presents to a secured gateway: the API key, the CA
    that signed the gateway's certificate (``https://`` or a TLS gRPC port), and a client certificate for a
    server that wants one."""

    api_key: str = ""
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None

    def __post_init__(self) -> None:
        for name in ("tls_ca", "tls_cert", "tls_key"):
            if isinstance(getattr(self, name), str):
                value = getattr(self, name)
                object.__setattr__(self, name, Path(value).expanduser() if value else None)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """gRPC TLS credentials, or None for a plaintext channel."""
        return channel_credentials(SecuritySettings(self.tls_cert, self.tls_key, self.tls_ca))

    def ssl_context(self) -> ssl.SSLContext | None:
        """For ``https://``: verify the server with ``tls_ca`` (None: the default context, system roots)."""
        if self.tls_ca is None:
            return None
        context = ssl.create_default_context(cafile=str(self.tls_ca))
        if self.tls_cert is not None and self.tls_key is not None:
            context.load_cert_chain(str(self.tls_cert), str(self.tls_key))
        return context


def build_request(prompt: str, chat: bool, max_tokens: int, temperature: float, top_p: float,
                  top_k: int | None, seed: int | None, stop: list[str] | None = None, ignore_eos: bool = False,
                  n: int = 1) -> generate_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                         ignore_eos=ignore_eos)
    if top_k is not None:
        sampling.top_k = top_k
    if seed is not None:
        sampling.seed = seed
    request = generate_pb2.GenerateRequest(sampling=sampling, stop=stop or [], n=n,
                                           stream=generate_pb2.StreamOptions(include_token_ids=True))
    if chat:
        request.chat.messages.append(generate_pb2.ChatMessage(role="user", content=prompt))
    else:
        request.text = prompt
    return request


class _Collector:
    """Text per sample; sample 0's is written as it arrives (the others once they are all done)."""

    def __init__(self, n: int, out: Any) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.pieces: list[list[str]] = [[] for _ in range(n)]
        self.finish: list[str] = ["unspecified"] * n
        self.tokens = 0
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0
        self._out = out

    def add(self, index: int, text: str, num_tokens: int) -> None:
        if self.first is None and (text or num_tokens):
            self.first = time.perf_counter()
        self.tokens += num_tokens
        if text:
            self.pieces[index].append(text)
            if index == 0:
                self._out.write(text)
                self._out.flush()

    def result(self) -> StreamResult:
        end = time.perf_counter()
        samples = tuple("".join(p) for p in self.pieces)
        for i, text in enumerate(samples[1:], start=1):
            self._out.write(f"\n[sample {i}]\n{text}")
        usage = generate_pb2.Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                                   cached_tokens=self.cached_tokens)
        return StreamResult(samples[0], self.tokens, ",".join(self.finish), (self.first or end) - self.start,
                            end - self.start, usage, samples)


def stream_generate(target: str, request: generate_pb2.GenerateRequest, timeout_s: float = 600.0,
                    out: object = sys.stdout, api_key: str = "",
                    credentials: grpc.ChannelCredentials | None = None) -> StreamResult:
    """Stream one generation from the gateway at ``target``, writing text as it arrives. ``api_key``: the
    gateway's bearer token; ``credentials``: TLS (``ClientSecurity.channel_credentials``)."""
    got = _Collector(request.n or 1, out)
    with (grpc.secure_channel(target, credentials) if credentials is not None
          else grpc.insecure_channel(target)) as channel:
        stub = generate_pb2_grpc.TandemStub(channel)
        responses: Iterator[generate_pb2.GenerateResponse] = stub.Generate(request, timeout=timeout_s,
                                                                           metadata=bearer_metadata(api_key))
        for response in responses:
            got.add(response.index, response.text, len(response.token_ids))
            if response.finish_reason:
                got.finish[response.index] = common_pb2.FinishReason.Name(response.finish_reason).removeprefix(
                    "FINISH_REASON_").lower()
                got.prompt_tokens = response.usage.prompt_tokens
                got.completion_tokens += response.usage.completion_tokens
                got.cached_tokens = max(got.cached_tokens, response.usage.cached_tokens)
    return got.result()


def http_body(request: generate_pb2.GenerateRequest, model: str) -> tuple[str, dict[str, Any]]:
    """The OpenAI path and body that ask for what ``request`` asks (the same sampling, stops and n)."""
    s = request.sampling
    body: dict[str, Any] = {"model": model, "max_tokens": s.max_tokens, "temperature": s.temperature,
                            "top_p": s.top_p, "ignore_eos": s.ignore_eos, "n": request.n or 1, "stream": True,
                            "stream_options": {"include_usage": True}}
    if s.HasField("top_k"):
        body["top_k"] = s.top_k
    if s.HasField("seed"):
        body["seed"] = s.seed
    if request.stop:
        body["stop"] = list(request.stop)
    if request.WhichOneof("input") == "chat":
        body["messages"] = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        return "/v1/chat/completions", body
    body["prompt"] = request.text
    return "/v1/completions", body


def stream_generate_http(url: str, request: generate_pb2.GenerateRequest, timeout_s: float = 600.0,
                         out: object = sys.stdout, api_key: str = "",
                         tls: ssl.SSLContext | None = None) -> StreamResult:
    """``stream_generate`` over the OpenAI-compatible HTTP API at ``url`` (``http(s)://host:port``);
    ``api_key`` goes in ``Authorization: Bearer``, ``tls`` verifies an https server."""
    base = url.rstrip("/").removesuffix("/v1")
    auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        models = _json(urllib.request.urlopen(urllib.request.Request(f"{base}/v1/models", headers=auth),
                                              timeout=timeout_s, context=tls))
        path, body = http_body(request, models["data"][0]["id"])
        http_request = urllib.request.Request(f"{base}{path}", data=json.dumps(body).encode(),
                                              headers={"content-type": "application/json", **auth})
        got = _Collector(request.n or 1, out)
        response = urllib.request.urlopen(http_request, timeout=timeout_s, context=tls)
    except urllib.error.HTTPError as exc:
        raise ValueError(f"{url}: HTTP {exc.code}: {_json(exc).get('error', {}).get('message', '')}") from None
    with response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                raise ValueError(f"{url}: {event['error'].get('message', event['error'])}")
            for choice in event.get("choices", []):
                text = choice.get("text") if "text" in choice else choice.get("delta", {}).get("content")
                got.add(choice["index"], text or "", 0)
                if choice.get("finish_reason"):
                    got.finish[choice["index"]] = choice["finish_reason"]
            if event.get("usage"):
                u = event["usage"]
                got.prompt_tokens, got.completion_tokens = u["prompt_tokens"], u["completion_tokens"]
                got.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                got.tokens = u["completion_tokens"]  # SSE chunks carry text, not tokens: the usage counts them
    return got.result()


def _json(response: Any) -> dict[str, Any]:
    try:
        return dict(json.loads(response.read()))
    except (ValueError, TypeError):
        return {}

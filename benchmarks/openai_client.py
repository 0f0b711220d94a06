"""The serving benchmark's OpenAI-API client: the same workload as ``serve_client`` over the gateway's HTTP
front, as ``vllm bench serve`` drives an OpenAI server.

Each request is a streaming ``POST /v1/completions`` whose ``prompt`` is the workload's token ids (so both
fronts see identical prompts: no chat template, no re-tokenization), greedy, ``ignore_eos``, with
``stream_options.include_usage``. The server-sent events are read raw with ``httpx`` (the ``openai`` client
adds parsing and retries that would be measured too). A chunk carrying text is a streamed message: its
arrival stamps TTFT and the gaps; the token count is the final usage's ``completion_tokens`` (a chunk may
carry several tokens). ``httpx`` is imported on first use: it is a dev/test dependency, as the client is.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx

    from benchmarks.request_record import RequestRecord
    from benchmarks.workloads import TimedRequest


def open_client(limit: int) -> httpx.AsyncClient:
    """One connection pool for a run: up to ``limit`` concurrent streams (HTTP/1.1: one per connection)."""
    import httpx

    return httpx.AsyncClient(limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
                             timeout=httpx.Timeout(None, connect=10.0))


async def served_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The name ``GET /v1/models`` lists first (the gateway serves one model)."""
    response = await client.get(f"{base_url}/v1/models")
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


async def send_openai(client: httpx.AsyncClient, base_url: str, model: str, req: TimedRequest,
                      record: RequestRecord, timeout_s: float, temperature: float | None = 0.0) -> None:
    """Stream one completion into ``record`` (errors land in ``record.error``, never raised).
    ``temperature`` None sends none: the server's default (1.0), as vLLM's benchmark client does."""
    import httpx

    body: dict[str, object] = {"model": model, "prompt": list(req.prompt_token_ids), "max_tokens": req.output_len,
                               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if temperature is not None:
        body["temperature"] = temperature
    record.sent = time.perf_counter()
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body, timeout=timeout_s) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:200]
                record.error = f"HTTP {response.status_code}: {detail}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if usage := chunk.get("usage"):
                    record.num_tokens = int(usage["completion_tokens"])
                if not any(c.get("text") for c in chunk.get("choices", ())):
                    continue
                now = time.perf_counter()
                if record.last is not None:
                    record.gaps.append(now - record.last)
                record.first = record.first or now
                record.last = now
                record.num_messages += 1
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"

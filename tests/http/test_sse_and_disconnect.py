"""The HTTP API on the wire with ``httpx``: the raw server-sent events, /health, bad bodies, and a client
that disconnects (its request is cancelled on both nodes)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from http_cluster import http_cluster
from scripted_nodes import eventually, run_async

from gateway.model import ServedModel

pytestmark = pytest.mark.real_model

CHAT = [{"role": "user", "content": "Hi"}]


def test_raw_server_sent_events(served_model: ServedModel, smollm2_dir: Path) -> None:
    async def scenario() -> None:
        async with http_cluster(served_model, smollm2_dir) as (c, _), httpx.AsyncClient(timeout=10) as http:
            body = {"model": served_model.name, "messages": CHAT, "max_tokens": 4, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with http.stream("POST", f"{c.gateway.http_url}/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/event-stream")
                raw = (await response.aread()).decode()
            events = raw.split("\n\n")
            assert events[-1] == "" and events[-2] == "data: [DONE]"
            payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
            assert all(e.startswith("data: {") for e in events[:-2])
            assert {p["object"] for p in payloads} == {"chat.completion.chunk"}
            assert len({p["id"] for p in payloads}) == 1
            assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 4
            text = "".join(p["choices"][0]["delta"].get("content", "") for p in payloads[:-1])
            expected = served_model.tokenizer.encode(" The quick brown fox", add_special_tokens=False)
            assert text == served_model.tokenizer.decode(expected[:4])

    run_async(scenario())


def test_health_and_malformed_bodies(served_model: ServedModel, smollm2_dir: Path) -> None:
    async def scenario() -> None:
        async with http_cluster(served_model, smollm2_dir) as (c, _), httpx.AsyncClient(timeout=10) as http:
            url = c.gateway.http_url
            assert (await http.get(f"{url}/health")).status_code == 200
            bad = await http.post(f"{url}/v1/completions", content=b"{not json")
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "body"
            wrong_type = await http.post(f"{url}/v1/completions", json={"model": served_model.name, "prompt": "x",
                                                                        "max_tokens": "many"})
            assert wrong_type.status_code == 400
            assert wrong_type.json()["error"] == {"message": "max_tokens: must be an integer, got str",
                                                  "type": "invalid_request_error", "param": "max_tokens",
                                                  "code": None}
            assert (await http.get(f"{url}/v1/nothing")).status_code == 404
        async with (http_cluster(served_model, smollm2_dir, num_prefill=0, dead_prefill=1) as (c, _),
                    httpx.AsyncClient(timeout=10) as http):
            down = await http.get(f"{c.gateway.http_url}/health")
            assert down.status_code == 503 and "prefill" in down.json()["error"]["message"]

    run_async(scenario())


def test_disconnect_while_streaming_cancels_the_decode(served_model: ServedModel, smollm2_dir: Path) -> None:
    async def scenario() -> None:
        async with http_cluster(served_model, smollm2_dir) as (c, _), httpx.AsyncClient(timeout=10) as http:
            c.script.gate = asyncio.Event()  # the decode node holds its tokens: the stream stays open
            body = {"model": served_model.name, "prompt": "Hi", "max_tokens": 8, "stream": True}
            async with http.stream("POST", f"{c.gateway.http_url}/v1/completions", json=body,
                                   headers={"x-request-id": "gone"}) as response:
                lines = response.aiter_lines()
                first = await anext(lines)
                assert first.startswith("data: ") and json.loads(first[6:])["choices"][0]["text"] == " The"
            # Leaving the block closed the connection: the gateway cancels the decode leg.
            await eventually(lambda: c.decodes[0].record.cancelled == ["gone"])
            assert c.decodes[0].record.completed == [] and c.board.open_transfers == 0

    run_async(scenario())


def test_disconnect_during_prefill_cancels_both_legs(served_model: ServedModel, smollm2_dir: Path) -> None:
    async def scenario() -> None:
        async with http_cluster(served_model, smollm2_dir) as (c, _), httpx.AsyncClient() as http:
            c.prefills[0].delay_before_push_s = 30.0  # the prefill is still computing when the client leaves
            body = {"model": served_model.name, "messages": CHAT, "max_tokens": 8}
            with pytest.raises(httpx.ReadTimeout):
                await http.post(f"{c.gateway.http_url}/v1/chat/completions", json=body, timeout=0.5,
                                headers={"x-request-id": "impatient"})
            await eventually(lambda: c.prefills[0].record.cancelled == ["impatient"])
            await eventually(lambda: c.decodes[0].record.cancelled == ["impatient"])

    run_async(scenario())


def test_cli_client_streams_over_http(served_model: ServedModel, smollm2_dir: Path) -> None:
    """``tandem generate --url http://...``: the standard-library client, with --ignore-eos and --n 2."""
    import io

    from tandem_cli.client import build_request, stream_generate_http

    async def scenario() -> None:
        async with http_cluster(served_model, smollm2_dir) as (c, _):
            request = build_request("Hi", True, 5, 0.0, 1.0, None, 1, ignore_eos=True, n=2)
            out = io.StringIO()
            result = await asyncio.to_thread(stream_generate_http, c.gateway.http_url, request, 10.0, out)
            expected = served_model.tokenizer.decode(
                served_model.tokenizer.encode(" The quick brown fox jumps", add_special_tokens=False)[:5])
            assert result.samples == (expected, expected) and result.finish_reason == "length,length"
            assert result.num_tokens == result.usage.completion_tokens == 10
            assert out.getvalue().startswith(expected)
            sampling = c.decodes[0].last_request.sampling  # type: ignore[union-attr]
            assert sampling.ignore_eos and sampling.max_tokens == 5

    run_async(scenario())

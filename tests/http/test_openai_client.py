"""The official ``openai`` client against a real gateway's HTTP API, in front of scripted nodes on 127.0.0.1."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest
from http_cluster import TEXT, http_cluster
from scripted_nodes import eventually, run_async

from gateway.model import ServedModel

pytestmark = pytest.mark.real_model

CHAT = [{"role": "user", "content": "Hi"}]


def tokens(model: ServedModel) -> list[int]:
    return model.tokenizer.encode(TEXT, add_special_tokens=False)


def text(model: ServedModel, n: int) -> str:
    return model.tokenizer.decode(tokens(model)[:n])


def test_chat_completion_with_usage(served_model: ServedModel, smollm2_dir: Path) -> None:
    async def scenario() -> None:
        async with http_cluster(served_model, smollm2_dir) as (c, client):
            reply = await client.chat.completions.create(model=served_model.name, messages=CHAT, max_tokens=6)
            (choice,) = reply.choices
            assert choice.message.role == "assistant" and choice.message.content == text(served_model, 6)
            assert choice.finish_reason == "length" and choice.index == 0
            prompt = served_model.tokenizer.encode_chat(CHAT)
            assert reply.usage is not None
            assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (
                len(prompt), 6, len(prompt) + 6)
            assert reply.object == "chat.completion" and reply.model == served_model.name
            # The gateway sent the chat template's tokens and the sampling on to the decode node.
            assert c.decodes[0].last_request is not None
            assert list(c.decodes[0].last_request.prompt_token_ids) == prompt

    run_async(scenario())


def test_chat_stream_with_include_usage(served_model: ServedModel, smollm2_dir: Path) -> None:
    async def scenario() -> None:
        async with http_cluster(served_model, smollm2_dir) as (c, client):
            stream = await client.chat.completions.create(
                model=served_model.name, messages=CHAT, max_completion_tokens=7, stream=True,
                stream_options={"include_usage": True}, temperature=0.5, top_p=0.9, seed=3, presence_penalty=0.5,
                frequency_penalty=0.25, extra_body={"top_k": 5, "min_p": 0.1, "ignore_eos": True,
                                                    "repetition_penalty": 1.1, "min_tokens": 2})
            chunks = [chunk async for chunk in stream]
            content = [ch.choices[0].delta.content or "" for ch in chunks if ch.choices]
            assert chunks[0].choices[0].delta.role == "assistant"
            assert "".join(content) == text(served_model, 7)
            finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
            assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
            last = chunks[-1]
            assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 7
            assert all(ch.usage is None for ch in chunks[:-1])
            sampling = c.decodes[0].last_request.sampling  # type: ignore[union-attr]
            assert (sampling.max_tokens, sampling.seed, sampling.top_k, sampling.min_tokens) == (7, 3, 5, 2)
            assert sampling.ignore_eos and abs(sampling.temperature - 0.5) < 1e-6 and abs(sampling.min_p - 0.1) < 1e-6
            assert abs(sampling.repetition_penalty - 1.1) < 1e-6 and abs(sampling.presence_penalty - 0.5) < 1e-6

    run_async(scenario())


def test_completions_stream_and_not_with_logprobs(served_model: ServedModel, smollm2_dir: Path) -> None:
    async def scenario() -> None:
        async with http_cluster(served_model, smollm2_dir) as (_, client):
            reply = await client.completions.create(model=served_model.name, prompt="Hello", max_tokens=5,
                                                    logprobs=0)
            (choice,) = reply.choices
            assert choice.text == text(served_model, 5) and choice.finish_reason == "length"
            assert choice.logprobs is not None
            assert choice.logprobs.token_logprobs == [-0.5 * i for i in range(5)]  # the scripted logprobs
            assert "".join(choice.logprobs.tokens or []) == text(served_model, 5)
            assert reply.usage is not None and reply.usage.completion_tokens == 5
            assert reply.usage.prompt_tokens == len(served_model.tokenizer.encode("Hello"))

            stream = await client.completions.create(model=served_model.name, prompt="Hello", max_tokens=5,
                                                     stream=True)
            pieces = [ch async for ch in stream]
            assert "".join(p.choices[0].text for p in pieces) == text(served_model, 5)
            assert pieces[-1].choices[0].finish_reason == "length"

    run_async(scenario())


def test_chat_logprobs_and_stop_string(served_model: ServedModel, smollm2_dir: Path) -> None:
    async def scenario() -> None:
        async with http_cluster(served_model, smollm2_dir) as (_, client):
            reply = await client.chat.completions.create(model=served_model.name, messages=CHAT, max_tokens=4,
                                                         logprobs=True, top_logprobs=0)
            content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
            assert content is not None and [lp.logprob for lp in content] == [-0.5 * i for i in range(4)]
            assert "".join(lp.token for lp in content) == text(served_model, 4)

            reply = await client.chat.completions.create(model=served_model.name, messages=CHAT, max_tokens=9,
                                                         stop=[" fox", "zzz"])
            assert reply.choices[0].message.content == " The quick brown"
            assert reply.choices[0].finish_reason == "stop"

    run_async(scenario())


def test_n_samples_share_the_prompt(served_model: ServedModel, smollm2_dir: Path) -> None:
    async def scenario() -> None:
        async with http_cluster(served_model, smollm2_dir) as (c, client):
            reply = await client.chat.completions.create(model=served_model.name, messages=CHAT, max_tokens=5, n=2,
                                                         seed=7, extra_headers={"x-request-id": "multi"})
            assert [ch.index for ch in reply.choices] == [0, 1]
            assert {ch.message.content for ch in reply.choices} == {text(served_model, 5)}
            assert reply.usage is not None and reply.usage.completion_tokens == 10
            assert reply.usage.prompt_tokens == len(served_model.tokenizer.encode_chat(CHAT))
            # One request per sample; the second started after the first's prefill (its prompt was cached).
            assert c.prefills[0].record.requests == ["multi-0", "multi-1"]
            assert sorted(c.decodes[0].record.completed) == ["multi-0", "multi-1"]

            stream = await client.completions.create(model=served_model.name, prompt="Hi", max_tokens=3, n=2,
                                                     stream=True)
            by_index: dict[int, str] = {0: "", 1: ""}
            async for chunk in stream:
                for ch in chunk.choices:
                    by_index[ch.index] += ch.text
            assert by_index == {0: text(served_model, 3), 1: text(served_model, 3)}

    run_async(scenario())


def test_errors_name_the_field_and_carry_the_status(served_model: ServedModel, smollm2_dir: Path) -> None:
    async def scenario() -> None:
        async with http_cluster(served_model, smollm2_dir) as (_, client):
            name = served_model.name
            cases: list[tuple[dict[str, object], str]] = [
                ({"messages": CHAT, "temperature": -1}, "temperature"),
                ({"messages": CHAT, "top_p": 0}, "top_p"),
                ({"messages": CHAT, "max_tokens": 10**6}, "max_tokens"),
                ({"messages": CHAT, "max_completion_tokens": 10**6}, "max_completion_tokens"),
                ({"messages": CHAT, "n": 99}, "n"),
                ({"messages": CHAT, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
                ({"messages": [{"role": "", "content": "x"}]}, "messages[0].role"),
                ({"messages": []}, "messages"),
                ({"messages": CHAT, "stop": ["x" * 1000]}, "stop[0]"),
            ]
            for body, param in cases:
                with pytest.raises(openai.BadRequestError) as err:
                    await client.chat.completions.create(model=name, **body)  # type: ignore[call-overload]
                assert err.value.status_code == 400
                error = err.value.body
                assert isinstance(error, dict) and error["param"] == param, (body, error)
                assert error["message"].startswith(f"{param}: "), error
            with pytest.raises(openai.BadRequestError) as err:
                await client.completions.create(model=name, prompt="x", logprobs=99)
            assert isinstance(err.value.body, dict) and err.value.body["param"] == "logprobs"
            with pytest.raises(openai.NotFoundError) as missing:
                await client.chat.completions.create(model="no-such-model", messages=CHAT)  # type: ignore[arg-type]
            assert isinstance(missing.value.body, dict) and missing.value.body["code"] == "model_not_found"

    run_async(scenario())


def test_overload_is_429_and_no_node_is_503(served_model: ServedModel, smollm2_dir: Path) -> None:
    async def scenario() -> None:
        async with http_cluster(served_model, smollm2_dir, max_inflight=1, max_queued=0) as (c, client):
            c.script.gate = asyncio.Event()  # the first request holds the only slot
            first = asyncio.create_task(client.chat.completions.create(model=served_model.name, messages=CHAT,
                                                                       max_tokens=3))
            await eventually(lambda: bool(c.decodes[0].record.requests))
            with pytest.raises(openai.RateLimitError) as err:
                await client.chat.completions.create(model=served_model.name, messages=CHAT, max_tokens=3)
            assert "max_inflight=1" in str(err.value)
            c.script.gate.set()
            assert (await first).choices[0].finish_reason == "length"
        async with http_cluster(served_model, smollm2_dir, num_decode=0, dead_decode=1) as (_, client):
            with pytest.raises(openai.InternalServerError) as down:
                await client.chat.completions.create(model=served_model.name, messages=CHAT, max_tokens=3)
            assert down.value.status_code == 503

    run_async(scenario())


def test_models(served_model: ServedModel, smollm2_dir: Path) -> None:
    async def scenario() -> None:
        async with http_cluster(served_model, smollm2_dir) as (_, client):
            models = await client.models.list()
            assert [m.id for m in models.data] == [served_model.name]

    run_async(scenario())

"""A scripted cluster (tests/gateway/scripted_nodes.py) whose gateway also serves the OpenAI HTTP API."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import openai
from scripted_nodes import Cluster, free_port, scripted_cluster

from gateway.model import ServedModel

TEXT = " The quick brown fox jumps over the lazy dog."  # 10 tokens: the scripted nodes' generation


@contextlib.asynccontextmanager
async def http_cluster(model: ServedModel, model_dir: Path, script_tokens: Sequence[int] | None = None,
                       **settings: object) -> AsyncIterator[tuple[Cluster, openai.AsyncOpenAI]]:
    """The cluster and an official ``openai`` client on its HTTP port (loopback, no retries, short timeout)."""
    tokens = script_tokens if script_tokens is not None else model.tokenizer.encode(TEXT, add_special_tokens=False)
    async with scripted_cluster(model, model_dir, tokens, http_port=free_port(), **settings) as c:
        assert c.gateway.http_url.startswith("http://127.0.0.1:")
        client = openai.AsyncOpenAI(base_url=f"{c.gateway.http_url}/v1", api_key="unused", max_retries=0,
                                    timeout=10.0)
        try:
            yield c, client
        finally:
            await client.close()

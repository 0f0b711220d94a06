"""The engine thread beside asyncio servers: it serves a request, and it makes the process hand the GIL over
sooner than Python's default 5 ms (its ~400 kernel calls a step each take the GIL back)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from common.config.engine_config import CacheConfig, SchedulerConfig
from common.engine.async_engine import ENGINE_SWITCH_INTERVAL_S, AsyncEngine
from common.engine.commands import AddRequest
from common.engine.engine_core import ColocatedEngine
from common.model.loader import load_model
from common.sampling.params import SamplingParams


@pytest.fixture
def default_interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)  # Python's default
    yield
    sys.setswitchinterval(before)


def _engine(model_dir: Path) -> ColocatedEngine:
    model = load_model(model_dir, dtype="float32")
    return ColocatedEngine(model, CacheConfig(block_size=16, num_blocks=32), SchedulerConfig(max_num_seqs=4))


def test_the_engine_thread_lowers_the_switch_interval_and_serves(
        default_interval: None, tiny_model_factory: Callable[..., Path]) -> None:
    engine = AsyncEngine(_engine(tiny_model_factory("llama")), name="test-engine")
    try:
        assert sys.getswitchinterval() == pytest.approx(ENGINE_SWITCH_INTERVAL_S, rel=0.05)

        async def generate() -> list[int]:
            q = engine.open_stream("r")
            await engine.call(AddRequest("r", (5, 6, 7, 8), SamplingParams(temperature=0.0, max_tokens=4,
                                                                          ignore_eos=True)))
            tokens: list[int] = []
            async for out in engine.stream("r", q):
                tokens += out.new_token_ids
            return tokens

        assert len(asyncio.run(asyncio.wait_for(generate(), timeout=60))) == 4
    finally:
        engine.shutdown()


def test_a_lower_interval_the_process_set_is_kept(default_interval: None,
                                                  tiny_model_factory: Callable[..., Path]) -> None:
    sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S / 2)
    engine = AsyncEngine(_engine(tiny_model_factory("llama")), name="test-engine")
    try:
        assert sys.getswitchinterval() == pytest.approx(ENGINE_SWITCH_INTERVAL_S / 2, rel=0.05)  # whole microseconds
    finally:
        engine.shutdown()

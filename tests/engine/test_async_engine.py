"""The engine thread beside asyncio servers: it serves a request, it makes the process hand the GIL over
sooner than Python's default 5 ms (its ~400 kernel calls a step each take the GIL back), and it hands a step's
outputs over before the step's KV events (each hand-off wakes the event loop, which runs them in order)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from common.config.engine_config import CacheConfig, SchedulerConfig
from common.engine.async_engine import ENGINE_SWITCH_INTERVAL_S, AsyncEngine
from common.engine.commands import AddRequest, SetKVEventSink
from common.engine.engine_core import ColocatedEngine
from common.engine.request import RequestOutput
from common.kv.kv_events import KVEventBatch
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


class _Sink:
    """Records each published batch in ``order`` beside the outputs the engine hands over (engine thread)."""

    def __init__(self, order: list[str]) -> None:
        self.order = order
        self.last_sequence = 0

    def publish(self, batch: KVEventBatch) -> None:
        self.last_sequence += 1
        self.order.append("events")


def test_a_steps_outputs_are_handed_over_before_its_kv_events(tiny_model_factory: Callable[..., Path]) -> None:
    engine = AsyncEngine(_engine(tiny_model_factory("llama")), name="test-engine")
    order: list[str] = []
    push = engine._push

    def recording_push(request_id: str, item: RequestOutput | Exception) -> None:
        order.append(f"output {len(item.new_token_ids)}" if isinstance(item, RequestOutput) else "error")
        push(request_id, item)

    engine._push = recording_push  # type: ignore[method-assign]
    try:
        async def generate() -> None:
            await engine.call(SetKVEventSink(_Sink(order)))
            order.clear()
            q = engine.open_stream("r")
            # 40 tokens: two full blocks stored by the prompt's step, the first token from the same step
            await engine.call(AddRequest("r", tuple(range(5, 45)), SamplingParams(temperature=0.0, max_tokens=2,
                                                                                   ignore_eos=True)))
            async for _ in engine.stream("r", q):
                pass

        asyncio.run(asyncio.wait_for(generate(), timeout=60))
    finally:
        engine.shutdown()
    first_output = order.index("output 1")
    assert "events" in order[first_output:], order  # the prompt's stored blocks, published after its first token
    assert "events" not in order[:first_output], order

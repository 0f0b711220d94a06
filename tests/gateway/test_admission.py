"""The gateway's admission queue with exact expectations: who runs, who waits, who is refused."""

from __future__ import annotations

import asyncio

import pytest

from common.serving.errors import ResourceExhaustedError
from gateway.admission import AdmissionQueue


def run(coro: object) -> None:
    asyncio.run(asyncio.wait_for(coro, 10))  # type: ignore[arg-type]


def test_fifo_slots_and_a_bounded_queue() -> None:
    async def scenario() -> None:
        q = AdmissionQueue(max_inflight=2, max_queued=2, queue_timeout_s=10)
        order: list[str] = []
        release = {name: asyncio.Event() for name in "abcd"}

        async def request(name: str, n: int) -> None:
            async with q.slots(n):
                order.append(name)
                await release[name].wait()

        a = asyncio.create_task(request("a", 1))
        await asyncio.sleep(0)
        b = asyncio.create_task(request("b", 2))  # needs both slots: waits for a
        c = asyncio.create_task(request("c", 1))  # would fit, but never overtakes b
        await asyncio.sleep(0.01)
        assert order == ["a"] and (q.num_inflight, q.num_queued) == (1, 2)
        with pytest.raises(ResourceExhaustedError, match="max_queued=2"):
            async with q.slots(1):
                pass
        release["a"].set()
        await asyncio.sleep(0.01)
        assert order == ["a", "b"] and q.num_inflight == 2
        release["b"].set()
        await asyncio.sleep(0.01)
        assert order == ["a", "b", "c"]
        release["c"].set()
        await asyncio.gather(a, b, c)
        assert (q.num_inflight, q.num_queued) == (0, 0)

    run(scenario())


def test_a_cancelled_or_timed_out_waiter_leaves_the_queue() -> None:
    async def scenario() -> None:
        q = AdmissionQueue(max_inflight=1, max_queued=4, queue_timeout_s=0.05)
        hold = asyncio.Event()

        async def holder() -> None:
            async with q.slots(1):
                await hold.wait()

        h = asyncio.create_task(holder())
        await asyncio.sleep(0)
        with pytest.raises(ResourceExhaustedError, match=r"queue_timeout_s=0\.05"):
            async with q.slots(1):
                pass
        waiter = asyncio.create_task(q.slots(1).__aenter__())
        await asyncio.sleep(0.01)
        assert q.num_queued == 1
        waiter.cancel()
        await asyncio.sleep(0.01)
        assert q.num_queued == 0
        hold.set()
        await h
        assert q.num_inflight == 0
        async with q.slots(5) as waited:  # wider than the limit: runs alone
            assert waited == 0.0 and q.num_inflight == 1

    run(scenario())

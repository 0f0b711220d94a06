"""Core lending (common/engine/core_lending.py): a decode node's activity file, the prefill node's view of it, and the
borrower that runs a prefill's layers on the idle node's CPUs too, with the same logits as on its own."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from common.config.settings import ModelSettings, NodeSettings, parse_cpus
from common.engine.core_lending import (
    BUSY,
    HANDOVER_S,
    REOPEN_S,
    STATE_OFFSET,
    ActivityFile,
    ActivityView,
    CoreBorrower,
    check_lending_role,
)

TWO_CPUS = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_parse_cpus() -> None:
    assert parse_cpus("1,3-5") == (1, 3, 4, 5)
    assert parse_cpus(" 2 , 0 ") == (0, 2)
    for bad in ("a", "5-3", "1-", "-1"):
        with pytest.raises(ValueError, match=r"CPU number or range|ends before"):
            parse_cpus(bad)


def test_a_view_reads_what_the_node_writes(tmp_path: Path) -> None:
    path = tmp_path / "decode-0.activity"
    clock = Clock()
    missing = ActivityView(path, clock)
    assert not missing.idle()  # no node yet: not idle
    node = ActivityFile(path)
    view = ActivityView(path, clock)
    assert not view.idle()  # BUSY until the engine thread says otherwise
    node.set_busy(False)
    assert view.idle()
    node.set_busy(True)
    assert not view.idle()
    node.set_busy(False)
    assert not missing.idle()  # looks again only after REOPEN_S
    clock.now += REOPEN_S
    assert missing.idle()
    node.close()  # the node stops: its cores are not lent, the file is gone
    assert not view.idle() and not path.exists()
    again = ActivityFile(path)  # restarted: a new file at the path
    again.set_busy(False)
    assert not view.idle()
    clock.now += 2 * REOPEN_S
    assert view.idle()
    again.close()
    view.close()
    missing.close()


def test_a_foreign_or_short_file_is_not_idle(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_bytes(b"\0" * 8)
    foreign = tmp_path / "foreign"
    foreign.write_bytes(b"x" * 64)
    assert not ActivityView(short).idle()
    assert not ActivityView(foreign).idle()


def test_the_file_layout(tmp_path: Path) -> None:
    node = ActivityFile(tmp_path / "a")
    raw = (tmp_path / "a").read_bytes()
    assert raw[:8] == b"TNDMACT1" and int.from_bytes(raw[8:16], "little") == os.getpid()
    assert raw[STATE_OFFSET] == BUSY
    node.close()
    node.close()  # twice is fine


class FakeView(ActivityView):
    def __init__(self, idle: bool = True) -> None:
        self.state = idle

    def idle(self) -> bool:
        return self.state

    def close(self) -> None:
        pass


def _borrower(views: list[FakeView], pins: bool = True) -> tuple[CoreBorrower, list[tuple[str, Any]]]:
    calls: list[tuple[str, Any]] = []

    def pin(cpus: list[int]) -> bool:
        calls.append(("pin", cpus))
        return pins

    borrower = CoreBorrower([0], [1], views, set_threads=lambda n: calls.append(("threads", n)),
                            set_affinity=lambda cpus: calls.append(("cpus", cpus)), pin=pin)
    return borrower, calls


def test_the_borrower_lends_layer_by_layer() -> None:
    decode = FakeView(idle=True)
    borrower, calls = _borrower([decode])
    borrower.before_layer()  # the first borrowed layer binds the team (own CPU first), once
    assert calls == [("pin", [0, 1]), ("threads", 2)] and borrower.lending and borrower.pinned
    borrower.before_layer()
    assert len(calls) == 2  # no switch while it stays idle
    decode.state = False  # the decode node got work: the next layer gives its core back
    borrower.before_layer()
    borrower.before_layer()
    assert calls[2:] == [("threads", 1)] and not borrower.lending
    decode.state = True
    borrower.before_layer()
    assert borrower.lending and calls[3:] == [("threads", 2)]
    borrower.after_layers()  # every forward ends on the own CPUs
    assert not borrower.lending and calls[-1] == ("threads", 1)
    assert (borrower.borrowed_layers, borrower.own_layers) == (3, 2)


def test_an_unbound_team_switches_the_engine_threads_affinity() -> None:
    borrower, calls = _borrower([FakeView(idle=True)], pins=False)  # no libgomp: the team cannot be bound
    borrower.before_layer()
    borrower.after_layers()
    borrower.before_layer()
    assert calls == [("pin", [0, 1]), ("cpus", {0, 1}), ("threads", 2), ("threads", 1), ("cpus", {0}),
                     ("cpus", {0, 1}), ("threads", 2)]
    assert borrower.pinned is False


def test_a_completed_prompt_holds_the_lending_while_its_kv_lands() -> None:
    clock = Clock()
    calls: list[tuple[str, Any]] = []
    borrower = CoreBorrower([0], [1], [FakeView(True)], set_threads=lambda n: calls.append(("threads", n)),
                            set_affinity=lambda cpus: calls.append(("cpus", cpus)), pin=lambda cpus: True,
                            clock=clock)
    borrower.before_layer()
    borrower.handing_over()  # the forward sampled a prompt's first token: the decode node is about to get work
    borrower.after_layers()
    borrower.before_layer()  # the next queued prompt's first layer, before the decode node says busy
    assert not borrower.lending
    clock.now += HANDOVER_S
    borrower.before_layer()
    assert borrower.lending


def test_every_lender_must_be_idle() -> None:
    a, b = FakeView(True), FakeView(False)
    borrower, _ = _borrower([a, b])
    borrower.before_layer()
    assert not borrower.lending
    b.state = True
    borrower.before_layer()
    assert borrower.lending


def test_warm_up_borrows_whatever_the_views_say() -> None:
    borrower, calls = _borrower([FakeView(False)])
    with borrower.borrowing():
        assert borrower.lending
    assert not borrower.lending and calls == [("pin", [0, 1]), ("threads", 2), ("threads", 1)]


def test_the_borrower_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match="apart"):
        CoreBorrower([0, 1], [1], [FakeView()])
    with pytest.raises(ValueError, match="--borrow-from"):
        CoreBorrower([0], [1], [])


def _in_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a thread of its own (affinity and OpenMP threads are per thread) and return its result."""
    result: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(300)
    if errors:
        raise errors[0]
    return result[0]


@TWO_CPUS
def test_adopt_keeps_the_own_cpus_for_the_starting_thread() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    borrowed = [cpus[-1]]

    def adopt() -> tuple[set[int], set[int]]:
        borrower = CoreBorrower.adopt(borrowed, [FakeView()])
        return borrower.own, os.sched_getaffinity(0)

    own, now = _in_thread(adopt)
    assert own == set(cpus[:-1]) == now

    def refuse() -> None:
        os.sched_setaffinity(0, {cpus[0]})
        CoreBorrower.adopt([cpus[0]], [FakeView()])

    with pytest.raises(ValueError, match="needs CPUs of its own"):
        _in_thread(refuse)


@TWO_CPUS
def test_logits_are_the_same_with_layers_on_borrowed_cpus(smollm2_dir: Path) -> None:
    """A prefill whose layers switch between one and two OpenMP threads (the decode node idle, then busy, then idle)
    computes the same bf16 logits, bit for bit, as on its own core."""
    import torch

    from common.attention.metadata import AttentionMetadata
    from common.model.loader import load_model

    cpus = sorted(os.sched_getaffinity(0))
    model = load_model(smollm2_dir, dtype="bfloat16")
    ids = torch.randint(1000, 40000, (160,), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(len(ids))

    class Flipping(FakeView):
        def idle(self) -> bool:
            self.calls = getattr(self, "calls", 0) + 1
            return self.calls % 3 != 0  # two layers lent, one not

    def logits(borrower: CoreBorrower | None) -> torch.Tensor:
        os.sched_setaffinity(0, {cpus[0]})
        torch.set_num_threads(1)
        model.layer_threads = borrower
        try:
            with torch.inference_mode():
                meta = AttentionMetadata.build([len(ids)], [0])
                return model.compute_logits(model(ids, positions, meta))
        finally:
            model.layer_threads = None

    def both() -> tuple[torch.Tensor, torch.Tensor, CoreBorrower]:
        borrower = CoreBorrower([cpus[0]], [cpus[1]], [Flipping()])
        return logits(None), logits(borrower), borrower

    own, lent, borrower = _in_thread(both)
    assert borrower.borrowed_layers > 0 and borrower.own_layers > 0 and not borrower.lending
    assert torch.equal(own, lent)
    assert borrower.pinned  # PyTorch's OpenMP here is libgomp: the team was bound (test_openmp checks where)


def test_settings_and_roles_refuse_what_lending_cannot_honour() -> None:
    with pytest.raises(ValueError, match="go together"):
        NodeSettings(borrow_cpus="1")
    with pytest.raises(ValueError, match=r"--borrow-cpus .*CPU number"):
        NodeSettings(borrow_cpus="x", borrow_from="/dev/shm/a")
    lender = NodeSettings(borrow_cpus="1", borrow_from="/dev/shm/a")
    check_lending_role("prefill", lender, ModelSettings())
    with pytest.raises(ValueError, match="this is a decode node"):
        check_lending_role("decode", lender, ModelSettings())
    with pytest.raises(ValueError, match="--device cpu"):
        check_lending_role("prefill", lender, ModelSettings(device="cuda"))
    with pytest.raises(ValueError, match="own process"):
        check_lending_role("prefill", lender, ModelSettings(tensor_parallel_size=2))
    keeper = NodeSettings(activity_file="/dev/shm/a")
    check_lending_role("decode", keeper, ModelSettings())
    with pytest.raises(ValueError, match="this is a colocated node"):
        check_lending_role("colocated", keeper, ModelSettings())



def test_a_decode_engine_thread_says_when_it_has_steps_to_run(tmp_path: Path,
                                                              tiny_model_factory: Callable[..., Path]) -> None:
    import asyncio
    import time

    from common.config.engine_config import CacheConfig, SchedulerConfig
    from common.engine.async_engine import AsyncEngine
    from common.engine.commands import AddRequest
    from common.engine.engine_core import ColocatedEngine
    from common.model.loader import load_model
    from common.sampling.params import SamplingParams

    path = tmp_path / "decode.activity"
    core = ColocatedEngine(load_model(tiny_model_factory("llama"), dtype="float32"),
                           CacheConfig(block_size=16, num_blocks=32), SchedulerConfig(max_num_seqs=4))
    engine = AsyncEngine(core, name="test-engine", activity=ActivityFile(path))
    view = ActivityView(path)

    def wait_idle() -> bool:
        deadline = time.monotonic() + 10
        while not view.idle() and time.monotonic() < deadline:
            time.sleep(0.01)
        return view.idle()

    try:
        assert wait_idle()  # nothing to step

        async def generate() -> list[bool]:
            q = engine.open_stream("r")
            await engine.call(AddRequest("r", (5, 6, 7, 8), SamplingParams(temperature=0.0, max_tokens=48,
                                                                          ignore_eos=True)))
            seen = []
            async for out in engine.stream("r", q):
                if not out.finished:
                    seen.append(view.idle())
            return seen

        seen = asyncio.run(asyncio.wait_for(generate(), timeout=60))
        assert seen and not any(seen)  # busy while the request had tokens to come
        assert wait_idle()
    finally:
        engine.shutdown()
    assert not path.exists()  # the node stopped: its file is gone
    view.close()


def test_the_model_runner_calls_the_layer_threads(tiny_model_factory: Callable[..., Path]) -> None:
    """Around every decoder layer of a forward, and once a forward completes a prompt."""
    from common.config.engine_config import CacheConfig, SchedulerConfig
    from common.engine.engine_core import ColocatedEngine
    from common.model.loader import load_model
    from common.sampling.params import SamplingParams

    class Recorder:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def before_layer(self) -> None:
            self.calls.append("layer")

        def after_layers(self) -> None:
            self.calls.append("done")

        def handing_over(self) -> None:
            self.calls.append("handover")

    model = load_model(tiny_model_factory("llama"), dtype="float32")
    model.decode_step = None  # op by op: a short chunk after a cached prefix may otherwise run as one C++ call
    recorder = Recorder()
    model.layer_threads = recorder
    engine = ColocatedEngine(model, CacheConfig(block_size=16, num_blocks=32),
                             SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_prefill_chunk=16))
    engine.add_request("r", list(range(3, 27)), SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    engine.step()  # the prompt's first 16 tokens: no token sampled yet
    assert recorder.calls == ["layer", "layer", "done"]
    engine.step()  # the rest: its first token
    assert recorder.calls[3:] == ["layer", "layer", "done", "handover"]

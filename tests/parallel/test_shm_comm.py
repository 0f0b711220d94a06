"""ShmComm (common/parallel/shm_comm.py) between real processes: bit-exact sums, chunking, gathers, failures.

One group of spawned ranks per world size (2, and 3 oversubscribed onto this machine's 2 cores) runs every
check in a row; each rank writes its verdicts as JSON into a temporary directory (nothing is pickled but the
spawn arguments, which are strings and ints). Inputs are a pure function of (check, call, rank), so every
rank computes every rank's input and the reference: summed in fp32 in rank order, cast once.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from common.parallel.shm_comm import ShmComm
from common.parallel.spawn import run_ranks
from common.serving.port_reservation import reserve_port

MAX_BYTES = 16 << 10  # [8, 576] fp32 and [64, 576] in any dtype need several chunks
SHAPES = [(1, 576), (8, 576), (3, 7, 5), (64, 576)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GROUP_TIMEOUT_S = 90.0


def _input(check: int, call: int, rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    # Ranks of very different magnitudes: summing in bf16 rather than fp32 would round differently.
    generator = torch.Generator().manual_seed(check * 1_000_003 + call * 101 + rank)
    return (torch.randn(shape, generator=generator) * 10.0 ** (2 * rank - 2)).to(dtype)


def _reference(inputs: list[torch.Tensor]) -> torch.Tensor:
    total = inputs[0].float()
    for x in inputs[1:]:
        total = total + x.float()
    return total.to(inputs[0].dtype)


def _check_reduce(comm: ShmComm, check: int, call: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    inputs = [_input(check, call, r, shape, dtype) for r in range(comm.world_size)]
    mine = inputs[comm.rank].clone()
    assert comm.all_reduce_(mine) is mine
    expected = _reference(inputs)
    assert torch.equal(mine, expected), f"call {call} {shape} {dtype}: max diff {(mine - expected).abs().max()}"


def check_shapes_and_dtypes(comm: ShmComm) -> None:
    for call, (shape, dtype) in enumerate((s, d) for s in SHAPES for d in DTYPES):
        _check_reduce(comm, 1, call, shape, dtype)
    # Non-contiguous: reduced in place through a copy.
    inputs = [_input(1, 99, r, (576, 8), torch.bfloat16) for r in range(comm.world_size)]
    mine = inputs[comm.rank].clone().t()
    comm.all_reduce_(mine)
    assert torch.equal(mine, _reference([x.t() for x in inputs]))


def check_200_calls_in_a_row(comm: ShmComm) -> None:
    for call in range(200):
        shape, dtype = [((1, 576), torch.bfloat16), ((4, 576), torch.float32), ((2, 100), torch.float16)][call % 3]
        _check_reduce(comm, 2, call, shape, dtype)


def check_chunked(comm: ShmComm) -> None:
    for call, dtype in enumerate(DTYPES):
        shape = (64, 577)  # 9+ slots, the last one partial
        assert _input(3, call, 0, shape, dtype).nbytes > 4 * comm.slot_bytes
        _check_reduce(comm, 3, call, shape, dtype)


def check_all_gather(comm: ShmComm) -> None:
    cases = [((2, 3, 4), torch.float32, 0), ((2, 3, 4), torch.bfloat16, 1), ((2, 3, 4), torch.float16, -1),
             ((5, 7), torch.int64, -1), ((40, 300), torch.float32, 1)]  # the last one is chunked
    for call, (shape, dtype, dim) in enumerate(cases):
        inputs = [_input(4, call, r, shape, torch.float32).to(dtype) for r in range(comm.world_size)]
        assert torch.equal(comm.all_gather(inputs[comm.rank], dim), torch.cat(inputs, dim)), (shape, dtype, dim)


def check_same_as_gloo(comm: ShmComm, gloo_port: int) -> None:
    import torch.distributed as dist

    from common.parallel.comm import GlooComm

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=comm.rank,
                            world_size=comm.world_size, timeout=datetime.timedelta(seconds=30))
    try:
        gloo = GlooComm(None, list(range(comm.world_size)))
        mine = _input(5, 0, comm.rank, (8, 576), torch.float32)
        by_gloo, by_shm = gloo.all_reduce_(mine.clone()), comm.all_reduce_(mine.clone())
        assert torch.equal(by_gloo, by_shm)  # two ranks: one fp32 add, whichever order gloo takes
        assert torch.equal(gloo.all_gather(mine, 0), comm.all_gather(mine, 0))
    finally:
        dist.destroy_process_group()


CHECKS: dict[str, Callable[[ShmComm], None]] = {
    "shapes_and_dtypes": check_shapes_and_dtypes,
    "200_calls_in_a_row": check_200_calls_in_a_row,
    "chunked": check_chunked,
    "all_gather": check_all_gather,
}


def check_a_dead_rank_fails_its_peers_fast(comm: ShmComm) -> None:
    # The last rank exits without close() after its other checks (see _rank_main): its lock dies with it.
    last = comm.world_size - 1
    start = time.monotonic()
    try:
        comm.all_reduce_(torch.ones(4, dtype=torch.bfloat16))
    except RuntimeError as exc:
        assert re.search(rf"rank {last} \(pid \d+\) died or closed before call \d+", str(exc)), exc
    else:
        raise AssertionError("all_reduce_ with a dead rank returned")
    assert time.monotonic() - start < 5  # noticed by the liveness probe, long before the 30 s timeout


def _rank_main(name: str, rank: int, world_size: int, gloo_port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    verdicts: dict[str, str] = {}
    comm = ShmComm.attach(name, rank, world_size, timeout_s=30.0)
    checks = dict(CHECKS)
    if gloo_port:
        checks["same_as_gloo"] = lambda c: check_same_as_gloo(c, gloo_port)
    for name, check in checks.items():
        try:
            check(comm)
            verdicts[name] = "ok"
        except Exception:
            verdicts[name] = traceback.format_exc()
            break  # the group is out of step now: later checks would only time out
    else:
        if rank == comm.world_size - 1:
            Path(out_dir, f"rank{rank}.json").write_text(json.dumps(verdicts))
            os._exit(0)  # dies holding its rank, no close()
        try:
            check_a_dead_rank_fails_its_peers_fast(comm)
            verdicts["dead_rank"] = "ok"
        except Exception:
            verdicts["dead_rank"] = traceback.format_exc()
    comm.close()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(verdicts))


@pytest.fixture(scope="module", params=[2, 3], ids=["T2", "T3"])
def group(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, str]]:
    """Run every check in a group of ``request.param`` spawned ranks; rank -> check -> "ok" or a traceback."""
    world_size: int = request.param
    out_dir = tmp_path_factory.mktemp(f"shm-T{world_size}")
    with ShmComm.create(world_size, max_bytes=MAX_BYTES) as segment:
        gloo_port = reserve_port() if world_size == 2 else 0
        codes = run_ranks(_rank_main, [(segment.name, rank, world_size, gloo_port, str(out_dir))
                                       for rank in range(world_size)], GROUP_TIMEOUT_S)
    assert not Path("/dev/shm", segment.segment.name).exists()  # the creator unlinked it
    results = {}
    for rank, code in enumerate(codes):
        path = out_dir / f"rank{rank}.json"
        results[rank] = json.loads(path.read_text()) if path.exists() else {"exit": f"exit code {code}"}
    return results


def _assert_ok(group: dict[int, dict[str, str]], check: str) -> None:
    for rank, verdicts in group.items():
        assert verdicts.get(check) == "ok", f"rank {rank}: {verdicts.get(check) or verdicts}"


@pytest.mark.parametrize("check", list(CHECKS))
def test_every_rank_gets_the_reference_bit_for_bit(group: dict[int, dict[str, str]], check: str) -> None:
    _assert_ok(group, check)


def test_a_dead_rank_fails_its_peers_fast(group: dict[int, dict[str, str]]) -> None:
    _assert_ok({rank: verdicts for rank, verdicts in group.items() if rank < len(group) - 1}, "dead_rank")


@pytest.mark.parametrize("group", [2], ids=["T2"], indirect=True)  # fp32 sums of two are order-independent
def test_same_result_as_gloo(group: dict[int, dict[str, str]]) -> None:
    _assert_ok(group, "same_as_gloo")


# ------------------------------------------------------------------------- failures, ranks as threads of one process


def _reduce_in_thread(comm: ShmComm, errors: list[str]) -> threading.Thread:
    def run() -> None:
        try:
            comm.all_reduce_(torch.ones(4))
        except RuntimeError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_rank_that_never_arrives_times_out_naming_it() -> None:
    with ShmComm.create(3, max_bytes=4096) as segment:
        comms = [ShmComm.attach(segment.name, rank, 3, timeout_s=0.5) for rank in range(3)]  # rank 2 never calls
        errors: list[str] = []
        start = time.monotonic()
        threads = [_reduce_in_thread(comms[rank], errors) for rank in (0, 1)]
        for thread in threads:
            thread.join(10)
        assert 0.5 <= time.monotonic() - start < 5
        assert len(errors) == 2 and all("ranks [2] did not reach call 1 within 0.5 s" in e for e in errors), errors
        with pytest.raises(RuntimeError, match="unusable after an earlier failure"):
            comms[0].all_reduce_(torch.ones(4))
        for comm in comms:
            comm.close()


def test_a_rank_that_never_attached_is_named_as_such() -> None:
    with ShmComm.create(2, max_bytes=4096) as segment:
        comm = ShmComm.attach(segment.name, 0, 2, timeout_s=0.3)
        with pytest.raises(RuntimeError, match=r"ranks \[1\] did not reach call 1 .*never attached: ranks \[1\]"):
            comm.all_gather(torch.ones(4))
        comm.close()


def test_a_rank_is_attached_once() -> None:
    with ShmComm.create(2, max_bytes=4096) as segment:
        first = ShmComm.attach(segment.name, 1, 2)
        with pytest.raises(RuntimeError, match="already attached by a live process"):
            ShmComm.attach(segment.name, 1, 2)
        first.close()
        with pytest.raises(RuntimeError, match="was attached before"):
            ShmComm.attach(segment.name, 1, 2)
        with pytest.raises(ValueError, match="rank must be in"):
            ShmComm.attach(segment.name, 2, 2)
        with pytest.raises(ValueError, match="was not made for 3 ranks"):
            ShmComm.attach(segment.name, 0, 3)
        with pytest.raises(ValueError, match="is not '<file>:<nonce hex>'"):
            ShmComm.attach(segment.segment.name, 0, 2)

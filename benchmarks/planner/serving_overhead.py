"""What a served token costs its node beyond the engine step the cost model times, for the planner.

The cost model's steps are timed in one process with no server (benchmarks/planner/step_timing.py). A
serving node also streams every sampled token to its client from the same core: the engine's output
hand-off, a protobuf message and a gRPC write per token. On the 2-core development machine that made
served steps 8-18% slower than the model, and the planner's TPOT and TTFT predictions low by as much
(benchmarks/results/2026-12-02-srpt/RESULTS.md, session 13). Measured once with the cost model: one
``tandem serve colocated`` on the node's cores, ``STREAMS`` requests of ``PROMPT`` tokens decoding
``OUTPUT`` tokens together; the median
TPOT minus the modelled decode step of that batch, per stream, is the cost per streamed token
(``CostModel.per_streamed_token_s``), added to every simulated step for each sequence it samples.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks.planner.cost_model import CostModel, StepShape

STREAMS = 16
PROMPT = 64
OUTPUT = 48


def measure_per_streamed_token_s(model_dir: Path, dtype: str, cpus: Sequence[int], cost: CostModel,
                                 vocab_size: int) -> float:
    """Seconds of a node's step per token it streams, beyond the modelled step (>= 0)."""
    from benchmarks.serve_client import drive
    from benchmarks.workloads import TimedRequest
    from tandem_cli.launcher import ColocatedTopology, Launcher

    rng = random.Random(0)

    def request(i: int) -> TimedRequest:
        return TimedRequest(i, tuple(rng.randrange(3, vocab_size) for _ in range(PROMPT)), OUTPUT, 0.0, "probe")

    topology = ColocatedTopology(replicas=1, free_ports=True, cpus=tuple(cpus),
                                 model_args=("--model", str(model_dir), "--dtype", dtype))
    with tempfile.TemporaryDirectory(prefix="tandem-plan-probe-") as logs, \
            Launcher(topology, log_dir=Path(logs)) as launcher:
        target = next(s.target for s in launcher.specs if s.role == "colocated")
        asyncio.run(drive([target], [request(0)], concurrency=1, timeout_s=120.0))  # warm-up
        records, _ = asyncio.run(drive([target], [request(1 + i) for i in range(STREAMS)], concurrency=STREAMS,
                                       timeout_s=300.0))
    tpots = [t for r in records if (t := r.tpot_s) is not None]
    if len(tpots) < STREAMS // 2:
        raise RuntimeError(f"the serving probe's streams did not complete: {[r.error for r in records][:3]}")
    modelled = cost.step_s(StepShape.of([(PROMPT + OUTPUT // 2, 1, True)] * STREAMS))
    return max(0.0, (statistics.median(tpots) - modelled) / STREAMS)

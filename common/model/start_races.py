"""How Tandem's start-up races between two kernels are timed and read: ``race`` times both on one probe weight at
several row counts, the ``retime_*`` rules time again the probes a neighbour's burst may have spoiled, and
``crossover_rows`` / ``onednn_from_rows`` turn the timings into a row limit. The races themselves (which kernels,
which probes, what the verdict sets) live beside the methods they choose for (common/model/gemv.py); a verdict
holds for the process's life, so a spoiled probe costs every step after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from common.kernels.cpu import NO_AMX

PROBE_SHAPE = (2048, 1024)  # [N, K]: larger than L2, as the models' projections are


Layout = Callable[[torch.Tensor], torch.Tensor]
Kernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def race(dtype: torch.dtype, probes: tuple[int, ...], layout: Layout, kernel: Kernel,
         versus: tuple[Layout, Kernel] | None = None, timings: int = 5) -> dict[int, tuple[float, float]]:
    """Per row count in ``probes``: the best of ``timings`` timings of (``kernel`` on the weight in ``layout``,
    the ``versus`` kernel on the weight in its layout: ``F.linear`` on the row-major weight unless given),
    alternating so that a neighbour's load falls on both."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(*PROBE_SHAPE, generator=gen).to(dtype)
    laid = layout(w)
    other_layout, other = versus or ((lambda t: t), F.linear)
    other_laid = other_layout(w)
    out: dict[int, tuple[float, float]] = {}
    for rows in probes:
        x = torch.randn(rows, PROBE_SHAPE[1], generator=gen).to(dtype)
        best = [float("inf"), float("inf")]
        for _ in range(timings):
            for i, fn in enumerate((lambda x=x: kernel(x, laid), lambda x=x: other(x, other_laid))):
                start = time.perf_counter()
                fn()
                best[i] = min(best[i], time.perf_counter() - start)
        out[rows] = (best[0], best[1])
    return out


def crossover_rows(timings: dict[int, tuple[float, float]]) -> int:
    """The largest probed row count up to which Tandem's kernel was never slower than torch's GEMM (its
    timings: rows -> (kernel s, GEMM s)); the smallest probe if it lost there too (a decode row still streams
    the weights, which is what the kernels are for)."""
    rows = min(timings)
    for m in sorted(timings):
        kernel, gemm = timings[m]
        if kernel > gemm:
            break
        rows = m
    return rows


def onednn_from_rows(timings: dict[int, tuple[float, float]]) -> int:
    """The smallest probed row count from which the other GEMM was no slower than Tandem's kernel at every larger
    probe too (timings: rows -> (kernel s, other s)); ``NO_AMX`` where it lost at the largest."""
    rows = NO_AMX
    for m in sorted(timings, reverse=True):
        kernel, other = timings[m]
        if other > kernel:
            break
        rows = m
    return rows


def retime_losses_beside_wins(timings: dict[int, tuple[float, float]],
                              race: Callable[[tuple[int, ...]], dict[int, tuple[float, float]]],
                              tries: int = 3) -> dict[int, tuple[float, float]]:
    """``timings`` (rows -> (kernel s, other s)) with each probe where the other GEMM lost although it won at
    another probe timed again, up to ``tries`` more times (the best of all kept): a neighbour's burst during one
    probe's five timings otherwise sets the crossover for the process's life. Session 31 (2-core Xeon): one
    start-up read oneDNN 9.66 ms against the panels' 6.70 at 1,024 rows, between oneDNN's wins at 256 (0.93 vs
    1.08) and 2,048 (9.56 vs 13.55; another start-up: 3.36 vs 4.68 at 1,024), and kept the panels up to 2,047
    rows: a full queue's ~1,920-row prefill steps, where the panels take ~1.4x oneDNN's time. Session 33: two of
    seven servers started by the serving benchmark read oneDNN slower at the largest probe only (2,048 rows 6.95
    vs 4.87 ms, 5.90 vs 4.95; 1,024 rows 1.93 vs 2.33), a loss the rule above never doubted, and prefilled in
    the panels at every size: 2,048-token steps of a full queue of 1,024-token prompts 0.8-1.1 s against
    0.40-0.57 s in a server on oneDNN. Run alone, 40 races of this one (28 in a bare process, four of them
    beside a process spinning on one of the two cores, 12 in freshly started servers) read oneDNN faster at
    2,048 rows every time."""
    return retime(timings, race, lambda t: tuple(m for m in sorted(t) if t[m][1] > t[m][0]
                                                 and any(t[n][1] <= t[n][0] for n in t if n != m)), tries)


def retime_out_of_order(timings: dict[int, tuple[float, float]],
                        race: Callable[[tuple[int, ...]], dict[int, tuple[float, float]]],
                        tries: int = 2) -> dict[int, tuple[float, float]]:
    """``timings`` (rows -> (kernel s, GEMM s)) of a kernel that should win below a crossover and lose above it
    (``crossover_rows``), with each probe that breaks that order timed again, up to ``tries`` more times (the
    best of all kept): a loss below a larger win, or a win above a smaller loss. One burst elsewhere during a
    probe's five timings would otherwise set the crossover for the process's life, as it did to the bf16 GEMM's
    (``retime_losses_beside_wins``)."""
    return retime(timings, race, lambda t: tuple(
        m for m in sorted(t)
        if (t[m][0] > t[m][1] and any(t[n][0] <= t[n][1] for n in t if n > m))
        or (t[m][0] <= t[m][1] and any(t[n][0] > t[n][1] for n in t if n < m))), tries)


def retime(timings: dict[int, tuple[float, float]], race: Callable[[tuple[int, ...]], dict[int, tuple[float, float]]],
           doubtful: Callable[[dict[int, tuple[float, float]]], tuple[int, ...]],
           tries: int = 2) -> dict[int, tuple[float, float]]:
    """``timings`` with the probes ``doubtful`` names timed again by ``race``, up to ``tries`` times, keeping the
    best of every timing of each side (a start-up race's verdict holds for the process's life)."""
    best = dict(timings)
    for _ in range(tries):
        probes = doubtful(best)
        if not probes:
            break
        for m, (first, second) in race(probes).items():
            best[m] = (min(best[m][0], first), min(best[m][1], second))
    return best

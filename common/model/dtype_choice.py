"""``--dtype auto`` on CPU, decided by measurement on the machine it runs on, cached in TANDEM_HOME.

CPU flags alone mislead: on an AVX2 machine bf16 decodes faster than fp32 at batch 1 (half the bytes
to stream) while its large GEMMs run far below fp32's rate (no native bf16), so prefill would crawl
(measured: docs/cpu-kernels.md, benchmarks/results/figures-from-code.md).
So at start-up each candidate dtype is timed on two shapes of the model's own sizes, a decode-shaped
GEMV (one row through the gate/up projection, its weights larger than the cache so they stream from
memory as in a real step) and a prefill-shaped GEMM (64 rows), in rounds that alternate the dtypes (so
a neighbour's load falls on all of them; each keeps its best), in about a second all told. The faster
decode wins unless its prefill GEMM is more than ``MAX_PREFILL_SLOWDOWN`` x fp32's: a server at
saturation spends most of its time in prefill (a 384 -> 128 request has three prompt tokens for each
output token), so a dtype that decodes a little faster but prefills much slower serves less. The answer
is cached per (CPU name, CPU flags, torch version, threads, shapes, ``CHOICE_VERSION``), so the next
start-up reads one small JSON file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Set
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# Never pick a dtype whose prefill GEMM is slower than this x fp32's. On a 2-core AVX2 EPYC (Zen 3, no native
# bf16, session 16) bf16 GEMMs at prefill shapes, and an int4 model's prefill with bf16 activations, ran far
# slower than in fp32, while its decode was only somewhat faster; the old bound of 5x let a noisy probe choose
# bf16 there (the figures: docs/cpu-kernels.md, "--dtype auto on CPU is measured").
MAX_PREFILL_SLOWDOWN = 1.25
MEASURE_ROUNDS = 3  # the dtypes alternate; each keeps its best probe of all rounds
CHOICE_VERSION = "2"  # part of the cache key: choices cached under an older rule are measured again
CACHE_FILE = "dtype_choice.json"
STREAM_BYTES = 48 << 20  # fp32 bytes of the GEMV's weight copies: beyond the cache, as a real step
PREFILL_ROWS = 64
PREFILL_MAX_COLS = 512  # the prefill GEMM uses this many output features: enough for a GEMM's rate
MEASURE_BUDGET_S = 0.04  # per dtype and shape
DEFAULT_SHAPE = (576, 1536)  # (hidden, intermediate): SmolLM2-135M, for callers without a config


@dataclass(frozen=True)
class DtypeTiming:
    """Seconds per call of the two probes for one dtype (smaller is faster)."""

    dtype: str  # float32 | bfloat16 | float16
    decode_s: float  # [1, hidden] x [hidden, 2 * intermediate]
    prefill_s: float  # [64, hidden] x [hidden, min(2 * intermediate, 512)]


def choose_dtype(timings: list[DtypeTiming], max_prefill_slowdown: float = MAX_PREFILL_SLOWDOWN) -> str:
    """The dtype with the fastest decode probe among those whose prefill probe is at most
    ``max_prefill_slowdown`` x fp32's; fp32 (the reference, always eligible) wins ties."""
    by_name = {t.dtype: t for t in timings}
    if "float32" not in by_name:
        raise ValueError("the float32 timing is the reference and must be measured")
    limit = max_prefill_slowdown * by_name["float32"].prefill_s
    eligible = [t for t in timings if t.dtype == "float32" or t.prefill_s <= limit]
    # sorted() is stable and fp32 goes first, so it keeps a tie.
    ordered = sorted(eligible, key=lambda t: t.dtype != "float32")
    return min(ordered, key=lambda t: t.decode_s).dtype


def candidate_dtypes(flags: Set[str]) -> list[str]:
    """fp32 and bf16 always; fp16 only with native fp16 arithmetic (AVX512-FP16 / AMX-FP16)."""
    names = ["float32", "bfloat16"]
    if flags & {"avx512_fp16", "amx_fp16"}:
        names.append("float16")
    return names


def cache_key(cpu: str, flags: Set[str], torch_version: str, threads: int, shape: tuple[int, int]) -> str:
    text = "|".join([cpu, " ".join(sorted(flags)), torch_version, str(threads), f"{shape[0]}x{shape[1]}",
                     CHOICE_VERSION])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def read_cached(home: Path, key: str) -> str | None:
    try:
        entries = json.loads((home / CACHE_FILE).read_text())
        dtype = entries[key]["dtype"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return dtype if isinstance(dtype, str) else None


def write_cached(home: Path, key: str, dtype: str, timings: list[DtypeTiming], description: str) -> None:
    path = home / CACHE_FILE
    try:
        entries = json.loads(path.read_text()) if path.is_file() else {}
        if not isinstance(entries, dict):
            entries = {}
    except (OSError, ValueError):
        entries = {}
    entries[key] = {"dtype": dtype, "machine": description, "timings": [asdict(t) for t in timings]}
    try:
        home.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{time.monotonic_ns()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1) + "\n")
        tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError as exc:
        log.warning("could not cache the dtype choice in %s: %s", path, exc)


def _best(fn: object, budget_s: float) -> float:
    assert callable(fn)
    fn()  # warm-up (also allocates oneDNN's primitive)
    best = float("inf")
    deadline = time.perf_counter() + budget_s
    for _ in range(50):
        start = time.perf_counter()
        fn()
        end = time.perf_counter()
        best = min(best, end - start)
        if end > deadline:
            break
    return best


def measure(dtype_name: str, shape: tuple[int, int]) -> DtypeTiming:
    """Time the two probes of ``dtype_name`` at ``shape = (hidden, intermediate)`` on torch's threads."""
    import torch
    import torch.nn.functional as F

    dtype: torch.dtype = getattr(torch, dtype_name)
    hidden, inter = shape
    out_features = 2 * inter
    # Weights of nn.Linear's layout [out, in]; enough copies that one sweep exceeds the cache.
    copies = max(1, min(16, STREAM_BYTES // (4 * out_features * hidden)))
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(out_features, hidden, generator=gen).to(dtype) for _ in range(copies)]
    row = torch.randn(1, hidden, generator=gen).to(dtype)
    rows = torch.randn(PREFILL_ROWS, hidden, generator=gen).to(dtype)
    cols = weights[0][: min(out_features, PREFILL_MAX_COLS)]

    from common.model.linear import Linear
    from common.quant.registry import float_method

    # the decode probe runs the matmul decode steps run: the method the registry gives a float layer here
    layers = [Linear.of(w) for w in weights]
    for layer in layers:
        layer.set_method(float_method(layer, torch.device("cpu"), dtype))

    def decode() -> None:
        for layer in layers:
            layer(row)

    with torch.inference_mode():
        decode_s = _best(decode, MEASURE_BUDGET_S) / copies
        prefill_s = _best(lambda: F.linear(rows, cols), MEASURE_BUDGET_S)
    return DtypeTiming(dtype_name, decode_s, prefill_s)


def measure_rounds(names: list[str], shape: tuple[int, int], rounds: int = MEASURE_ROUNDS) -> list[DtypeTiming]:
    """Each dtype's best decode and prefill probe over ``rounds`` rounds that alternate the dtypes, so load
    from a neighbour that comes and goes falls on every candidate rather than on one."""
    best: dict[str, DtypeTiming] = {}
    for _ in range(rounds):
        for name in names:
            t = measure(name, shape)
            seen = best.get(name)
            best[name] = t if seen is None else DtypeTiming(name, min(seen.decode_s, t.decode_s),
                                                            min(seen.prefill_s, t.prefill_s))
    return [best[name] for name in names]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def auto_cpu_dtype(home: Path, shape: tuple[int, int] = DEFAULT_SHAPE) -> str:
    """The measured choice for this machine and shape, from the cache or measured now (and cached)."""
    import torch

    from common.kernels.isa import cpu_flags
    from common.model import gemv

    flags = cpu_flags()
    threads = torch.get_num_threads()
    # which decode matmul was timed is part of the key: a choice measured through another one is stale
    matmul = "+gemv" if gemv.wanted(torch.device("cpu")) else ""
    key = cache_key(cpu_name(), flags, torch.__version__ + matmul, threads, shape)
    cached = read_cached(home, key)
    if cached is not None:
        return cached
    start = time.perf_counter()
    timings = measure_rounds(candidate_dtypes(flags), shape)
    choice = choose_dtype(timings)
    log.info("--dtype auto: %s (measured in %.0f ms on %d threads: %s)", choice, 1e3 * (time.perf_counter() - start),
             threads, ", ".join(f"{t.dtype} decode {t.decode_s * 1e6:.0f} us prefill {t.prefill_s * 1e6:.0f} us"
                                 for t in timings))
    write_cached(home, key, choice, timings, f"{cpu_name()}, torch {torch.__version__}, {threads} threads")
    return choice

"""Machine limits and the decode roofline: the fastest any system could decode this model on this CPU.

    python -m benchmarks.roofline [--model SmolLM2-135M-Instruct|DIR] [--dtype bfloat16] [--threads N]
                                  [--batches 1,64] [--context 256] [--json PATH] [--quick]

Measures, with torch on ``--threads`` threads, the memory bandwidth (a copy and a read-only sum over
buffers at least 4x the last-level cache) and the GEMM throughput (a large square GEMM and a decode-shaped
one), best of several repeats. Every measurement is bounded by time, so the section finishes in well under
30 s on any CPU: a small probe GEMM gives each dtype's rate, the square GEMM is the largest of
``GEMM_SIZES`` that runs in under ``GEMM_TARGET_S`` at that rate, and repeats stop after a per-measurement
budget. Where bf16 has no native support (no AVX512-BF16 / AMX) its GEMMs run at ~1% of fp32 speed; the
size shrinks accordingly and the report says so. Then counts what one decode step of the model moves and computes: every
linear weight (LM head included) and norm is read once per step whatever the batch, the embedding lookup
reads one row per sequence, and each sequence reads its whole KV cache. A step of B sequences at context
C yields B tokens, so

    tokens/s <= min(B * read_bw / (weight_bytes + B * C * kv_bytes_per_token),  matmul_peak / flops_per_token)

The first term binds at small batches (decode is a sweep over the weights), the second once the weights
are amortised over enough sequences. The read bandwidth is used because decode reads far more than it
writes; the large-GEMM figure because it is the best the CPU's matrix units reach in torch.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.machine import cpu_name

if TYPE_CHECKING:
    from common.config.model_config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
MEASURED_DTYPES = tuple(DTYPE_BYTES)
LLC_SIZE_PATH = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")
MIN_BUFFER_BYTES = 256 << 20  # also the size used when the LLC size is unknown
QUICK_BUFFER_BYTES = 4 << 20  # --quick: in cache, so only a smoke test of the code path
GEMM_SIZES = (2048, 1024, 512, 256)  # square GEMM candidates, largest first
PROBE_GEMM = 256  # measured first, to predict what a larger size costs
GEMM_TARGET_S = 0.3  # the square GEMM is the largest size predicted to run in under this
QUICK_GEMM = 256
MEASURE_BUDGET_S = 2.0  # repeats of one measurement stop after this (at least one timed run)
INNER_TARGET_S = 0.05  # back-to-back calls of a short kernel are batched up to about this
DECODE_GEMM = (64, 576, 1536)  # 64 sequences through SmolLM2's down projection


class Bound(enum.Enum):
    MEMORY = "memory"
    COMPUTE = "compute"


@dataclass(frozen=True)
class MachineLimits:
    """Measured ceilings of this machine at a given thread count."""

    cpu: str
    cores: int  # usable by this process (its affinity mask)
    threads: int
    llc_bytes: int | None
    copy_gb_s: float  # (read + write bytes) / s of a large tensor copy
    read_gb_s: float  # bytes read / s of a large tensor sum
    matmul_gflops: dict[str, float]  # dtype -> large-GEMM GFLOP/s
    decode_gemm_gflops: dict[str, float]  # dtype -> decode-shaped GEMM GFLOP/s
    matmul_size: dict[str, int] = field(default_factory=dict)  # dtype -> n of the n x n x n GEMM measured
    notes: list[str] = field(default_factory=list)  # what was shrunk or skipped, and why

    def matmul_peak(self, dtype: str) -> float:
        if dtype not in self.matmul_gflops:
            raise ValueError(f"no GEMM measurement for dtype {dtype!r}; measured: {', '.join(self.matmul_gflops)}")
        return self.matmul_gflops[dtype]


@dataclass(frozen=True)
class StepCost:
    """What one decode step of ``batch`` sequences at ``context`` tokens each reads and computes."""

    batch: int
    context: int
    dtype: str
    params: int  # parameters of the model (the tied embedding counted once)
    weight_bytes: int  # weights read per step: linears, LM head, norms, ``batch`` embedding rows
    kv_bytes_per_token: int  # K and V of one token over all layers
    flops_per_token: float  # linear layers (2 per weight) + attention over ``context`` positions

    @property
    def kv_bytes(self) -> int:
        return self.batch * self.context * self.kv_bytes_per_token

    @property
    def bytes_per_step(self) -> int:
        return self.weight_bytes + self.kv_bytes


def decode_step_cost(config: ModelConfig, dtype: str, batch: int, context: int) -> StepCost:
    """Exact byte and FLOP counts of one decode step (weights, KV cache and activations in ``dtype``)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not supported; supported: {', '.join(DTYPE_BYTES)}")
    if batch <= 0 or context <= 0:
        raise ValueError(f"batch and context must be > 0, got batch={batch}, context={context}")
    c, width = config, DTYPE_BYTES[dtype]
    h, q, kv, inter = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
    # Weight matrices of one layer: q, k, v, o projections and the gate, up, down of the SwiGLU MLP.
    layer_matrices = h * q + 2 * h * kv + q * h + 3 * h * inter
    layer_biases = ((q + 2 * kv) if c.qkv_bias else 0) + (h if c.o_bias else 0) + ((2 * inter + h) if c.mlp_bias else 0)
    layer_norms = 2 * h  # input and post-attention RMSNorm
    lm_head = c.vocab_size * h
    linear_weights = c.num_layers * layer_matrices + lm_head
    # Read every step, whatever the batch. A tied LM head is still read in full: it is the embedding table.
    read_per_step = linear_weights + c.num_layers * (layer_biases + layer_norms) + h  # + final norm
    params = (c.num_layers * (layer_matrices + layer_biases + layer_norms) + h + c.vocab_size * h
              + (0 if c.tie_word_embeddings else lm_head))
    # Attention of one new token: q.K^T and p.V over `context` positions, 2 FLOPs per multiply-add each.
    attention_flops = 4 * c.num_layers * c.num_heads * c.head_dim * context
    return StepCost(
        batch=batch,
        context=context,
        dtype=dtype,
        params=params,
        weight_bytes=(read_per_step + batch * h) * width,  # + one embedding row per sequence
        kv_bytes_per_token=c.num_layers * 2 * kv * width,
        flops_per_token=float(2 * linear_weights + attention_flops),
    )


def memory_bound_tokens_per_s(limits: MachineLimits, cost: StepCost) -> float:
    return cost.batch * limits.read_gb_s * 1e9 / cost.bytes_per_step


def compute_bound_tokens_per_s(limits: MachineLimits, cost: StepCost) -> float:
    return limits.matmul_peak(cost.dtype) * 1e9 / cost.flops_per_token


def roofline(limits: MachineLimits, cost: StepCost) -> float:
    """Upper bound on decode tokens/s: the lower of the memory and the compute ceiling."""
    return min(memory_bound_tokens_per_s(limits, cost), compute_bound_tokens_per_s(limits, cost))


def binding_bound(limits: MachineLimits, cost: StepCost) -> Bound:
    memory, compute = memory_bound_tokens_per_s(limits, cost), compute_bound_tokens_per_s(limits, cost)
    return Bound.MEMORY if memory <= compute else Bound.COMPUTE


def read_llc_bytes(path: Path = LLC_SIZE_PATH) -> int | None:
    """The last-level cache size from sysfs ("32768K"), or None when the file is absent or unreadable."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        return int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)
    except ValueError:
        return None


def _best_seconds(fn: Callable[[], object], repeats: int, inner: int = 1,
                  budget_s: float = MEASURE_BUDGET_S) -> float:
    """Fastest of up to ``repeats`` timings of ``inner`` back-to-back calls, per call (after one untimed
    call); stops early once ``budget_s`` has passed, after at least one timed run."""
    fn()
    best = float("inf")
    deadline = time.perf_counter() + budget_s
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        end = time.perf_counter()
        best = min(best, (end - start) / inner)
        if end > deadline:
            break
    return best


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX); without it bf16 GEMMs crawl."""
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported()) or bool(getattr(torch.cpu, "_is_amx_tile_supported", bool)())


def pick_gemm_size(probe_gflops: float, target_s: float = GEMM_TARGET_S, sizes: tuple[int, ...] = GEMM_SIZES) -> int:
    """The largest square size whose GEMM runs in under ``target_s`` at ``probe_gflops`` (else the smallest)."""
    for n in sizes:
        if 2 * n**3 / (probe_gflops * 1e9) <= target_s:
            return n
    return min(sizes)


def measure_machine(threads: int, quick: bool = False) -> MachineLimits:
    """Measure bandwidth and GEMM throughput with torch on ``threads`` threads (restored afterwards)."""
    import torch

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    notes: list[str] = []
    try:
        llc = read_llc_bytes()
        # 4x the LLC so that neither buffer stays in cache between repeats.
        buffer_bytes = QUICK_BUFFER_BYTES if quick else max(4 * (llc or 0), MIN_BUFFER_BYTES)
        repeats = 2 if quick else 5
        copy_gb_s, read_gb_s = _bandwidth(buffer_bytes, repeats)
        matmul, decode, sizes = {}, {}, {}
        for dtype in MEASURED_DTYPES:
            probe = _gemm_gflops((PROBE_GEMM,) * 3, dtype, 1 if quick else 2, inner=1)
            n = QUICK_GEMM if quick else pick_gemm_size(probe)
            matmul[dtype] = probe if n == PROBE_GEMM else _gemm_gflops((n, n, n), dtype, repeats, inner=1)
            sizes[dtype] = n
            decode[dtype] = _gemm_gflops(DECODE_GEMM, dtype, repeats, inner=2 if quick else 20)
            if not quick and n < max(GEMM_SIZES):
                slow_bf16 = dtype == "bfloat16" and not native_bf16()
                why = " (this CPU has no native bf16: no AVX512-BF16 / AMX)" if slow_bf16 else ""
                notes.append(f"{dtype} GEMM shrunk to {n}^3 to stay under {GEMM_TARGET_S} s at "
                             f"{probe:.1f} GFLOP/s{why}")
    finally:
        torch.set_num_threads(previous_threads)
    return MachineLimits(cpu=cpu_name(), cores=len(os.sched_getaffinity(0)), threads=threads, llc_bytes=llc,
                         copy_gb_s=copy_gb_s, read_gb_s=read_gb_s,
                         matmul_gflops=matmul, decode_gemm_gflops=decode, matmul_size=sizes, notes=notes)


def _bandwidth(buffer_bytes: int, repeats: int) -> tuple[float, float]:
    """(copy, read) GB/s over float32 buffers of ``buffer_bytes``; a copy moves each byte twice."""
    import torch

    src = torch.ones(buffer_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy_s = _best_seconds(lambda: dst.copy_(src), repeats)
    read_s = _best_seconds(src.sum, repeats)
    return 2 * buffer_bytes / copy_s / 1e9, buffer_bytes / read_s / 1e9


def _gemm_gflops(shape: tuple[int, int, int], dtype: str, repeats: int, inner: int) -> float:
    """GFLOP/s of ``torch.mm`` at ``shape``; ``inner`` shrinks so one timed run stays near INNER_TARGET_S."""
    import torch

    m, n, k = shape
    torch_dtype = getattr(torch, dtype)
    a = torch.randn(m, k).to(torch_dtype)  # a: [m, k], b: [k, n]
    b = torch.randn(k, n).to(torch_dtype)
    out = torch.empty(m, n, dtype=torch_dtype)
    start = time.perf_counter()
    torch.mm(a, b, out=out)  # also the warm-up, and the estimate that sizes `inner`
    once = time.perf_counter() - start
    inner = max(1, min(inner, int(INNER_TARGET_S / max(once, 1e-9))))
    seconds = _best_seconds(lambda: torch.mm(a, b, out=out), repeats, inner)
    return 2 * m * n * k / seconds / 1e9


def build_report(limits: MachineLimits, config: ModelConfig, dtype: str, batches: list[int],
                 context: int) -> dict[str, Any]:
    """The JSON document the benchmark report reads; its schema is fixed (see ``main``'s --json)."""
    one = decode_step_cost(config, dtype, 1, context)
    costs = [decode_step_cost(config, dtype, batch, context) for batch in batches]
    return {
        "machine": asdict(limits),
        # weight_bytes_per_step is the batch-1 figure: each further sequence adds one embedding row.
        "model": {"name": config.name, "dtype": dtype, "params": one.params, "weight_bytes_per_step": one.weight_bytes,
                  "kv_bytes_per_token": one.kv_bytes_per_token, "flops_per_token": one.flops_per_token},
        "roofline": [{"batch": c.batch, "context": c.context, "bytes_per_step": c.bytes_per_step,
                      "tokens_per_s": roofline(limits, c), "bound": binding_bound(limits, c).value}
                     for c in costs],
    }


def print_markdown(limits: MachineLimits, costs: list[StepCost], model_name: str) -> None:
    decode = ", ".join(f"{d} {limits.decode_gemm_gflops[d]:.0f}" for d in limits.decode_gemm_gflops)
    llc = f"{limits.llc_bytes / 2**20:.0f} MiB" if limits.llc_bytes else "unknown"
    dm, dn, dk = DECODE_GEMM
    gemm = ", ".join(f"{d} {limits.matmul_gflops[d]:.0f} ({limits.matmul_size.get(d, 0)}^3)"
                     for d in limits.matmul_gflops)
    print(f"# Machine limits and decode roofline — {model_name}\n")
    print(f"- CPU: {limits.cpu}, {limits.cores} usable cores, {limits.threads} torch threads, LLC {llc}")
    print(f"- Memory bandwidth: copy {limits.copy_gb_s:.1f} GB/s (read + write), read {limits.read_gb_s:.1f} GB/s")
    print(f"- GEMM GFLOP/s: {gemm}; decode-shaped {dm}x{dn}x{dk}: {decode}")
    print(f"- native bf16 (AVX512-BF16 / AMX): {native_bf16()}")
    for note in limits.notes:
        print(f"- note: {note}")
    one = costs[0]
    print(f"- Model ({one.dtype}): {one.params / 1e6:.1f} M parameters, {one.weight_bytes / 1e6:.1f} MB of weights "
          f"read per step (batch {one.batch}), KV {one.kv_bytes_per_token} B/token, "
          f"{one.flops_per_token / 1e6:.1f} MFLOP/token at context {one.context}\n")
    print("| batch | context | MB/step | memory ceiling tok/s | compute ceiling tok/s | roofline tok/s | bound |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for c in costs:
        print(f"| {c.batch} | {c.context} | {c.bytes_per_step / 1e6:.1f} | {memory_bound_tokens_per_s(limits, c):.0f} "
              f"| {compute_bound_tokens_per_s(limits, c):.0f} | **{roofline(limits, c):.0f}** "
              f"| {binding_bound(limits, c).value} |")
    print("\nMemory ceiling = batch x read bandwidth / bytes per step (weights + the batch's KV cache); compute "
          f"ceiling = {one.dtype} large-GEMM throughput / FLOPs per token. Real decode also pays attention "
          "kernels, sampling and Python per step, so measured rates sit below the roofline.")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="a HF directory or the bundled model")
    parser.add_argument("--dtype", default="bfloat16", choices=MEASURED_DTYPES)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch CPU threads")
    parser.add_argument("--batches", default="1,64", help="comma-separated decode batch sizes")
    parser.add_argument("--context", type=int, default=256, help="tokens in each sequence's KV cache")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures as JSON here")
    parser.add_argument("--quick", action="store_true", help="small in-cache buffers and GEMMs: a smoke run")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from common.config.model_config import ModelConfig
    from common.config.settings import ModelSettings, load_settings
    from common.model.model_store import resolve_model

    args = parse_args(argv)
    config = ModelConfig.from_pretrained(resolve_model(args.model, load_settings(ModelSettings).home))
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    limits = measure_machine(args.threads, quick=args.quick)
    print_markdown(limits, [decode_step_cost(config, args.dtype, b, args.context) for b in batches], config.name)
    document = build_report(limits, config, args.dtype, batches, args.context)
    if args.json is not None:
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return document


if __name__ == "__main__":
    main()

"""The planner's cost model: one engine step's time from what the step computes, fitted by least squares.

    step seconds = base + per_prefill_token * P + per_decode_seq * D + per_context_token * C
                   + per_prefill_pair * A

P: prefill tokens in the step (every prefill chunk's), D: decoding sequences in it, C: the decoding
sequences' total context (their attention reads the KV of C tokens), A: the prefill chunks' query-key
pairs, sum of n * (start + n / 2) (a chunk of n tokens after ``start`` cached ones attends to them all:
attention's quadratic part, which a 1.5k-token prompt in 512-token chunks makes visible). The
coefficients are fitted once per (model, dtype, threads, CPU) from timed engine steps
(``benchmarks.planner.step_timing``), non-negative, and stored as JSON in ``TANDEM_HOME/planner/``.
KV transfer between nodes costs ``kv_transfer_per_token_s`` per token, measured on the same machine.
Pure Python and numpy: no torch here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from dataclasses import fields as fields_of
from pathlib import Path


@dataclass(frozen=True)
class StepShape:
    """What one engine step computes, as the cost model sees it."""

    prefill_tokens: int = 0
    decode_seqs: int = 0
    context_tokens: int = 0  # the decoding sequences' KV length, summed
    prefill_pairs: float = 0.0  # sum over prefill chunks of n * (start + n / 2)

    @staticmethod
    def of(chunks: Iterable[tuple[int, int, bool]]) -> StepShape:
        """From ``(start, num_tokens, decoding)`` per scheduled chunk."""
        p = d = c = 0
        pairs = 0.0
        for start, n, decoding in chunks:
            if decoding:
                d += 1
                c += start + n
            else:
                p += n
                pairs += n * (start + n / 2)
        return StepShape(p, d, c, pairs)

    @property
    def features(self) -> tuple[float, ...]:
        return (1.0, float(self.prefill_tokens), float(self.decode_seqs), float(self.context_tokens),
                self.prefill_pairs)


@dataclass(frozen=True)
class StepSample:
    shape: StepShape
    seconds: float


@dataclass(frozen=True)
class CostKey:
    """What a fitted model is valid for."""

    model: str
    dtype: str
    threads: int
    cpu: str

    @property
    def label(self) -> str:
        return f"{self.model}|{self.dtype}|{self.threads}|{self.cpu}"


@dataclass(frozen=True)
class CostModel:
    base_s: float
    per_prefill_token_s: float
    per_decode_seq_s: float
    per_context_token_s: float
    per_prefill_pair_s: float
    kv_transfer_per_token_s: float = 0.0
    # a serving node's own work per token it streams (benchmarks/planner/serving_overhead.py), measured
    per_streamed_token_s: float = 0.0
    num_samples: int = 0
    rms_error_s: float = 0.0  # of the fit, on its own samples
    rms_relative_error: float = 0.0

    def __post_init__(self) -> None:
        if min(self.coefficients) < 0 or self.kv_transfer_per_token_s < 0 or self.per_streamed_token_s < 0:
            raise ValueError(f"cost coefficients must be >= 0, got {self}")

    @property
    def coefficients(self) -> tuple[float, ...]:
        return (self.base_s, self.per_prefill_token_s, self.per_decode_seq_s, self.per_context_token_s,
                self.per_prefill_pair_s)

    def step_s(self, shape: StepShape) -> float:
        """The fitted step, plus streaming each decoding sequence's token (a served step's own work)."""
        fitted = sum(c * f for c, f in zip(self.coefficients, shape.features, strict=True))
        return fitted + self.per_streamed_token_s * shape.decode_seqs

    def describe(self) -> str:
        return (f"step = {self.base_s * 1e3:.2f} ms + {self.per_prefill_token_s * 1e6:.1f} us/prefill token + "
                f"{self.per_decode_seq_s * 1e3:.3f} ms/decoding sequence + {self.per_context_token_s * 1e9:.1f} "
                f"ns/context token + {self.per_prefill_pair_s * 1e9:.3f} ns/prefill query-key pair; KV transfer "
                f"{self.kv_transfer_per_token_s * 1e6:.2f} us/token; serving "
                f"{self.per_streamed_token_s * 1e6:.0f} us per streamed token ({self.num_samples} steps, rms error "
                f"{self.rms_error_s * 1e3:.2f} ms, {100 * self.rms_relative_error:.0f}%)")


def fit(samples: Sequence[StepSample], kv_transfer_per_token_s: float = 0.0) -> CostModel:
    """Least squares of the *relative* error with non-negative coefficients.

    Relative, so a 30 ms decode step weighs as much as a 2 s prefill step (TPOT is made of the former,
    TTFT mostly of the latter). A coefficient the unconstrained fit makes negative is fixed at 0 and the
    rest refitted (the active-set step of NNLS, enough for five features)."""
    import numpy as np

    if len(samples) < 2:
        raise ValueError(f"need at least 2 timed steps to fit a cost model, got {len(samples)}")
    x = np.array([s.shape.features for s in samples], dtype=np.float64)
    y = np.array([s.seconds for s in samples], dtype=np.float64)
    if y.min() <= 0:
        raise ValueError("timed steps must take > 0 s")
    x_rel, y_rel = x / y[:, None], np.ones_like(y)
    # Columns on one scale, so the solver's cut-off treats them alike (pairs are ~1e5 times tokens).
    scale = np.maximum(np.abs(x_rel).max(axis=0), 1e-12)
    active = [j for j in range(x.shape[1]) if np.any(x[:, j])]
    coef = np.zeros(x.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(x_rel[:, active] / scale[active], y_rel, rcond=None)
        if solution.min() >= 0:
            coef[active] = solution / scale[active]
            break
        active.pop(int(np.argmin(solution)))
    rms = float(np.sqrt(np.mean((x @ coef - y) ** 2)))
    rms_relative = float(np.sqrt(np.mean((x @ coef / y - 1) ** 2)))
    base, prefill, decode, context, pairs = (float(c) for c in coef)
    return CostModel(base, prefill, decode, context, pairs, kv_transfer_per_token_s=kv_transfer_per_token_s,
                     num_samples=len(samples), rms_error_s=rms, rms_relative_error=rms_relative)


class CostModelStore:
    """Fitted cost models in one JSON file (``TANDEM_HOME/planner/cost_models.json``), keyed by ``CostKey``."""

    def __init__(self, home: Path) -> None:
        self.path = home / "planner" / "cost_models.json"

    def _entries(self) -> dict[str, dict[str, object]]:
        if not self.path.is_file():
            return {}
        entries: dict[str, dict[str, object]] = json.loads(self.path.read_text())
        return entries

    def load(self, key: CostKey) -> CostModel | None:
        entry = self._entries().get(key.label)
        if entry is None:
            return None
        fields = entry["cost_model"]
        assert isinstance(fields, dict)
        if set(fields) != {f.name for f in fields_of(CostModel)}:
            return None  # stored by another version of Tandem: fit again
        return CostModel(**fields)

    def save(self, key: CostKey, model: CostModel, samples: Sequence[StepSample] = ()) -> None:
        """Store ``model`` (and the timed steps it was fitted from, to refit or inspect) under ``key``."""
        entries = self._entries()
        entries[key.label] = {"key": asdict(key), "cost_model": asdict(model),
                              "samples": [[*asdict(s.shape).values(), s.seconds] for s in samples]}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(entries, indent=2, sort_keys=True))
        tmp.replace(self.path)  # a reader never sees half a file

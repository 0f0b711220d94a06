"""The serving benchmark's workload: requests (token-id prompts, exact output lengths) and their arrival times.

Everything comes from one seed, so two systems measured in one run, or in two runs, see the same requests
in the same order at the same offsets. Lengths are log-uniform between the bounds: real traffic is skewed
toward short prompts and short answers (chat logs such as ShareGPT have medians well below their means),
and a log-uniform spread keeps a long tail without a data set. Prompts are random token ids (no tokenizer
needed; prefix caching finds nothing to share), and requests ignore EOS so every output has its exact length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy is imported on use: `tandem` builds its parser (this module's defaults) on every call
    import numpy as np

# Ids below this are special and byte tokens in most vocabularies; tiny test vocabularies keep half.
LOWEST_ORDINARY_ID = 100


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt_token_ids: tuple[int, ...]
    output_len: int  # exactly this many tokens are generated (EOS ignored)


@dataclass(frozen=True)
class Workload:
    """What to send: ``num_requests`` requests with lengths log-uniform in the inclusive ranges."""

    num_requests: int = 48
    prompt_len: tuple[int, int] = (32, 512)
    output_len: tuple[int, int] = (16, 128)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        for name in ("prompt_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be a range 1 <= low <= high, got {lo}..{hi}")

    def requests(self, vocab_size: int) -> list[BenchRequest]:
        """The requests, ids drawn uniformly from ``[min(100, vocab_size // 2), vocab_size)``."""
        lengths_rng, ids_rng, _ = self._rngs()
        prompt_lens = log_uniform_ints(lengths_rng, *self.prompt_len, self.num_requests)
        output_lens = log_uniform_ints(lengths_rng, *self.output_len, self.num_requests)
        low = min(LOWEST_ORDINARY_ID, vocab_size // 2)
        return [BenchRequest(i, tuple(int(t) for t in ids_rng.integers(low, vocab_size, int(n))), int(m))
                for i, (n, m) in enumerate(zip(prompt_lens, output_lens, strict=True))]

    def arrival_offsets(self, rate: float) -> list[float]:
        """Seconds after the start at which each request is sent: a Poisson process of ``rate`` requests/s
        (exponential gaps, the first request at 0); ``inf`` sends them all at once."""
        if rate <= 0:
            raise ValueError(f"rate must be > 0 requests/s, got {rate}")
        if math.isinf(rate):
            return [0.0] * self.num_requests
        import numpy as np

        *_, arrivals_rng = self._rngs()
        gaps = arrivals_rng.exponential(1.0 / rate, self.num_requests - 1)
        return [0.0, *(float(t) for t in np.cumsum(gaps))]

    def _rngs(self) -> list[np.random.Generator]:
        import numpy as np

        # Independent streams: the ids do not shift when a length bound changes, nor arrivals with either.
        return [np.random.default_rng(s) for s in np.random.SeedSequence(self.seed).spawn(3)]


def log_uniform_ints(rng: np.random.Generator, low: int, high: int, n: int) -> np.ndarray:
    """``n`` integers in ``[low, high]``: floor(exp(u)) with u uniform on [ln low, ln(high + 1))."""
    import numpy as np

    u = rng.uniform(math.log(low), math.log(high + 1), n)
    return np.minimum(np.floor(np.exp(u)).astype(np.int64), high)


def log_uniform_mean(low: int, high: int) -> float:
    """The exact mean of ``log_uniform_ints(., low, high, .)``: P(k) = ln((k + 1) / k) / ln((high + 1) / low)."""
    norm = math.log((high + 1) / low)
    return sum(k * math.log((k + 1) / k) for k in range(low, high + 1)) / norm

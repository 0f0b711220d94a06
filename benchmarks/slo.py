"""Latency SLOs, SLO attainment and goodput (DistServe's definition), for measured and simulated runs alike.

A request meets the SLO when it completed, its TTFT <= the TTFT SLO and its TPOT (mean time per output
token after the first) <= the TPOT SLO; a request with a single output token has no TPOT and meets that
half by definition. Goodput = requests meeting both / the run's duration; attainment = the share of
*all* requests sent (failed ones included, as misses) meeting both, and each alone.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLOs must be > 0, got ttft {self.ttft_s} s, tpot {self.tpot_s} s")

    def describe(self) -> str:
        return f"TTFT <= {self.ttft_s * 1e3:g} ms, TPOT <= {self.tpot_s * 1e3:g} ms"

    @property
    def flag(self) -> str:
        """As ``--goodput`` / ``--slo`` take it."""
        return f"ttft:{self.ttft_s * 1e3:g},tpot:{self.tpot_s * 1e3:g}"


def parse_slo(text: str) -> SLO:
    """``ttft:MS,tpot:MS`` (both, milliseconds, either order) -> SLO; an argparse ``type``."""
    values: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition(":")
        try:
            if not sep or name not in ("ttft", "tpot") or name in values:
                raise ValueError(part)
            values[name] = float(value) / 1e3
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected ttft:MS,tpot:MS, got {text!r}") from None
    if set(values) != {"ttft", "tpot"}:
        raise argparse.ArgumentTypeError(f"expected both ttft:MS and tpot:MS, got {text!r}")
    try:
        return SLO(values["ttft"], values["tpot"])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# One request's latencies: None when it failed; (TTFT, TPOT), TPOT None for a single output token.
Latencies = tuple[float, float | None] | None


@dataclass(frozen=True)
class Attainment:
    """How many of a run's requests met the SLO, and the goodput that makes."""

    slo: SLO
    num_requests: int  # every request sent, failed ones included
    met_both: int
    met_ttft: int
    met_tpot: int
    duration_s: float

    @staticmethod
    def of(slo: SLO, latencies: Iterable[Latencies], duration_s: float) -> Attainment:
        n = both = ttft_ok = tpot_ok = 0
        for lat in latencies:
            n += 1
            if lat is None:
                continue
            a = lat[0] <= slo.ttft_s
            b = lat[1] is None or lat[1] <= slo.tpot_s
            ttft_ok += a
            tpot_ok += b
            both += a and b
        return Attainment(slo, n, both, ttft_ok, tpot_ok, duration_s)

    @property
    def goodput(self) -> float:
        """Requests/s meeting both SLOs."""
        return self.met_both / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def both(self) -> float:
        return self.met_both / self.num_requests if self.num_requests else 0.0

    @property
    def ttft(self) -> float:
        return self.met_ttft / self.num_requests if self.num_requests else 0.0

    @property
    def tpot(self) -> float:
        return self.met_tpot / self.num_requests if self.num_requests else 0.0

"""What a draft costs on this machine, measured while serving (adaptive k's price, common/engine/scheduler.py).

A draft is worth proposing while the chance it is accepted exceeds its cost as a fraction of a plain decode
step. That fraction depends on the machine and the model: verifying a row costs a few percent of a step
where the step is bound by streaming weights (a slow memory, a big model), more on a 2-core Zen 5 with
SmolLM2 (measured in session 8 with 4 n-gram drafts: benchmarks/results/2026-12-01-zen5/RESULTS.md; the
prior: benchmarks/results/figures-from-code.md), and a draft model's own forward adds to it.
So the runner measures it at batch 1, where speculation runs: exponential moving averages of a step's time
without drafts and of the extra time per draft with them (proposing plus verifying). Pure Python.
"""

from __future__ import annotations


class DraftCostMeter:
    """``record(seconds, drafts)`` per batch-1 decode step; ``cost``: seconds per draft / seconds per plain
    step, once both have ``min_samples`` observations (None before)."""

    def __init__(self, rate: float = 0.1, min_samples: int = 8) -> None:
        self.rate = rate
        self.min_samples = min_samples
        self.plain_s: float | None = None
        self.per_draft_s: float | None = None
        self.num_plain = 0
        self.num_drafted = 0

    def record(self, seconds: float, drafts: int) -> None:
        if drafts == 0:
            self.plain_s = seconds if self.plain_s is None else self.plain_s + self.rate * (seconds - self.plain_s)
            self.num_plain += 1
            return
        if self.plain_s is None:
            return  # no plain step to compare with yet
        extra = max(0.0, seconds - self.plain_s) / drafts
        previous = self.per_draft_s
        self.per_draft_s = extra if previous is None else previous + self.rate * (extra - previous)
        self.num_drafted += 1

    @property
    def cost(self) -> float | None:
        if (self.plain_s is None or self.per_draft_s is None or self.plain_s <= 0.0
                or min(self.num_plain, self.num_drafted) < self.min_samples):
            return None
        return self.per_draft_s / self.plain_s

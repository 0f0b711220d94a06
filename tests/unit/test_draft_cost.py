"""The draft-cost meter adaptive k prices drafts with (common/spec_decode/draft_cost.py): exact arithmetic."""

from __future__ import annotations

import pytest

from common.spec_decode.draft_cost import DraftCostMeter


def test_cost_is_extra_time_per_draft_over_a_plain_step() -> None:
    meter = DraftCostMeter(rate=0.5, min_samples=2)
    meter.record(0.012, drafts=4)  # no plain step yet: nothing to compare with
    assert meter.per_draft_s is None and meter.cost is None
    meter.record(0.010, drafts=0)
    meter.record(0.010, drafts=0)
    meter.record(0.014, drafts=4)  # 1 ms a draft
    assert meter.cost is None  # one drafted step is not enough
    meter.record(0.016, drafts=2)  # 3 ms a draft; the average moves half way: 2 ms
    assert meter.per_draft_s == pytest.approx(0.002)
    assert meter.cost == pytest.approx(0.2)
    meter.record(0.012, drafts=0)  # the plain step's average moves too: 11 ms
    assert meter.plain_s == pytest.approx(0.011)
    assert meter.cost == pytest.approx(0.002 / 0.011)


def test_a_drafted_step_faster_than_plain_costs_nothing() -> None:
    meter = DraftCostMeter(rate=1.0, min_samples=1)
    meter.record(0.010, drafts=0)
    meter.record(0.009, drafts=3)  # noise: never a negative price
    assert meter.cost == 0.0

"""The serving loop's step tally (issue 22): steps and seconds by rows decoded and kind, the bounded labels /metrics
gives them, and the difference of two snapshots (what `bench load` reads around a run)."""

from __future__ import annotations

import pytest

from inferscale.engine.steptally import StepTally, StepTotals, by_label, rows_label, since


def test_a_step_is_counted_under_its_rows_and_kind():
    tally = StepTally()
    tally.add(16, 0, 0.030)
    tally.add(16, 0, 0.050)
    tally.add(3, 64, 0.100)
    tally.add(0, 40, 0.020)
    tally.add(0, 0, 1.0)  # nothing computed (a cancellation): no step
    totals = tally.snapshot()
    assert totals == {(16, "decode"): StepTotals(2, pytest.approx(0.080)), (3, "mixed"): StepTotals(1, 0.100),
                      (0, "prompt"): StepTotals(1, 0.020)}
    assert totals[(16, "decode")].mean_s == pytest.approx(0.040)
    assert StepTotals().mean_s is None
    tally.add(16, 0, 0.040)
    assert totals[(16, "decode")].steps == 2  # a snapshot does not move with the tally


def test_negative_counts_are_refused():
    with pytest.raises(ValueError, match="rows -1"):
        StepTally().add(-1, 0, 0.01)


def test_rows_labels_are_a_bounded_set():
    assert [rows_label(r) for r in (0, 1, 2, 3, 4, 5, 8, 9, 16, 17, 256, 257, 10**6)] == [
        "0", "1", "2", "3-4", "3-4", "5-8", "5-8", "9-16", "9-16", "17-32", "129-256", "257+", "257+"]
    assert len({rows_label(r) for r in range(5000)}) == 11


def test_labels_sum_their_rows_and_snapshots_subtract():
    before = {(16, "decode"): StepTotals(1, 0.03)}
    after = {(16, "decode"): StepTotals(3, 0.10), (15, "decode"): StepTotals(2, 0.06),
             (1, "decode"): StepTotals(5, 0.1)}
    assert by_label(after) == {("9-16", "decode"): StepTotals(5, pytest.approx(0.16)),
                               ("1", "decode"): StepTotals(5, 0.1)}
    between = since(after, before)
    assert between[(16, "decode")] == StepTotals(2, pytest.approx(0.07)) and between[(15, "decode")].steps == 2
    assert since(before, before) == {}

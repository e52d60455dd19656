"""The runtime engine's price list (cost.engine): the schedule replay, the look schedule's pieces, the
forecast of final lengths and the calibrated move cost."""

from __future__ import annotations

import pytest

from nereus.cost.engine import (
    HISTORY,
    S_PER_BYTE_PRIOR,
    EngineCalibration,
    drain,
    gain_bound,
    move_cost,
    plain_finish_s,
    replica_work,
    row_seconds,
    slot_iterations,
    until_below,
)
from nereus.spec.generation import ReplicaStatus, SequenceRecord


def test_the_engine_schedule_is_replayed():
    # slots 2: [3, 1] run, the queued 2 takes the freed slot: rows 2 + 2 + 2 over 3 iterations
    assert drain([3, 1], [2], 2) == (6, 3)
    assert drain([], [], 4) == (0, 0)
    # caught up (cached = length - 1): one iteration per token left; caches dropped: prompt + replay first
    assert slot_iterations(prompt=5, generated=2, cached=6, final=4) == 2
    assert slot_iterations(prompt=5, generated=2, cached=0, final=4) == 4
    assert slot_iterations(prompt=5, generated=0, cached=0, final=3) == 3
    # slots 2, [3, 1] run, 2 queued: after iteration 1 two are left (the 1 ended), after 3 none
    assert until_below([3, 1], [2], 2, below=3) == 1
    assert until_below([3, 1], [2], 2, below=1) == drain([3, 1], [2], 2)[1] == 3
    assert until_below([3, 1], [2], 2, below=5) == 0  # already fewer


def test_replica_work_with_moves_and_the_plain_engine():
    seq = lambda i, g, c: SequenceRecord(i, 0, 4, g, c)  # noqa: E731
    rep = ReplicaStatus(0, (seq(0, 1, 4),), (seq(1, 0, 0),))
    final = {0: 3, 1: 2, 7: 2}
    assert replica_work(rep, final, 1) == drain([2], [2], 1)
    # a sequence moved in takes the next free slot; re-prefilled, its caches are gone (prompt + replay)
    moved_in = SequenceRecord(7, 1, 4, 1, 4)
    assert replica_work(rep, final, 1, [moved_in], frozenset({7}), frozenset({1})) == drain([2], [1 + 1 + 0], 1)
    assert replica_work(rep, final, 1, drop=frozenset({0, 1})) == (0, 0)
    other = ReplicaStatus(1, (), ())
    assert plain_finish_s((rep, other), final, [0.5, 1.0], 1, 0.25) == replica_work(rep, final, 1)[0] * 0.5 + 0.25


def test_gain_bound():
    # the bound: a perfect split of 10 rows gains 5; one 8-row sequence cannot be split: 2; no donor: 0
    assert gain_bound([10, 0], [4, 0], [1.0, 1.0], [True, False]) == 5.0
    assert gain_bound([10, 0], [8, 0], [1.0, 1.0], [True, False]) == 2.0
    assert gain_bound([10, 0], [4, 0], [1.0, 1.0], [False, False]) == 0.0


def test_calibration_forecasts_and_prices_moves():
    cal = EngineCalibration()
    assert cal.forecasts([0, 4], limit=12) == {0: 6.0, 4: 8.0}  # nothing seen: halfway to the limit
    cal.observe_lengths([3, 5, 10])
    # the mean of the run's lengths above what a sequence has generated
    assert cal.forecasts([4, 0, 10], limit=12) == {4: 7.5, 0: 6.0, 10: 11.0}
    cal.observe_lengths(range(2 * HISTORY))
    assert len(cal.lengths) == HISTORY  # the last HISTORY lengths
    assert cal.move_fixed_s() is None
    cal.observe_move(1000, 0.02)
    cal.observe_move(0, 0.04)
    cal.observe_move(0, 0.01)
    assert cal.move_fixed_s() == pytest.approx(0.02 - 1000 * S_PER_BYTE_PRIOR)
    assert move_cost(0.02, 10**6) == pytest.approx(0.02 + 10**6 * S_PER_BYTE_PRIOR)
    assert move_cost(-1.0, 0) == 0.0
    assert row_seconds((0, 0), (0.0, 0.0)) is None
    assert row_seconds((10, 0), (1.0, 0.0)) == [0.1, 0.1]  # a replica with no rows: the mean

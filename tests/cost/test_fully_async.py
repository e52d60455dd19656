"""verl's fully-async trainer's gen and step timers as a producer/consumer pipeline (cost.fully_async)."""

from __future__ import annotations

import pytest

from nereus.cost.controller import controller_time
from nereus.cost.fully_async import (
    LOCAL_STEPS_PER_VERSION,
    queue_assembly_time,
    sample_shortfall,
    trainer_step,
    trainer_wait,
)


def test_a_trainer_bound_pipeline_waits_only_for_the_assembly() -> None:
    # staleness 0.5 puts half a version ahead: more than the first of 4 local steps needs
    assert trainer_wait(production_s=100.0, assembly_s=30.0, other_work_s=300.0, staleness=0.5) == 30.0
    assert trainer_step(100.0, 30.0, 300.0, 0.5) == 330.0


def test_a_rollout_bound_pipeline_waits_for_what_the_trainer_does_not_cover() -> None:
    assert trainer_wait(production_s=400.0, assembly_s=30.0, other_work_s=300.0, staleness=1.0) == 100.0
    assert trainer_step(400.0, 30.0, 300.0, 1.0) == 400.0  # the trainer runs at the rollouter's pace


def test_a_staleness_below_one_local_step_leaves_the_first_step_short() -> None:
    """verl's default threshold 0.1 starts a version 0.1 of its samples ahead; the first of 4 local steps needs
    0.25 of them, so it waits for 0.15 of the version's production, then the rollouter keeps ahead."""
    assert LOCAL_STEPS_PER_VERSION == 4
    assert sample_shortfall(100.0, 300.0, staleness=0.1) == pytest.approx(15.0)
    assert trainer_wait(100.0, 30.0, 300.0, staleness=0.1) == pytest.approx(45.0)


def test_at_staleness_0_the_trainer_streams_all_but_its_last_step() -> None:
    """Nothing ahead at a version's start: the last local step waits for the version's last samples while
    the trainer has done three of its four steps' work, not for the whole rollout after its whole work."""
    wait = trainer_wait(production_s=200.0, assembly_s=30.0, other_work_s=160.0, staleness=0.0)
    assert wait == pytest.approx(30.0 + 200.0 - 0.75 * 160.0)
    assert 200.0 - 160.0 < wait < 30.0 + 200.0  # more than a free-running rollouter, less than taking turns
    assert sample_shortfall(40.0, 160.0, staleness=0.0) == pytest.approx(10.0)  # fast: the first step's


@pytest.mark.parametrize("production_s, work_s", [(100.0, 300.0), (200.0, 160.0), (500.0, 100.0)])
def test_the_shortfall_shrinks_with_staleness_and_ends_at_a_whole_version(production_s: float,
                                                                           work_s: float) -> None:
    short = [sample_shortfall(production_s, work_s, s) for s in (0.0, 0.1, 0.25, 0.5, 1.0, 2.0)]
    assert short == sorted(short, reverse=True)
    assert short[-2] == short[-1] == 0.0


def test_the_assembly_is_one_direction_of_a_driver_call() -> None:
    assert queue_assembly_time(8192, 30720) == pytest.approx(controller_time(8192, 30720) / 2)

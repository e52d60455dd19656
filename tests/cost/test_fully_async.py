"""verl's fully-async trainer's gen and step timers as a producer/consumer pipeline (cost.fully_async)."""

from __future__ import annotations

import pytest

from nereus.cost.controller import controller_time
from nereus.cost.fully_async import queue_assembly_time, trainer_step, trainer_wait


def test_a_trainer_bound_pipeline_waits_only_for_the_assembly() -> None:
    assert trainer_wait(production_s=100.0, assembly_s=30.0, other_work_s=300.0) == 30.0
    assert trainer_step(100.0, 30.0, 300.0) == 330.0


def test_a_rollout_bound_pipeline_waits_for_what_the_trainer_does_not_cover() -> None:
    assert trainer_wait(production_s=400.0, assembly_s=30.0, other_work_s=300.0) == 100.0
    assert trainer_step(400.0, 30.0, 300.0) == 400.0  # the trainer runs at the rollouter's pace


def test_the_assembly_is_one_direction_of_a_driver_call() -> None:
    assert queue_assembly_time(8192, 30720) == pytest.approx(controller_time(8192, 30720) / 2)

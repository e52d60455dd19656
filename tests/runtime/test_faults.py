"""Fault injection (``runtime.faults``): a named point does nothing unless a plan armed it, and then ends
the process."""

from __future__ import annotations

import multiprocessing
import signal

import pytest

from nereus.runtime.faults import Fault, FaultHook, FaultPlan


def _reach(points: list[str], point: str) -> None:
    hook = FaultHook()
    hook.arm(points)
    hook.at(point)


def _exit_code(points: list[str], point: str) -> int:
    proc = multiprocessing.get_context("fork").Process(target=_reach, args=(points, point))
    proc.start()
    proc.join(60)
    return proc.exitcode


def test_armed_point_kills_and_others_do_nothing():
    assert _exit_code([], "train_step") == 0
    assert _exit_code(["transition"], "train_step") == 0
    assert _exit_code(["train_step"], "train_step") == -signal.SIGKILL


def test_plan_names_workers_and_points():
    plan = FaultPlan((Fault(3, "train_step"), Fault(1, "transition")))
    assert plan.points_of(3) == ["train_step"] and plan.points_of(1) == ["transition"] and plan.points_of(0) == []
    assert FaultPlan.kill(2, "transition").points_of(2) == ["transition"]
    with pytest.raises(ValueError, match="unknown fault point 'optimizer'"):
        Fault(0, "optimizer")
    with pytest.raises(ValueError, match="unknown fault point"):
        FaultHook().arm(["backward"])

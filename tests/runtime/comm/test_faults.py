"""Fault injection (``runtime.comm.faults``): a named point does nothing unless a plan armed it, and then ends
the process (``kill``) or raises (``fail``), once."""

from __future__ import annotations

import multiprocessing
import signal

import pytest

from nereus.runtime.comm.faults import Fault, FaultHook, FaultPlan, InjectedFault


def _reach(actions: dict[str, str], point: str) -> None:
    hook = FaultHook()
    hook.arm(actions)
    hook.at(point)


def _exit_code(actions: dict[str, str], point: str) -> int:
    proc = multiprocessing.get_context("fork").Process(target=_reach, args=(actions, point))
    proc.start()
    proc.join(60)
    return proc.exitcode


def test_armed_point_kills_and_others_do_nothing():
    assert _exit_code({}, "train_step") == 0
    assert _exit_code({"transition.transfer": "kill"}, "train_step") == 0
    assert _exit_code({"train_step": "kill"}, "train_step") == -signal.SIGKILL


def test_a_fail_fault_raises_once():
    hook = FaultHook()
    hook.arm({"transition.prepare": "fail"})
    hook.at("transition.install")
    with pytest.raises(InjectedFault, match="injected failure at 'transition.prepare'"):
        hook.at("transition.prepare")
    hook.at("transition.prepare")  # fired already


def test_plan_names_workers_points_and_actions():
    plan = FaultPlan((Fault(3, "train_step"), Fault(1, "transition.transfer", "fail")))
    assert plan.actions_of(3) == {"train_step": "kill"} and plan.actions_of(1) == {"transition.transfer": "fail"}
    assert plan.actions_of(0) == {}
    assert FaultPlan.kill(2, "transition.transfer").actions_of(2) == {"transition.transfer": "kill"}
    assert FaultPlan.fail(2, "transition.install").actions_of(2) == {"transition.install": "fail"}
    with pytest.raises(ValueError, match="unknown fault point 'optimizer'"):
        Fault(0, "optimizer")
    with pytest.raises(ValueError, match="unknown fault action 'hang'"):
        Fault(0, "train_step", "hang")
    with pytest.raises(ValueError, match="unknown fault point"):
        FaultHook().arm({"forward": "kill"})


def test_a_hot_path_asks_whether_a_point_is_armed():
    hook = FaultHook()
    assert not hook.armed_at("backward")
    hook.arm({"backward": "fail", "sync.transfer": "kill"})
    assert hook.armed_at("backward") and hook.armed_at("sync.transfer") and not hook.armed_at("generate")
    with pytest.raises(InjectedFault):
        hook.at("backward")
    assert not hook.armed_at("backward")  # each fires once

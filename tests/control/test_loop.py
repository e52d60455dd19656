"""The one control loop (``nereus.control.loop``) on the simulator backend: the record it fills, the loss of
devices between steps and in the middle of a step, and resuming from a given plan. The runtime drives the
same loop on Ray workers (tests/run/test_recovery.py, tests/run/test_adaptive.py)."""

from __future__ import annotations

import pytest

from nereus.control.backend import ClusterState, RecoveryMetrics, WorkersLost
from nereus.control.controller import Controller, ControllerConfig
from nereus.control.forecast import LengthSchedule
from nereus.control.held import HeldPlan
from nereus.control.loop import ControlLoop, Observer, Recovery, run_policy
from nereus.sim.backend import SimBackend, TruthConfig
from nereus.sim.reality import NO_REALITY
from tests.control.test_controller import small_job, trace


class LosesDevices(SimBackend):
    """The simulator with the runtime's recovery: once devices are lost, ``survivors`` remain, and recovery
    puts the job on them at the step the loss names."""

    def __init__(self, *args, survivors: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.survivors, self.recoveries = survivors, []

    def cluster(self, step):
        now = super().cluster(step)
        return ClusterState(min(now.num_gpus, self.survivors)) if self.recoveries else now

    def recover(self, lost, plan_for):
        plan = plan_for(self.survivors, lost.step)
        self.recoveries.append(plan)
        return RecoveryMetrics(lost.step, plan, seconds=2.0)


class DiesOnce(LosesDevices):
    """Devices die while step ``at`` runs (as the runtime reports it): the step raises ``WorkersLost``, and
    recovery puts the job on the survivors at the step in flight."""

    def __init__(self, *args, at: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.at = at

    def run_step(self, plan, step, policy):
        if step == self.at and not self.recoveries:
            raise WorkersLost(step, [self.survivors], elapsed_s=4.0)
        return super().run_step(plan, step, policy)


class Steps(Observer):
    def __init__(self) -> None:
        self.steps, self.recovered_at = [], []

    def step_done(self, outcome) -> None:
        self.steps.append(outcome.metrics.step)

    def recovered(self, lost, rec) -> None:
        self.recovered_at.append(rec.resume_step)


def test_a_mid_step_loss_recovers_onto_the_survivors_and_redoes_the_step():
    job = small_job(16)
    backend = DiesOnce(job, trace(12), 0, initial_gpus=16, at=5, survivors=8)
    ctl = Controller(job, ControllerConfig(), LengthSchedule(default_max=2048))
    seen = Steps()
    record = run_policy(ctl, backend, 12, observer=seen)
    assert seen.steps == list(range(12)) and seen.recovered_at == [5]  # step 5 is redone, once
    assert [s["step"] for s in record.steps] == list(range(12))
    assert backend.recoveries[0].num_gpus <= 8 and ctl.plan.num_gpus <= 8
    assert record.steps[5]["lost_s"] == pytest.approx(6.0)  # lost work + recovery, booked to the redone step
    assert [d["step"] for d in record.decisions if d["action"] == "recover"] == [5]  # recorded once, at 5
    assert record.plans[-1]["plan"]["num_gpus"] <= 8
    assert record.summary()["failures"] == 1


class DiesInMove(LosesDevices):
    """Devices die in the first transition (as the runtime reports it: the move after step ``s`` raises
    ``WorkersLost`` for step ``s + 1``, whose snapshot it took first)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.failed_after = None

    def apply_transition(self, old, new, step):
        if self.failed_after is None:
            self.failed_after = step
            raise WorkersLost(step + 1, [self.survivors], elapsed_s=1.5)
        return super().apply_transition(old, new, step)


def test_a_loss_in_a_transition_keeps_the_finished_step_and_resumes_after_it():
    """The step before the move finished: it is recorded once, on the plan it ran on, and the run resumes at
    the next step on the survivors' plan (nothing redone)."""
    job = small_job(16)
    grows = trace(12, gpus=[{"step": 0, "gpus": 16}, {"step": 5, "gpus": 32}])  # the controller moves onto more
    # the move onto more GPUs pays on the cost model's own truth (no driver pass or stragglers)
    backend = DiesInMove(job, grows, 0, truth=TruthConfig(reality=NO_REALITY), initial_gpus=16, survivors=8)
    seen = Steps()
    record = run_policy(Controller(job, ControllerConfig(), LengthSchedule(default_max=2048)), backend, 12,
                        observer=seen)
    s = backend.failed_after
    assert s is not None  # the controller moved at least once
    assert seen.steps == list(range(12)) and seen.recovered_at == [s + 1]
    assert [r["step"] for r in record.steps] == list(range(12))
    assert record.steps[s]["transition_s"] == 0.0  # the move did not happen
    assert record.steps[s + 1]["lost_s"] == pytest.approx(3.5)  # the lost move + recovery, booked to the next step
    assert backend.recoveries[0].num_gpus <= 8


def test_a_held_plan_never_moves_but_replans_onto_survivors():
    job = small_job(16)
    ctl = Controller(job, ControllerConfig(), LengthSchedule(default_max=2048))
    held = HeldPlan(ctl.initial_plan(16), ctl)
    backend = DiesOnce(job, trace(8), 0, initial_gpus=16, at=3, survivors=8)
    record = run_policy(held, backend, 8)
    assert record.summary()["transitions"] == 0
    assert len(record.plans) == 2 and record.plans[1]["step"] == 3 and held.plan.num_gpus <= 8


def test_a_resumed_loop_starts_on_the_given_plan_and_step():
    job = small_job(16)
    first = run_policy(Controller(job, ControllerConfig(), LengthSchedule(default_max=2048)),
                       SimBackend(job, trace(10), 0, initial_gpus=16), 4)
    ctl = Controller(job, ControllerConfig(), LengthSchedule(default_max=2048))
    loop = ControlLoop(ctl, SimBackend(job, trace(10), 0, initial_gpus=16))
    from nereus.spec.layout import Plan

    plan = Plan.from_dict(first.plans[-1]["plan"])
    loop.start(plan, step=4)
    record = loop.run(10, start=4)
    assert [s["step"] for s in record.steps] == list(range(4, 10))
    assert record.plans[0] == {"step": 4, "plan": plan.to_dict(), "strategy": plan.strategy}  # it round-trips
    assert plan.strategy == first.plans[-1]["strategy"]


def test_restart_recovery_needs_a_restart_cost():
    job = small_job(16)
    ctl = Controller(job, ControllerConfig(), LengthSchedule(default_max=2048))
    with pytest.raises(ValueError, match="restart_cost"):
        ControlLoop(ctl, SimBackend(job, trace(4), 0), recovery=Recovery("restart"))

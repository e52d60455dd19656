"""The one control loop: run a step, observe, decide, apply — the same code for both backends.

``ControlLoop`` drives a ``Policy`` (the controller or a baseline) on a ``Backend`` (the simulator or the
Ray runtime) and fills a ``RunRecord``. Devices are lost in one of two ways, and both go through the
backend protocol: between steps, as the cluster state the backend reports (the simulator's failure
traces: the step in flight is lost and the policy's next decision is forced), or while a step runs, as
``WorkersLost`` raised by ``run_step`` (the runtime: the policy plans for the survivors, the backend
rebuilds the state on them and the loop redoes the steps since the backend's snapshot). An ``Observer``
sees each step's outcome: the runtime's job logs metrics, evaluates and checkpoints there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from nereus.control.backend import (
    Backend,
    ClusterState,
    Decision,
    Policy,
    RecoveringBackend,
    RecoveryMetrics,
    StepMetrics,
    TransitionMetrics,
    WorkersLost,
)
from nereus.control.record import RunRecord
from nereus.spec.layout import Plan


@dataclass(frozen=True)
class Recovery:
    """What a loss between steps costs. ``live``: the policy moves the job onto the survivors (a forced
    transition) and loses only the step in flight. ``restart``: the job restarts from its last disk
    checkpoint, as verl and OpenRLHF do: relaunch, reload (the loop's ``restart_cost``), and redo every
    step since that checkpoint."""

    mode: str = "live"
    checkpoint_every: int = 50  # steps between disk checkpoints
    restart_s: float = 300.0  # relaunching workers and inference engines; an assumption, set it per cluster
    storage_bytes_per_s: float = 2e9  # checkpoint read bandwidth per node (as the transition baselines)


@dataclass
class StepOutcome:
    """One step as the loop saw it: what was measured, what the policy decided, what the move cost."""

    metrics: StepMetrics
    decision: Decision
    plan: Plan  # in force after the decision
    transition: TransitionMetrics | None
    lost_s: float


class Observer:
    """Hooks of the loop; the default does nothing."""

    def step_done(self, outcome: StepOutcome) -> None:
        """After a step and the transition it led to."""

    def recovered(self, lost: WorkersLost, rec: RecoveryMetrics) -> None:
        """After the backend recovered onto the survivors; steps from ``rec.resume_step`` on are redone."""


class ControlLoop:
    def __init__(self, policy: Policy, backend: Backend, record: RunRecord | None = None,
                 observer: Observer | None = None, recovery: Recovery | None = None,
                 restart_cost: Callable[[Plan], float] | None = None) -> None:
        self.policy, self.backend = policy, backend
        self.record = record or RunRecord(policy.name, "", "", 0)
        self.observer = observer or Observer()
        self.recovery = recovery or Recovery()
        if self.recovery.mode == "restart" and restart_cost is None:
            raise ValueError("Recovery(mode='restart') needs restart_cost: the seconds a relaunch and reload of "
                             "a plan take (the simulator supplies sim.run.restart_cost)")
        self.restart_cost = restart_cost
        self.plan: Plan | None = None
        self._since_checkpoint = 0.0  # step time since the last disk checkpoint (restart recovery)
        self._pending_lost_s = 0.0  # a mid-step loss not yet booked to a step
        self._wall_s = 0.0

    def start(self, plan: Plan | None = None, step: int = 0) -> Plan:
        """The policy's initial plan for the devices available at ``step``, or ``plan`` (a resumed run)."""
        if plan is None:
            plan = self.policy.initial_plan(self.backend.cluster(step).num_gpus)
        else:
            self.policy.resume(plan)
        self.plan = plan
        self.record.add_plan(step, plan)
        return plan

    def run(self, steps: int, start: int = 0) -> RunRecord:
        """Steps ``start`` .. ``steps - 1``; a mid-step loss sends the loop back to the backend's resume step."""
        if self.plan is None:
            self.start(step=start)
        t0 = time.perf_counter()
        step = start
        try:
            while step < steps:
                try:
                    self.step(step)
                except WorkersLost as lost:
                    step = self._recover(lost)
                    continue
                step += 1
        finally:
            self._wall_s += time.perf_counter() - t0
            self.record.wall_s = self._wall_s
        return self.record

    def step(self, step: int) -> StepOutcome:
        """One step: run it, observe the cluster, let the policy decide, apply a move."""
        plan = self.plan
        m = self.backend.run_step(plan, step, self.policy)  # the policy decides inside the step too
        for entry in m.generation:
            self.record.add_generation(entry)
        nxt = self.backend.cluster(step + 1)
        failed, lost_s = self._loss_between_steps(m, nxt, plan)
        lost_s += self._pending_lost_s
        self._pending_lost_s = 0.0
        decision = self.policy.after_step(m, nxt)
        tm = None
        if decision.plan is not None and decision.plan != plan:
            try:
                tm = self.backend.apply_transition(plan, decision.plan, step)
            except WorkersLost:  # the step itself finished: it is recorded (on the plan it ran on); the move is lost
                self._done(StepOutcome(m, decision, plan, None, lost_s))
                raise
            self.policy.transition_done(plan, decision.plan, tm)
            self.plan = decision.plan
            self.record.add_plan(step + 1, self.plan)
        elif decision.plan is not None:  # the same placements: the plan's per-step fields (its generation
            self.plan = decision.plan    # phases) change without a transition
        restarted = failed and self.recovery.mode == "restart"
        transition_s = 0.0 if tm is None or restarted else tm.seconds  # a restart re-places for free
        return self._done(StepOutcome(m, decision, self.plan, tm, lost_s), transition_s)

    def _done(self, outcome: StepOutcome, transition_s: float = 0.0) -> StepOutcome:
        """A finished step into the run record and to the observer."""
        self.record.add_step(outcome.metrics, outcome.plan.num_gpus, outcome.plan.strategy, transition_s,
                             outcome.lost_s)
        self.record.add_decision(outcome.decision, transition_s)
        self.observer.step_done(outcome)
        return outcome

    def _loss_between_steps(self, m: StepMetrics, nxt: ClusterState, plan: Plan) -> tuple[bool, float]:
        """Devices the plan uses failed after the step: the step in flight is lost, and under restart
        recovery the relaunch, the reload and the steps since the last checkpoint too."""
        failed = bool(nxt.lost) and nxt.num_gpus < plan.num_gpus
        lost_s = m.step_time_s if failed else 0.0
        if failed and self.recovery.mode == "restart":
            lost_s += self.restart_cost(plan) + self._since_checkpoint
        every = self.recovery.checkpoint_every
        self._since_checkpoint = 0.0 if (m.step + 1) % every == 0 or failed else self._since_checkpoint + m.step_time_s
        return failed, lost_s

    def _recover(self, lost: WorkersLost) -> int:
        backend: RecoveringBackend = self.backend  # only a backend that recovers raises WorkersLost
        rec = backend.recover(lost, self.policy.survivor_plan)
        self.plan = rec.plan
        self.record.add_recovery(rec.resume_step, rec.plan, rec.seconds, str(lost))
        self._pending_lost_s += lost.elapsed_s + rec.seconds
        self.observer.recovered(lost, rec)
        return rec.resume_step


def run_policy(policy: Policy, backend: Backend, steps: int, observer: Observer | None = None,
               recovery: Recovery | None = None, restart_cost: Callable[[Plan], float] | None = None) -> RunRecord:
    """Drive ``policy`` on ``backend`` for ``steps`` steps from its initial plan."""
    return ControlLoop(policy, backend, observer=observer, recovery=recovery, restart_cost=restart_cost).run(steps)

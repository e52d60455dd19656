"""A policy that holds one plan: the hand-picked layouts of a fixed run (``run.layouts``). It never moves
on its own; when devices die mid-step it hands the choice of the survivors' plan to a re-planner (the
controller, restricted to what the backend can run), as an operator would after a crash. Inside a step
it answers with its ``generation`` rule (``run.rollout.midstep``'s, ``control.midstep``), if it has one."""

from __future__ import annotations

from dataclasses import dataclass, field

from nereus.control.backend import (
    ClusterState,
    Decision,
    GenerationPolicy,
    Policy,
    RunToEnd,
    StepMetrics,
    TransitionMetrics,
)
from nereus.spec.generation import GenerationDecision, GenerationStatus
from nereus.spec.layout import Plan


@dataclass
class HeldPlan:
    """``calibrate``: the re-planner (a controller) learns from every measured step of the held plan, so
    that a policy pricing on top of it (the lever rule, ``control.intrastep.PhasedPolicy``) and the plan
    for survivors use calibrated factors."""

    plan: Plan
    replanner: Policy
    name: str = "fixed"
    generation: GenerationPolicy = field(default_factory=RunToEnd)
    log: list[Decision] = field(default_factory=list)
    calibrate: bool = False

    def during_generation(self, status: GenerationStatus) -> GenerationDecision:
        return self.generation.during_generation(status)

    def initial_plan(self, num_gpus: int) -> Plan:
        self.resume(self.plan)
        return self.plan

    def resume(self, plan: Plan) -> None:
        self.plan = plan
        if self.calibrate:
            self.replanner.resume(plan)

    def after_step(self, metrics: StepMetrics, cluster: ClusterState) -> Decision:
        if self.calibrate:
            self.replanner.observe(metrics)
        decision = Decision(metrics.step, "keep", "fixed layouts (run.layouts)")
        self.log.append(decision)
        return decision

    def transition_done(self, old: Plan, new: Plan, tm: TransitionMetrics) -> None:
        """A held plan never moves on its own; nothing to learn."""

    def survivor_plan(self, num_gpus: int, step: int) -> Plan:
        self.plan = self.replanner.survivor_plan(num_gpus, step)  # the re-planner holds it too
        return self.plan

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
    plan: Plan
    replanner: Policy
    name: str = "fixed"
    generation: GenerationPolicy = field(default_factory=RunToEnd)
    log: list[Decision] = field(default_factory=list)

    def during_generation(self, status: GenerationStatus) -> GenerationDecision:
        return self.generation.during_generation(status)

    def initial_plan(self, num_gpus: int) -> Plan:
        return self.plan

    def resume(self, plan: Plan) -> None:
        self.plan = plan

    def after_step(self, metrics: StepMetrics, cluster: ClusterState) -> Decision:
        decision = Decision(metrics.step, "keep", "fixed layouts (run.layouts)")
        self.log.append(decision)
        return decision

    def transition_done(self, old: Plan, new: Plan, tm: TransitionMetrics) -> None:
        """A held plan never moves on its own; nothing to learn."""

    def survivor_plan(self, num_gpus: int, step: int) -> Plan:
        self.plan = self.replanner.survivor_plan(num_gpus, step)
        return self.plan

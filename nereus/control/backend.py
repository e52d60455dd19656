"""What the controller exchanges with a backend (the Ray runtime or the simulator): plain values.

A backend runs steps of a plan and applies transitions; the controller (or a baseline policy) sees
only what a real job could measure.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Protocol

from nereus.spec.layout import Plan


@dataclass
class StepMetrics:
    step: int
    stage_times_s: dict[str, float]  # measured seconds per model-stage ("actor/generation", ...)
    phase_times_s: dict[str, float]  # generation, inference, training, weight_sync
    step_time_s: float
    response_mean: float
    response_max: float
    sequences: int
    tokens: float  # prompt + response tokens processed this step
    peak_bytes: float = 0.0  # memory high-water mark over devices
    gpus: int = 0  # devices the plan ran on

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TransitionMetrics:
    seconds: float
    predicted_s: float
    bytes_moved: float
    detail: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ClusterState:
    num_gpus: int  # devices available now (a plan may use them all)
    lost: int = 0  # devices lost since the previous step


class Backend(Protocol):
    def cluster(self, step: int) -> ClusterState: ...

    def run_step(self, plan: Plan, step: int) -> StepMetrics: ...

    def apply_transition(self, old: Plan, new: Plan, step: int) -> TransitionMetrics: ...


@dataclass
class Decision:
    """One decision of a policy after a step, with the numbers that justify it."""

    step: int
    action: str  # "keep" | "transition" | "forced"
    reason: str
    current_s: float = 0.0  # predicted step time of the current plan over the horizon's workload
    candidate_s: float = 0.0  # predicted step time of the best plan found
    gain_s: float = 0.0  # (current − candidate) × horizon steps
    cost_s: float = 0.0  # predicted transition time
    horizon: int = 0
    overhead_s: float = 0.0  # wall time the policy itself took for this step
    plan: Plan | None = None  # the plan to move to ("transition"/"forced")

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "plan"}
        if self.plan is not None:
            out["plan"] = self.plan.to_dict()
            out["strategy"] = self.plan.meta.get("strategy")
        return out


class Policy(Protocol):
    name: str

    def initial_plan(self, num_gpus: int) -> Plan: ...

    def after_step(self, metrics: StepMetrics, cluster: ClusterState) -> Decision: ...

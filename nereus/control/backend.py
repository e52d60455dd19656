"""What the control loop exchanges with a backend (the Ray runtime or the simulator): plain values.

A backend runs steps of a plan, applies transitions and recovers from lost devices; the policy (the
controller or a baseline) sees only what a real job could measure. ``control.loop`` drives both
backends through this protocol; neither backend is imported here.

Inside a step the backend's generation loop asks the same policy at each decision point of the
generation stage (``Policy.during_generation``, with the typed values of ``spec.generation``); what it
decided there and what came of it return with the step (``StepMetrics.generation``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Protocol

from nereus.spec.generation import Continue, GenerationDecision, GenerationEntry, GenerationStatus
from nereus.spec.layout import Plan
from nereus.spec.levers import GenerationLevers


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
    detail: dict = field(default_factory=dict)  # backend-specific measurements (the RL job's metric line)
    # the decisions taken inside the step's generation (acting or declined), with what came of each
    generation: tuple[GenerationEntry, ...] = ()
    # share of the step's trained tokens produced by the policy 0, 1, ... versions before the one trained
    # (run.policy_lag bounds its length; (1.0,): every token on-policy)
    policy_lag: tuple[float, ...] = (1.0,)
    # the plan's tail levers the step ran under (None: none, or the backend does not say)
    levers: GenerationLevers | None = None
    # the measured correlation of sibling responses' log lengths (``cost.tail.lengths.sibling_correlation``;
    # None: not measured) and the spread of all responses' log lengths (a log-normal's sigma)
    sibling_correlation: float | None = None
    length_sigma: float | None = None
    # every trained response's length, a prompt's group consecutive (empty: the backend does not say)
    response_lengths: tuple[float, ...] = ()

    def to_dict(self) -> dict:
        out = asdict(self)
        out["generation"] = [e.to_json() for e in self.generation]
        out["levers"] = self.levers.to_dict() if self.levers is not None else None
        return out


@dataclass
class TransitionMetrics:
    seconds: float
    predicted_s: float
    bytes_moved: float
    detail: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ClusterState:
    num_gpus: int  # devices available now (a plan may use them all)
    lost: int = 0  # devices lost (failed, not released by schedule) since the previous step


class WorkersLost(Exception):  # noqa: N818 -- an event the loop handles, not a programming error
    """Raised by ``Backend.run_step`` when devices died while the step ran; the loop then asks the policy
    for a plan on the survivors and the backend to recover onto it."""

    def __init__(self, step: int, lost: list[int], elapsed_s: float, reason: str = "") -> None:
        super().__init__(reason or f"lost worker(s) {lost}")
        self.step, self.lost, self.elapsed_s = step, list(lost), elapsed_s


@dataclass
class RecoveryMetrics:
    """What a recovery from lost devices did: the step to redo from, the plan in force, its cost."""

    resume_step: int
    plan: Plan
    seconds: float
    detail: dict = field(default_factory=dict)


SurvivorPlanner = Callable[[int, int], Plan]  # (devices left, step) -> the plan to continue on


class GenerationPolicy(Protocol):
    """What a backend's generation loop asks at each decision point of a step's generation stage: the
    stage's status in, a typed decision out (``spec.generation``)."""

    def during_generation(self, status: GenerationStatus) -> GenerationDecision: ...


class RunToEnd:
    """A generation policy that never looks inside the step: every generation runs to its end."""

    def during_generation(self, status: GenerationStatus) -> GenerationDecision:
        return Continue()


class Backend(Protocol):
    """A backend reports lost devices between steps through ``cluster`` (the simulator's failure traces)
    or, when they die while a step runs, by raising ``WorkersLost`` from ``run_step``; a backend that raises
    it also implements ``recover`` (the runtime). ``run_step`` asks ``policy`` at the decision points of
    the step's generation stage."""

    def cluster(self, step: int) -> ClusterState: ...

    def run_step(self, plan: Plan, step: int, policy: GenerationPolicy) -> StepMetrics: ...

    def apply_transition(self, old: Plan, new: Plan, step: int) -> TransitionMetrics: ...


class RecoveringBackend(Backend, Protocol):
    def recover(self, lost: WorkersLost, plan_for: SurvivorPlanner) -> RecoveryMetrics: ...


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
    # the calibrated model's time per model-stage for the step just measured, before this step's refit
    # (``ControllerConfig.predict_measured``): what a run reports next to the measured times
    predicted_stage_s: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name != "plan" and (f.name != "predicted_stage_s" or self.predicted_stage_s)}
        if self.plan is not None:
            out["plan"] = self.plan.to_dict()
            out["strategy"] = self.plan.strategy or None
        return out


class Policy(GenerationPolicy, Protocol):
    """Between steps: the initial plan, a decision after each step, a plan for survivors. Inside a step:
    ``during_generation`` at each decision point of the generation stage (``GenerationPolicy``)."""

    name: str

    def initial_plan(self, num_gpus: int) -> Plan: ...

    def resume(self, plan: Plan) -> None: ...  # continue from ``plan`` (a resumed run)

    def after_step(self, metrics: StepMetrics, cluster: ClusterState) -> Decision: ...

    # the move ``after_step`` chose ran: ``metrics.predicted_s`` its bandwidth-bound time, ``seconds`` its wall
    def transition_done(self, old: Plan, new: Plan, metrics: TransitionMetrics) -> None: ...

    def survivor_plan(self, num_gpus: int, step: int) -> Plan: ...  # after devices were lost mid-step

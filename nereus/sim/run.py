"""Simulate a policy over a trace: the simulator backend driven by the one control loop
(``control.loop``); the run record is what `nereus report` renders."""

from __future__ import annotations

from collections.abc import Callable

from nereus.control.backend import Decision, StepMetrics
from nereus.control.controller import ControllerConfig
from nereus.control.forecast import Schedule
from nereus.control.loop import Observer, Recovery, StepOutcome, run_policy
from nereus.control.record import RunRecord
from nereus.control.transition_cost import TransitionCoster
from nereus.cost.transition import state_bytes_per_device
from nereus.sim.backend import SimBackend, TruthConfig
from nereus.sim.baselines import make_policy
from nereus.spec.job import JobSpec
from nereus.spec.layout import Plan
from nereus.spec.trace import Trace


def restart_cost(backend: SimBackend, plan: Plan, recovery: Recovery) -> float:
    """Relaunch plus reading every device's state from storage, nodes in parallel."""
    per_gpu: dict[int, float] = {}
    for p in plan.placements:
        size = state_bytes_per_device(backend.full_job, p)
        for g in p.gpus:
            per_gpu[g] = per_gpu.get(g, 0.0) + size
    gpn = backend.full_job.cluster.gpus_per_node
    per_node: dict[int, float] = {}
    for g, b in per_gpu.items():
        per_node[g // gpn] = per_node.get(g // gpn, 0.0) + b
    return recovery.restart_s + max(per_node.values()) / recovery.storage_bytes_per_s


class _Progress(Observer):
    def __init__(self, progress: Callable[[int, StepMetrics, Decision], None]) -> None:
        self.progress = progress

    def step_done(self, outcome: StepOutcome) -> None:
        self.progress(outcome.metrics.step, outcome.metrics, outcome.decision)


def simulate(job: JobSpec, trace: Trace, policy_name: str, seed: int = 0, steps: int | None = None,
             config: ControllerConfig | None = None, truth: TruthConfig | None = None,
             initial_gpus: int | None = None, progress=None, recovery: Recovery | None = None) -> RunRecord:
    steps = steps or trace.steps
    coster = TransitionCoster()  # one cache for the policy's decisions and the backend's truth
    backend = SimBackend(job, trace, seed, truth, initial_gpus, coster)
    schedule = Schedule(trace)
    policy = make_policy(policy_name, job, schedule, steps, coster, config)
    recovery = recovery or Recovery()
    record = run_policy(policy, backend, steps, _Progress(progress) if progress else None, recovery,
                        lambda plan: restart_cost(backend, plan, recovery))
    record.job, record.trace, record.seed = job.name, trace.name, seed
    return record

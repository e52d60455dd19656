"""Simulate a policy over a trace: the simulator backend driven by the one control loop
(``control.loop``); the run record is what `nereus report` renders."""

from __future__ import annotations

from collections.abc import Callable

from nereus.control.backend import Decision, StepMetrics
from nereus.control.controller import ControllerConfig
from nereus.control.forecast import LengthSchedule
from nereus.control.loop import Observer, Recovery, StepOutcome, run_policy
from nereus.control.record import RunRecord
from nereus.control.transition_cost import TransitionCoster
from nereus.cost.transition import state_bytes_per_device
from nereus.sim.backend import SimBackend, TruthConfig
from nereus.sim.baselines import make_policy
from nereus.spec.errors import SpecError
from nereus.spec.job import JobSpec
from nereus.spec.layout import Plan
from nereus.spec.levers import check_policy_lag
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


def check_gpus_remain(trace: Trace, seed: int, initial_gpus: int, steps: int, where: str = "") -> None:
    """Refuse, before simulating, a trace whose failures (explicit and drawn from ``seed``) leave no GPU at
    some step: a plan needs at least one device, and the simulator would stop half-way. One sweep over the
    trace's events, so a trace of 10^5 drawn failures costs no more than sorting them."""
    failures = trace.with_sampled_failures(seed).failures
    events = sorted([(s, 0, n) for s, n in trace.gpus] + [(s, 1, n) for s, n in failures])
    available, lost = initial_gpus, 0
    for i, (step, kind, n) in enumerate(events):
        if step >= steps:
            break
        available, lost = (n, lost) if kind == 0 else (available, lost + n)
        if (i + 1 == len(events) or events[i + 1][0] != step) and available - lost < 1:
            drawn = f" with --seed {seed}" if trace.failure_rate[0] else ""
            raise SpecError(f"{where or trace.name}: failures", f"at step {step} the trace leaves no GPU "
                            f"({available} available, {lost} lost so far{drawn}); lower the failures or raise "
                            "the GPUs available")


class _Progress(Observer):
    def __init__(self, progress: Callable[[int, StepMetrics, Decision], None]) -> None:
        self.progress = progress

    def step_done(self, outcome: StepOutcome) -> None:
        self.progress(outcome.metrics.step, outcome.metrics, outcome.decision)


def simulate(job: JobSpec, trace: Trace, policy_name: str, seed: int = 0, steps: int | None = None,
             config: ControllerConfig | None = None, truth: TruthConfig | None = None,
             initial_gpus: int | None = None, progress=None, recovery: Recovery | None = None,
             policy_lag: int | None = None) -> RunRecord:
    return simulate_with_backend(job, trace, policy_name, seed, steps, config, truth, initial_gpus, progress,
                                 recovery, policy_lag)[0]


def run_policy_lag(job: JobSpec, trace: Trace, policy_lag: int | None = None) -> int:
    """The policy lag a simulation allows: the argument, else the job's ``run.policy_lag``, else the trace's."""
    if policy_lag is not None:
        return check_policy_lag(policy_lag, "policy_lag")
    return job.run.policy_lag if job.run is not None else trace.policy_lag


def simulate_with_backend(job: JobSpec, trace: Trace, policy_name: str, seed: int = 0, steps: int | None = None,
                          config: ControllerConfig | None = None, truth: TruthConfig | None = None,
                          initial_gpus: int | None = None, progress=None,
                          recovery: Recovery | None = None,
                          policy_lag: int | None = None) -> tuple[RunRecord, SimBackend]:
    """``simulate``, also returning the backend (its last step's generation feeds ``sim.step_timeline``)."""
    steps = steps or trace.steps
    check_gpus_remain(trace, seed, initial_gpus or job.cluster.num_gpus, steps)
    coster = TransitionCoster()  # one cache for the policy's decisions and the backend's truth
    backend = SimBackend(job, trace, seed, truth, initial_gpus, coster)
    schedule = LengthSchedule(trace)
    policy = make_policy(policy_name, job, schedule, steps, coster, config, run_policy_lag(job, trace, policy_lag))
    recovery = recovery or Recovery()
    record = run_policy(policy, backend, steps, _Progress(progress) if progress else None, recovery,
                        lambda plan: restart_cost(backend, plan, recovery))
    record.job, record.trace, record.seed = job.name, trace.name, seed
    return record, backend

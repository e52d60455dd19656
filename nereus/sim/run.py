"""Run a policy over a trace on a backend; the run record is what `nereus report` renders."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from nereus.control.backend import Backend, StepMetrics
from nereus.control.controller import ControllerConfig
from nereus.control.forecast import Schedule
from nereus.control.transition_cost import TransitionCoster
from nereus.sim.backend import SimBackend, TruthConfig
from nereus.sim.baselines import make_policy
from nereus.spec.job import JobSpec
from nereus.spec.layout import Plan
from nereus.spec.trace import Trace


@dataclass(frozen=True)
class Recovery:
    """What a GPU loss costs. ``live``: the policy moves the job onto the survivors (a forced transition)
    and loses only the step in flight. ``restart``: the job restarts from its last disk checkpoint, as
    verl and OpenRLHF do: relaunch, reload, and redo every step since that checkpoint."""

    mode: str = "live"
    checkpoint_every: int = 50  # steps between disk checkpoints
    restart_s: float = 300.0  # relaunching workers and inference engines; an assumption, set it per cluster
    storage_bytes_per_s: float = 2e9  # checkpoint read bandwidth per node (as the transition baselines)


def restart_cost(backend, plan: Plan, recovery: Recovery) -> float:
    """Relaunch plus reading every device's state from storage, nodes in parallel."""
    from nereus.cost.transition import state_bytes_per_device

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


@dataclass
class RunRecord:
    policy: str
    job: str
    trace: str
    seed: int
    steps: list[dict] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)
    plans: list[dict] = field(default_factory=list)  # the plan in force from each step on
    wall_s: float = 0.0

    def summary(self) -> dict:
        steps = self.steps
        run_s = sum(s["step_time_s"] + s["transition_s"] + s["lost_s"] for s in steps)
        trans = [s["transition_s"] for s in steps if s["transition_s"] > 0]
        tokens = sum(s["tokens"] for s in steps)
        gpu_s = sum((s["step_time_s"] + s["transition_s"]) * s["gpus"] for s in steps)
        overheads = [d["overhead_s"] for d in self.decisions]
        return {
            "policy": self.policy, "steps": len(steps),
            "mean_step_s": sum(s["step_time_s"] for s in steps) / max(1, len(steps)),
            "run_s": run_s, "transitions": len(trans), "transition_s": sum(trans),
            "transition_share": sum(trans) / run_s if run_s else 0.0,
            "tokens_per_s": tokens / run_s if run_s else 0.0,
            "tokens_per_gpu_s": tokens / gpu_s if gpu_s else 0.0,
            "failures": sum(1 for s in steps if s["lost_s"] > 0),
            "lost_s": sum(s["lost_s"] for s in steps),
            "controller_overhead_s_per_step": sum(overheads) / max(1, len(overheads)),
            "controller_overhead_share": sum(overheads) / run_s if run_s else 0.0,
            "wall_s": self.wall_s,
        }

    def to_dict(self) -> dict:
        return {"policy": self.policy, "job": self.job, "trace": self.trace, "seed": self.seed,
                "summary": self.summary(), "steps": self.steps, "decisions": self.decisions, "plans": self.plans}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()))


def _record(m: StepMetrics, plan: Plan, transition_s: float, lost_s: float) -> dict:
    return {"step": m.step, "step_time_s": m.step_time_s, "phases": m.phase_times_s, "gpus": plan.num_gpus,
            "response_mean": m.response_mean, "response_max": m.response_max, "tokens": m.tokens,
            "transition_s": transition_s, "lost_s": lost_s, "strategy": plan.meta.get("strategy", "")}


def run_policy(policy, backend: Backend, steps: int, progress=None, recovery: Recovery | None = None) -> RunRecord:
    """Drive ``policy`` on ``backend`` for ``steps`` steps. A GPU loss aborts the step in flight; what
    else it costs depends on ``recovery``."""
    recovery = recovery or Recovery()
    start = time.perf_counter()
    record = RunRecord(policy.name, "", "", 0)
    plan = policy.initial_plan(backend.cluster(0).num_gpus)
    record.plans.append({"step": 0, "plan": plan.to_dict(), "strategy": plan.meta.get("strategy")})
    since_checkpoint = 0.0
    for step in range(steps):
        m = backend.run_step(plan, step)
        nxt = backend.cluster(step + 1)
        failed = nxt.lost and nxt.num_gpus < plan.num_gpus
        lost_s = m.step_time_s if failed else 0.0
        if failed and recovery.mode == "restart":
            lost_s += restart_cost(backend, plan, recovery) + since_checkpoint
        since_checkpoint = 0.0 if (step + 1) % recovery.checkpoint_every == 0 or failed else \
            since_checkpoint + m.step_time_s
        decision = policy.after_step(m, nxt)
        transition_s = 0.0
        if decision.plan is not None and decision.plan != plan:
            tm = backend.apply_transition(plan, decision.plan, step)
            transition_s = 0.0 if failed and recovery.mode == "restart" else tm.seconds
            plan = decision.plan
            record.plans.append({"step": step + 1, "plan": plan.to_dict(), "strategy": plan.meta.get("strategy")})
        record.steps.append(_record(m, plan, transition_s, lost_s))
        if decision.action != "keep":
            record.decisions.append({**decision.to_dict(), "plan": None, "transition_s": transition_s})
        else:
            record.decisions.append({"step": decision.step, "action": "keep", "overhead_s": decision.overhead_s})
        if progress is not None:
            progress(step, m, decision)
    record.wall_s = time.perf_counter() - start
    return record


def simulate(job: JobSpec, trace: Trace, policy_name: str, seed: int = 0, steps: int | None = None,
             config: ControllerConfig | None = None, truth: TruthConfig | None = None,
             initial_gpus: int | None = None, progress=None, recovery: Recovery | None = None) -> RunRecord:
    steps = steps or trace.steps
    coster = TransitionCoster()  # one cache for the policy's decisions and the backend's truth
    backend = SimBackend(job, trace, seed, truth, initial_gpus, coster)
    schedule = Schedule(trace)
    policy = make_policy(policy_name, job, schedule, steps, coster, config)
    record = run_policy(policy, backend, steps, progress, recovery)
    record.job, record.trace, record.seed = job.name, trace.name, seed
    return record

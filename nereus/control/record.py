"""The record of a run, simulated or real: one entry per step, per decision between steps, per decision
inside a step's generation (``spec.generation.GenerationEntry``) and per plan in force.

``nereus report`` renders it whichever backend produced it; ``control.loop`` fills it. It lives in
control/ so that neither backend depends on the other for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from nereus.control.backend import Decision, StepMetrics
from nereus.spec.generation import GenerationEntry
from nereus.spec.layout import Plan


@dataclass
class RunRecord:
    policy: str
    job: str
    trace: str
    seed: int
    steps: list[dict] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)
    plans: list[dict] = field(default_factory=list)  # the plan in force from each step on
    generation_decisions: list[dict] = field(default_factory=list)  # GenerationEntry.to_json(), in order
    wall_s: float = 0.0

    def add_plan(self, step: int, plan: Plan) -> None:
        self.plans.append({"step": step, "plan": plan.to_dict(), "strategy": plan.strategy or None})

    def add_step(self, m: StepMetrics, gpus: int, strategy: str, transition_s: float, lost_s: float) -> None:
        self.steps.append({"step": m.step, "step_time_s": m.step_time_s, "phases": m.phase_times_s, "gpus": gpus,
                           "response_mean": m.response_mean, "response_max": m.response_max, "tokens": m.tokens,
                           "transition_s": transition_s, "lost_s": lost_s, "strategy": strategy,
                           "policy_lag": list(m.policy_lag)})
        if "generation" in m.detail:  # sequence-level generation (the simulator): where its time went
            self.steps[-1]["generation"] = m.detail["generation"]
        if "busy_gpu_s" in m.detail:  # the simulator: GPU-seconds the step's work held (sim.backend)
            self.steps[-1]["busy_gpu_s"] = m.detail["busy_gpu_s"]
            self.steps[-1]["busy_generation_gpu_s"] = m.detail["busy_generation_gpu_s"]
        if "tail" in m.detail:  # the simulator: the step was a tail-batching round (sim.backend)
            self.steps[-1]["tail"] = m.detail["tail"]

    def add_generation(self, entry: GenerationEntry) -> None:
        """A decision taken inside a step's generation (acting or declined) with its outcome."""
        self.generation_decisions.append(entry.to_json())

    def generation_summary(self) -> dict:
        """Decisions inside the step that acted: how many were planned, applied or refused, predicted vs
        realised gain and move cost (means over the applied ones), and the generation stage's time split
        (bulk, migration, tail, idle GPU-seconds, overlapped inference) per step."""
        acting = [GenerationEntry.from_json(d) for d in self.generation_decisions]
        acting = [e for e in acting if e.decision.acts]
        ran = [e for e in acting if e.outcome.applied]
        gen = [s["generation"] for s in self.steps if s.get("generation")]

        def mean(xs: list[float]) -> float:
            return sum(xs) / len(xs) if xs else 0.0
        return {"planned": len(acting), "moved": len(ran), "refused": sum(1 for e in acting if e.outcome.reason),
                "predicted_gain_s": mean([e.decision.gain_s for e in ran]),
                "realised_gain_s": mean([e.outcome.gain_s or 0.0 for e in ran]),
                "predicted_migration_s": mean([e.outcome.figures.get("predicted_migration_s", e.decision.cost_s)
                                               for e in ran]),
                "realised_migration_s": mean([e.outcome.cost_s or 0.0 for e in ran]),
                **{k: mean([g[k] for g in gen]) for k in ("bulk_s", "migration_s", "tail_s", "idle_gpu_s",
                                                         "overlap_s")}}

    def add_decision(self, d: Decision, transition_s: float) -> None:
        """A move in full (without the plan, which ``plans`` holds); a keep as its step and overhead."""
        if d.action == "keep":
            self.decisions.append({"step": d.step, "action": "keep", "overhead_s": d.overhead_s})
        else:
            self.decisions.append({**d.to_dict(), "plan": None, "transition_s": transition_s})

    def add_recovery(self, step: int, plan: Plan, seconds: float, reason: str) -> None:
        """Devices died mid-step: the survivors' plan is in force from ``step`` on."""
        self.add_plan(step, plan)
        self.decisions.append({"step": step, "action": "recover", "reason": reason, "plan": None,
                               "transition_s": seconds, "overhead_s": 0.0})

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
            **lag_summary(steps),
            **balanced_summary(steps, tokens),
        }

    def to_dict(self) -> dict:
        return {"policy": self.policy, "job": self.job, "trace": self.trace, "seed": self.seed,
                "summary": self.summary(), "steps": self.steps, "decisions": self.decisions, "plans": self.plans,
                "generation_decisions": self.generation_decisions}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()))


def lag_summary(steps: list[dict]) -> dict[str, float]:
    """Over the run's trained tokens: the mean policy lag, the largest, and the share at lag 0."""
    weights = [(s["tokens"], s.get("policy_lag", [1.0])) for s in steps]
    total = sum(t for t, _ in weights)
    if not total:
        return {"policy_lag_mean": 0.0, "policy_lag_max": 0, "on_policy_share": 1.0}
    mean = sum(t * sum(j * x for j, x in enumerate(lag)) for t, lag in weights) / total
    on = sum(t * lag[0] for t, lag in weights) / total
    top = max((max((j for j, x in enumerate(lag) if x > 0), default=0) for _, lag in weights), default=0)
    return {"policy_lag_mean": mean, "policy_lag_max": top, "on_policy_share": on}


def balanced_summary(steps: list[dict], tokens: float) -> dict[str, float]:
    """Where every step records the GPU-seconds its work held (the simulator), the run with that work
    spread evenly over each step's GPUs: the mean step and throughput that balancing pools and stages
    alone could reach at best (transitions and lost time kept as they were), and that mean step's
    generation and other stages (``balanced_generation_s``, ``balanced_rest_s``)."""
    if not steps or any("busy_gpu_s" not in s or "busy_generation_gpu_s" not in s for s in steps):
        return {}
    balanced = sum(s["busy_gpu_s"] / s["gpus"] for s in steps)
    generation = sum(s["busy_generation_gpu_s"] / s["gpus"] for s in steps) / len(steps)
    run_s = balanced + sum(s["transition_s"] + s["lost_s"] for s in steps)
    mean = balanced / len(steps)
    return {"balanced_step_s": mean, "balanced_tokens_per_s": tokens / run_s if run_s else 0.0,
            "balanced_generation_s": generation, "balanced_rest_s": mean - generation}

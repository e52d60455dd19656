"""Online adaptation on the real runtime (issue 8): the controller drives ``nereus run``.

With ``run.adapt`` in the job spec the planner picks the initial plan for the workers available at step 0
(on the job's ``cluster`` — the ``cpu-local`` profile, measured by ``nereus profile`` or given inline),
restricted to layouts the CPU runtime runs (``setup.runtime_layout_ok``). After every step the controller
(``nereus.control.Controller``, the one the simulator drives) observes the measured stage times, refits
the cost model's correction factors, forecasts the response-length curriculum and the availability
schedule, re-plans when something changed, and admits a transition only when its predicted gain over the
horizon beats its cost; ``RuntimeBackend`` then moves every model's weights and Adam state live
(``Runtime.transition``). Workers join as the availability schedule or ``nereus scale N`` says (the
world re-forms with them, idle until a plan uses them) and leave after the controller has moved off them.

Each step's metrics add ``nereus/plan``, ``nereus/workers``, ``nereus/transition_s`` (the transition
after that step), ``nereus/controller_s`` and, per model-stage, ``nereus/predicted_s/<stage>`` next to
the measured ``nereus/measured_s/<stage>``; decisions go to ``decisions.jsonl`` and the whole run to
``run_record.json``, which ``nereus report`` renders like a simulated run.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace

from nereus.control.backend import ClusterState, Decision, StepMetrics, TransitionMetrics
from nereus.control.controller import Controller, ControllerConfig, observed_job
from nereus.cost.hardware import Hardware
from nereus.cost.plan_cost import estimate_plan
from nereus.planner.search import Constraints
from nereus.run.setup import Placed, placed_from_plan, runtime_layout_ok
from nereus.sim.run import RunRecord
from nereus.spec.job import JobSpec
from nereus.spec.layout import Plan

# the driver's timers (verl's names) that measure each model-stage
STAGE_TIMERS = {"actor/generation": "gen", "actor/inference": "old_log_prob", "reference/inference": "ref",
                "critic/inference": "values", "reward/inference": "reward", "critic/training": "update_critic",
                "actor/training": "update_actor"}
PHASE_OF = {"generation": "generation", "inference": "inference", "training": "training"}


def survivor_plan(ctrl: Controller, workers: int, step: int) -> Plan:
    """The plan a job continues on after losing workers: the planner's best for the ``workers`` left, the
    curriculum's length at ``step``, the layouts the runtime runs and the calibration so far."""
    from nereus.planner.search import search

    job = ctrl.job_for(step, workers)
    plan = search(Hardware(job.cluster), job, ctrl.factors or None, constraints=ctrl.constraints).plan
    ctrl.plan = plan
    return plan


class CurriculumSchedule:
    """What the job announces in advance (``control.forecast.Schedule``'s interface): the curriculum's
    maximum response length and the availability schedule."""

    def __init__(self, job: JobSpec) -> None:
        self.run, self.final = job.run, job.workload.response.max

    def context_limit(self, step: int) -> int:
        return self.run.max_response_length(step, self.final)

    def gpus(self, step: int, default: int) -> int:
        return self.run.adapt.workers_at(step, default)


def controller_for(job: JobSpec) -> Controller:
    """The controller of an adaptive run; for a fixed run (no ``run.adapt``) the one that re-plans it onto
    survivors. Either plans within what the runtime runs (``CAPABILITY``: its option space and layouts)."""
    from nereus.runtime.capability import CAPABILITY

    a = job.run.adapt
    job = replace(job, options=CAPABILITY.planning_options(job.options))
    cfg = ControllerConfig() if a is None else ControllerConfig(
        horizon=a.horizon, margin=a.margin, min_gain=a.min_gain, cooldown=a.cooldown,
        replan_every=a.replan_every, fit_every=a.fit_every, calibrate=a.calibrate)
    allowed = Constraints(layout_filter=lambda ms, lay: runtime_layout_ok(job, ms.stage, lay, ms.model),
                          capability=CAPABILITY)
    return Controller(job, cfg, schedule=CurriculumSchedule(job), total_steps=job.run.steps, constraints=allowed)


def plan_text(plan: Plan) -> str:
    return "; ".join(f"{p.model_stage} {p.layout.short()} @{','.join(map(str, p.gpus))}" for p in plan.placements)


def step_metrics(step: int, metrics: dict, gpus: int) -> StepMetrics:
    """The controller's view of a step of the RL job (``control.backend.StepMetrics``)."""
    stages = {ms: metrics[f"timing_s/{t}"] for ms, t in STAGE_TIMERS.items() if metrics.get(f"timing_s/{t}", 0) > 0}
    phases = {"generation": 0.0, "inference": 0.0, "training": 0.0}
    for ms, t in stages.items():
        phases[PHASE_OF[ms.split("/")[1]]] += t
    phases["weight_sync"] = metrics.get("timing_s/sync_weights", 0.0)
    rows = metrics.get("perf/total_num_tokens", 0.0) / max(1.0, metrics["response_length/mean"]
                                                           + metrics.get("prompt_length/mean", 0.0))
    return StepMetrics(step, stages, phases, metrics["timing_s/step"], metrics["response_length/mean"],
                       metrics["response_length/max"], int(round(rows)), metrics.get("perf/total_num_tokens", 0.0),
                       gpus=gpus)


class RuntimeBackend:
    """The Ray runtime as the controller's backend (``control.backend.Backend``)."""

    def __init__(self, rl: object) -> None:
        self.rl, self.job = rl, rl.job
        self.scale_file = rl.dir / "scale.json"
        self.requested: int | None = None

    def available(self, step: int) -> int:
        """Workers available at ``step``: a ``nereus scale`` request wins over the availability schedule."""
        if self.scale_file.exists():
            try:
                self.requested = int(json.loads(self.scale_file.read_text())["workers"])
            except (ValueError, KeyError, TypeError):
                print(f"nereus: ignoring {self.scale_file}: expected {{\"workers\": N}}", file=sys.stderr)
            self.scale_file.unlink(missing_ok=True)
        default = self.job.run.adapt.workers_at(step, self.job.run.workers)
        return self.requested if self.requested is not None else default

    def cluster(self, step: int) -> ClusterState:
        n = self.available(step)
        rt = self.rl.rt
        if n > len(rt.workers):  # joining workers enter the world now; plans use them once worth it
            self.rl.say(f"  workers: {len(rt.workers)} -> {n} (joining)")
            rt.resize(n)
        return ClusterState(n, lost=max(0, len(rt.workers) - n))

    def apply_transition(self, old: Plan, new: Plan, step: int) -> TransitionMetrics:
        from nereus.elastic.schedule import schedule_graph
        from nereus.runtime.live import KeySpec

        rt, t0 = self.rl.rt, time.perf_counter()
        if new.num_gpus > len(rt.workers):
            rt.resize(new.num_gpus)
        placed = placed_from_plan(new)
        specs = [KeySpec(p.key, p.model, p.stage, self.rl.cfgs[p.model], p.layout, p.ranks) for p in placed]
        out = rt.transition(specs, self.job)
        keep = self.available(step + 1)
        if keep < len(rt.workers):
            rt.resize(keep)
        self.rl.replace_placed(placed)
        world_job = self.job.with_gpus(len(rt.workers))
        predicted = schedule_graph(out["graph"], Hardware(world_job.cluster)).makespan_s
        moved = sum(w["bytes_received"] for w in out["workers"])
        return TransitionMetrics(time.perf_counter() - t0, predicted, moved, {"executor_s": out["wall_s"]})


def _predicted(ctrl: Controller, m: StepMetrics, plan: Plan) -> dict[str, float]:
    """The calibrated model's stage times for the step's observed workload (before this step's refit)."""
    job = observed_job(ctrl.job, m, ctrl.forecaster.sigma).with_gpus(max(plan.num_gpus, 1))
    est = estimate_plan(Hardware(job.cluster), job, plan, ctrl.factors)
    return {f"nereus/predicted_s/{ms}": c.time() for ms, c in est.costs.items()}


def _decision_record(d: Decision, transition_s: float) -> dict:
    return {**d.to_dict(), "plan": d.plan.to_dict() if d.plan else None, "transition_s": transition_s}


class AdaptiveLoop:
    """Steps of an ``RLJob`` under the controller; ``RLJob.execute`` calls ``step`` once per step."""

    def __init__(self, rl: object, ctrl: Controller, plan: Plan) -> None:
        self.rl, self.ctrl, self.plan = rl, ctrl, plan
        self.backend = RuntimeBackend(rl)
        self.record = RunRecord("nereus", rl.job.name, "runtime", rl.run.seed)
        self.record.plans.append({"step": 0, "plan": plan.to_dict(), "strategy": plan.meta.get("strategy")})
        self.decisions = (rl.dir / "decisions.jsonl").open("a")
        self.t0 = time.perf_counter()
        self.lost_s = 0.0  # recovery time not yet booked to a step record

    def after_step(self, step: int, metrics: dict) -> dict:
        """Observe, decide, maybe transition; returns the metrics the step adds."""
        rt = self.rl.rt
        m = step_metrics(step, metrics, len(rt.workers))
        extra: dict = {"nereus/plan": plan_text(self.plan), "nereus/workers": float(len(rt.workers))}
        extra.update(_predicted(self.ctrl, m, self.plan))
        extra.update({f"nereus/measured_s/{k}": v for k, v in m.stage_times_s.items()})
        decision = self.ctrl.after_step(m, self.backend.cluster(step + 1))
        extra["nereus/controller_s"] = decision.overhead_s
        transition_s = 0.0
        if decision.plan is not None and decision.plan != self.plan:
            tm = self.backend.apply_transition(self.plan, decision.plan, step)
            transition_s = tm.seconds
            self.rl.say(f"\n  transition after step {step + 1} ({decision.action}: {decision.reason}): "
                        f"{tm.seconds:.2f} s measured, {tm.predicted_s:.2f} s predicted, "
                        f"{tm.bytes_moved / 2**20:.1f} MiB moved; predicted step {decision.current_s:.2f} s -> "
                        f"{decision.candidate_s:.2f} s")
            self.rl.say(f"    new plan: {plan_text(decision.plan)}")
            self.plan = decision.plan
            self.record.plans.append({"step": step + 1, "plan": self.plan.to_dict(),
                                      "strategy": self.plan.meta.get("strategy")})
        extra["nereus/transition_s"] = transition_s
        self.decisions.write(json.dumps({"step": step + 1, **_decision_record(decision, transition_s)}) + "\n")
        self.decisions.flush()
        self.record.steps.append({"step": step, "step_time_s": m.step_time_s, "phases": m.phase_times_s,
                                  "gpus": len(rt.workers), "response_mean": m.response_mean,
                                  "response_max": m.response_max, "tokens": m.tokens, "transition_s": transition_s,
                                  "lost_s": self.lost_s, "strategy": self.plan.meta.get("strategy", "")})
        self.record.decisions.append(_decision_record(decision, transition_s))
        self.lost_s = 0.0
        return extra

    def replanned(self, plan: Plan, step: int, recovery_s: float) -> None:
        """After a lost worker: the survivors' plan is in force from ``step`` on, at a cost of ``recovery_s``."""
        self.plan = plan
        self.record.plans.append({"step": step, "plan": plan.to_dict(), "strategy": plan.meta.get("strategy")})
        entry = {"step": step, "action": "recover", "reason": "lost worker(s)", "plan": plan.to_dict(),
                 "transition_s": recovery_s, "overhead_s": 0.0}
        self.decisions.write(json.dumps(entry) + "\n")
        self.decisions.flush()
        self.record.decisions.append(entry)
        self.lost_s += recovery_s

    def close(self) -> dict:
        self.decisions.close()
        self.record.wall_s = time.perf_counter() - self.t0
        self.record.save(self.rl.dir / "run_record.json")
        return self.record.summary()


def initial_placement(job: JobSpec) -> tuple[Controller, Plan, list[Placed]]:
    ctrl = controller_for(job)
    plan = ctrl.initial_plan(job.run.adapt.workers_at(0, job.run.workers))
    return ctrl, plan, placed_from_plan(plan)

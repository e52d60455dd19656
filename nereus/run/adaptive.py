"""Policies of ``nereus run`` on the runtime, and what an adaptive run adds to its metrics and logs.

With ``run.adapt`` the controller (``nereus.control.Controller``, the one the simulator drives) picks
every layout: the planner's initial plan for the workers available at step 0 on the job's ``cluster``
(the ``cpu-local`` profile, measured by ``nereus profile`` or given inline), restricted to layouts the
runtime runs. After each step the one control loop (``control.loop``) lets it observe the measured stage
times, refit the cost model's correction factors, forecast the response-length curriculum and the
availability schedule, re-plan when something changed, and admit a transition only when its predicted
gain over the horizon beats its cost; ``run.backend.RuntimeBackend`` moves the state live. Without
``run.adapt`` the job holds its hand-picked layouts (``control.held.HeldPlan``), and the controller only
re-plans onto survivors after a loss.

Each step's metrics add ``nereus/plan``, ``nereus/workers``, ``nereus/transition_s`` (the transition
after that step), ``nereus/controller_s`` and, per model-stage, ``nereus/predicted_s/<stage>`` next to
the measured ``nereus/measured_s/<stage>``; decisions go to ``decisions.jsonl`` and the whole run to
``run_record.json``, which ``nereus report`` renders like a simulated run.

Either policy answers the generation stage's decision points inside a step with ``run.rollout.midstep``'s
rule (``control.midstep.BalanceTail``), if the job has one, through the same ``Policy.during_generation``
the simulator calls.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from nereus.control.backend import Decision, GenerationPolicy, Policy, RunToEnd, TransitionMetrics
from nereus.control.controller import Controller, ControllerConfig
from nereus.control.held import HeldPlan
from nereus.control.intrastep import NoTail, PhasedPolicy
from nereus.control.loop import StepOutcome
from nereus.control.midstep import BalanceTail
from nereus.control.tail_policy import NereusLevers
from nereus.planner.search import Constraints
from nereus.run.backend import plan_text
from nereus.run.setup import Placed, place, placed_from_plan, runtime_layout_ok
from nereus.spec.job import JobSpec
from nereus.spec.layout import Layout, ModelStage, Placement, Plan


class CurriculumSchedule:
    """What the job announces in advance (``control.forecast.LengthSchedule``'s interface): the curriculum's
    maximum response length and the availability schedule."""

    def __init__(self, job: JobSpec) -> None:
        self.run, self.final = job.run, job.workload.response.max

    def context_limit(self, step: int) -> int:
        return self.run.max_response_length(step, self.final)

    def gpus(self, step: int, default: int) -> int:
        return self.run.adapt.workers_at(step, default)


def controller_for(job: JobSpec) -> Controller:
    """The controller of an adaptive run; for a fixed run (no ``run.adapt``) the one that re-plans it onto
    survivors. Either plans within what the runtime runs (``priced_as_run``: its option space and layouts, and
    whether the phases' stages run at once)."""
    from nereus.runtime.capability import priced_as_run

    a = job.run.adapt
    job, capability = priced_as_run(job)
    cfg = ControllerConfig(calibrate_with_levers=False) if a is None else ControllerConfig(
        horizon=a.horizon, margin=a.margin, min_gain=a.min_gain, cooldown=a.cooldown,
        replan_every=a.replan_every, fit_every=a.fit_every, calibrate=a.calibrate,
        predict_measured=True, calibrate_with_levers=False)

    @cache  # the same few hundred layouts come back at every re-plan: ~12 ms a search here
    def runnable(ms: ModelStage, lay: Layout) -> bool:
        return runtime_layout_ok(job, ms.stage, lay, ms.model)

    allowed = Constraints(layout_filter=runnable, capability=capability)
    return Controller(job, cfg, schedule=CurriculumSchedule(job), total_steps=job.run.steps, constraints=allowed,
                      generation=generation_rule(job))


def generation_rule(job: JobSpec) -> GenerationPolicy:
    """The rule inside the step: ``run.rollout.midstep``'s, or none (every generation runs to its end)."""
    spec = job.run.rollout_midstep
    return BalanceTail(spec) if spec is not None else RunToEnd()


def plan_of(placed: list[Placed], workers: int) -> Plan:
    """Hand-picked placements as a plan (the run record and the loop speak plans)."""
    return Plan(tuple(Placement(ModelStage(p.model, p.stage), p.layout, p.ranks) for p in placed), workers)


def policy_for(job: JobSpec) -> tuple[Policy, Plan, list[Placed]]:
    """The run's policy, its initial plan and the runtime placements of that plan. With
    ``run.rollout.levers: auto`` the policy also chooses the plan's tail levers (``lever_policy``)."""
    if job.run.adapt is None:
        placed = place(job)
        plan = plan_of(placed, job.run.workers)
        auto = job.run.rollout_levers == "auto"
        held = HeldPlan(plan, controller_for(job), generation=generation_rule(job), calibrate=auto)
        if not auto:
            return held, plan, placed
        policy = lever_policy(held)
        return policy, policy.initial_plan(job.run.workers), placed
    ctrl = controller_for(job)
    policy = lever_policy(ctrl) if job.run.rollout_levers == "auto" else ctrl
    plan = policy.initial_plan(job.run.adapt.workers_at(0, job.run.workers))
    return policy, plan, placed_from_plan(plan, job)


def lever_policy(inner: Policy) -> PhasedPolicy:
    """``inner`` (the controller, or a held plan that calibrates its re-planner) with the simulator's lever
    rule on top (``control.tail_policy``): once the first calibration fit is in, and every 10 steps after, it
    prices speculative decoding (draft length, live-batch threshold, the acceptance it has measured) and
    tail batching (over-launch, each round's inference and training at its longest response: the runtime
    pads rollouts) on the calibrated cost model and puts the fastest on the plan when its predicted gain
    beats the calibration's residual error (as the controller admits plans). Steps run with levers do
    not calibrate the model (``ControllerConfig.calibrate_with_levers``). It chooses within policy lag 0:
    partial rollout and one-step-off asynchrony stay job keys on the runtime (``run.rollout.partial_rollout``,
    ``run.async``); no tail layout (``NoTail``)."""
    return PhasedPolicy("nereus", inner, NoTail(), levers=NereusLevers(), policy_lag=0, calibrated_levers=True)


class AdaptationLog:
    """The per-step ``nereus/*`` metrics and the decision log of an adaptive run."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a")

    def step_metrics(self, o: StepOutcome, ran_on: Plan) -> dict:
        m, d = o.metrics, o.decision
        extra: dict = {"nereus/plan": plan_text(ran_on), "nereus/workers": float(m.gpus)}
        extra.update({f"nereus/predicted_s/{k}": v for k, v in d.predicted_stage_s.items()})
        extra.update({f"nereus/measured_s/{k}": v for k, v in m.stage_times_s.items()})
        extra["nereus/controller_s"] = d.overhead_s
        extra["nereus/transition_s"] = o.transition.seconds if o.transition else 0.0
        extra["nereus/transition_predicted_s"] = d.cost_s if o.transition else 0.0
        # of which the start of the rollout engines it rebuilt (EngineTraits.restarts_on_move: vLLM's)
        extra["nereus/transition_engine_s"] = o.transition.detail.get("engine_start_s", 0.0) if o.transition else 0.0
        self.write({"step": m.step + 1, **decision_entry(d, extra["nereus/transition_s"])})
        return extra

    def write(self, entry: dict) -> None:
        self.file.write(json.dumps(entry) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def engine_text(tm: TransitionMetrics, label: str) -> str:
    """The transition line's note of the rollout engines (``label``: the engine's name in prose) it
    rebuilt, if any."""
    start = tm.detail.get("engine_start_s")
    return "" if start is None else f", {label} engines rebuilt in {start:.2f} s"


def decision_entry(d: Decision, transition_s: float) -> dict:
    return {**d.to_dict(), "plan": d.plan.to_dict() if d.plan else None, "transition_s": transition_s}

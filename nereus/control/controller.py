"""The controller: observe → calibrate → re-plan → admit → transition (design: Controller).

After every step it records the measured stage times, refits the cost model's correction factors,
forecasts the workload of the coming ``horizon`` steps, and — when something changed enough to matter —
asks the planner for the best plan under that forecast. It moves only when the predicted gain over the
horizon beats the predicted transition cost by a margin and the new plan is faster per step by a
minimum fraction (hysteresis), with a cooldown between optional moves. A plan predicted infeasible
(memory) or one that uses lost GPUs is replaced whatever the cost.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from nereus.control.backend import (
    ClusterState,
    Decision,
    GenerationPolicy,
    RunToEnd,
    StepMetrics,
    TransitionMetrics,
)
from nereus.control.forecast import LengthForecaster, LengthSchedule
from nereus.control.transition_cost import TransitionCoster
from nereus.cost.calibration import Calibrator, plain_equivalent
from nereus.cost.hardware import Hardware
from nereus.cost.plan_cost import estimate_plan
from nereus.cost.transition import TransitionFit
from nereus.planner.search import Constraints, search
from nereus.spec.errors import InfeasibleError
from nereus.spec.generation import GenerationDecision, GenerationStatus
from nereus.spec.job import JobSpec, ResponseLength
from nereus.spec.layout import Plan

TransitionCost = Callable[[Hardware, JobSpec, Plan, Plan], float]


@dataclass(frozen=True)
class ControllerConfig:
    horizon: int = 50  # steps over which a transition must pay for itself
    margin: float = 0.5  # admit when gain > cost · (1 + margin)
    # hysteresis: the candidate must be faster per step by this much, or by the calibration's residual
    # relative error when that is larger (a gain smaller than the model's own error is not a gain)
    min_gain: float = 0.03
    cooldown: int = 5  # steps after a transition before the next optional one
    replan_every: int = 50  # re-plan at least this often even if nothing seems to change
    drift: float = 0.15  # re-plan when the forecast mean moved this much since the plan was chosen
    calibrate: bool = True
    fit_every: int = 5
    predict_measured: bool = False  # report the model's stage times for each measured step (Decision)
    # calibrate on steps that ran with tail levers too, each at its plain-equivalent generation time
    # (``cost.calibration.plain_equivalent``: the lever's predicted plain / lever seconds, so its gain is
    # not fitted into the factors and counted again when the lever is priced); False leaves those steps
    # out (the runtime's choice; the simulator keeps every step)
    calibrate_with_levers: bool = True
    # per-term factors taken as known instead of fitted (``cost.calibration.Calibrator.known``): a simulated
    # run's hidden truth, to measure what calibrating costs against knowing (benchmarks/calibration_headroom.py)
    known_factors: tuple[tuple[str, float], ...] = ()


def usable_gpus(available: int, gpus_per_node: int) -> int:
    """Whole nodes (or part of the one node of a small cluster) a plan can use."""
    return available if available < gpus_per_node else available // gpus_per_node * gpus_per_node


# Under dynamic sampling (DAPO, arXiv:2503.14476) a step draws generation batches until it keeps its groups:
# verl's metric of how many, and the steps whose mean the forecast keeps (the keep-rate falls as the policy
# learns, so recent steps only)
GEN_BATCHES = "train/num_gen_batches"
KEEP_RATE_WINDOW = 10


def with_generation_batches(job: JobSpec, batches: float | None) -> JobSpec:
    """``job`` priced for ``batches`` generation batches a step (``workload.filter_keep_rate`` = 1 / batches,
    ``cost.stages.generation_batches``); unchanged without a measurement."""
    if not batches:
        return job
    return replace(job, workload=replace(job.workload, filter_keep_rate=min(1.0, 1.0 / batches)))


def observed_job(job: JobSpec, m: StepMetrics, sigma: float) -> JobSpec:
    """``job`` as step ``m`` ran it: its response lengths and, under dynamic sampling, its generation batches."""
    longest = max(1, math.ceil(m.response_max))
    job = job.with_response(ResponseLength(min(m.response_mean, longest), longest, "lognormal", sigma))
    return with_generation_batches(job, m.detail.get(GEN_BATCHES))


class Controller:
    name = "nereus"

    def __init__(self, job: JobSpec, config: ControllerConfig | None = None, schedule: LengthSchedule | None = None,
                 total_steps: int | None = None, transition_cost: TransitionCost | None = None,
                 constraints: Constraints | None = None, generation: GenerationPolicy | None = None) -> None:
        self.job, self.config = job, config or ControllerConfig()
        self.generation = generation or RunToEnd()  # the rule inside the step (``control.midstep``)
        self.schedule = schedule or LengthSchedule(default_max=job.workload.response.max)
        self.total_steps = total_steps
        self.constraints = constraints
        self.hw = Hardware(job.cluster)
        self.transition_cost = transition_cost or TransitionCoster(prior=TransitionFit.prior(self.hw))
        self.calibrator = Calibrator(self.hw, known=dict(self.config.known_factors))
        sigma = job.workload.response.sigma if job.workload.response else 0.6
        self.forecaster = LengthForecaster(sigma=sigma)
        self.gen_batches: list[float] = []  # the latest steps' generation batches (dynamic sampling)
        self.plan: Plan | None = None
        self.factors: dict[str, float] = {}
        self.residual = 0.0  # mean absolute relative error of the calibrated model on the measured rows
        self._basis: tuple[float, int, int, dict] = (0.0, 0, 0, {})  # mean, limit, gpus, factors of the plan
        self._last_move = -10**9
        self._last_plan_step = 0
        self.log: list[Decision] = []

    # -- planning -----------------------------------------------------------------------------------
    def job_for(self, step: int, gpus: int) -> JobSpec:
        """The job as forecast for ``step`` on ``gpus`` devices."""
        limit = self.schedule.context_limit(step)
        response = self.forecaster.response_at(step, limit) or replace(self.job.workload.response, max=limit)
        if response.mean > limit:
            response = replace(response, mean=float(limit))
        batches = sum(self.gen_batches) / len(self.gen_batches) if self.gen_batches else None
        job = with_generation_batches(self.job.with_response(response), batches)
        return job.with_gpus(usable_gpus(gpus, self.job.cluster.gpus_per_node))

    def initial_plan(self, num_gpus: int) -> Plan:
        job = self.job_for(0, num_gpus)
        self.plan = search(Hardware(job.cluster), job, None, constraints=self.constraints).plan
        self._basis = (job.workload.response.mean, job.workload.response.max, job.cluster.num_gpus, {})
        return self.plan

    def resume(self, plan: Plan) -> None:
        """Continue a resumed run from the plan its checkpoint was written under."""
        self.plan = plan

    def survivor_plan(self, num_gpus: int, step: int) -> Plan:
        """The plan to continue on after devices died mid-step: the planner's best for the ``num_gpus``
        left, the forecast workload at ``step`` and the calibration so far. Forced: no admission test."""
        job = self.job_for(step, num_gpus)
        self.plan = search(Hardware(job.cluster), job, self.factors or None, constraints=self.constraints).plan
        return self.plan

    # -- the loop -----------------------------------------------------------------------------------
    def during_generation(self, status: GenerationStatus) -> GenerationDecision:
        """Inside the step: the controller's generation rule (none: the stage runs to its end)."""
        return self.generation.during_generation(status)

    def after_step(self, m: StepMetrics, cluster: ClusterState) -> Decision:
        start = time.perf_counter()
        predicted = self.predict_measured(m) if self.config.predict_measured else {}
        decision = self._decide(m, cluster)
        decision.predicted_stage_s = predicted
        decision.overhead_s = time.perf_counter() - start
        self.log.append(decision)
        if decision.plan is not None:
            self.plan = decision.plan
        return decision

    def adopt(self, plan: Plan, constraints: Constraints | None, step: int, decision: Decision) -> None:
        """Move to ``plan``, chosen by a rule above this controller (``control.pools``'s re-check), in place of
        this step's decision (``keep``), and plan under ``constraints`` from then on; the move starts the
        cooldown as the controller's own do."""
        self.plan, self.constraints, self._last_move = plan, constraints, step
        if self.log and self.log[-1].step == decision.step:
            self.log[-1] = decision

    def transition_done(self, old: Plan, new: Plan, tm: TransitionMetrics) -> None:
        """Calibrate the fixed part of transitions on the one that ran (``cost.transition.TransitionFit``);
        a user-supplied transition cost is left as it is, and so is every price without calibration
        (``calibrate: false`` decides on the priors alone, the same on an idle and on a loaded machine)."""
        if self.config.calibrate and isinstance(self.transition_cost, TransitionCoster):
            self.transition_cost.observe(self.job, old, new, tm.predicted_s, tm.seconds)

    def predict_measured(self, m: StepMetrics) -> dict[str, float]:
        """The calibrated model's stage times for the step's observed workload on the current plan."""
        job = observed_job(self.job, m, self.forecaster.sigma).with_gpus(max(self.plan.num_gpus, 1))
        est = estimate_plan(Hardware(job.cluster), job, self.plan, self.factors)
        return {str(ms): est.stage_times[str(ms)] for ms in est.costs}

    def observe(self, m: StepMetrics) -> None:
        """Learn from a measured step without deciding anything: the length forecast and, unless the step
        ran with levers the configuration leaves out, the calibration."""
        self._observe(m)

    def _observe(self, m: StepMetrics) -> None:
        self.forecaster.observe(m.step, m.response_mean)
        if m.detail.get(GEN_BATCHES):
            self.gen_batches = [*self.gen_batches, float(m.detail[GEN_BATCHES])][-KEEP_RATE_WINDOW:]
        if not self.config.calibrate or (m.levers is not None and not self.config.calibrate_with_levers):
            return
        measured = plain_equivalent({k: v for k, v in m.stage_times_s.items() if v > 0}, m.levers)
        if m.phase_times_s.get("weight_sync", 0) > 0:
            measured["weight_sync"] = m.phase_times_s["weight_sync"]
        job = observed_job(self.job, m, self.forecaster.sigma).with_gpus(
            usable_gpus(max(self.plan.num_gpus, 1), self.job.cluster.gpus_per_node))
        self.calibrator.observe(job, self.plan, measured)
        if (m.step + 1) % self.config.fit_every == 0:
            self.factors = self.calibrator.fit()
            errors = self.calibrator.relative_errors()
            self.residual = sum(abs(e) for e in errors) / len(errors) if errors else 0.0

    def _decide(self, m: StepMetrics, cluster: ClusterState) -> Decision:
        assert self.plan is not None, "initial_plan() first"
        self._observe(m)
        cfg, step = self.config, m.step + 1
        horizon = cfg.horizon if self.total_steps is None else max(0, min(cfg.horizon, self.total_steps - step))
        gpus = usable_gpus(cluster.num_gpus, self.job.cluster.gpus_per_node)
        job = self.job_for(step + horizon // 2, max(gpus, self.plan.num_gpus))
        lost = self.plan.num_gpus > gpus
        current = None if lost else estimate_plan(Hardware(job.cluster), job, self.plan, self.factors)
        forced = lost or not current.feasible
        if not (forced or self._should_replan(job, step, gpus)):
            return Decision(m.step, "keep", "nothing changed enough to re-plan",
                            current_s=current.step_time_s, horizon=horizon)
        self._last_plan_step = step
        target = self.job_for(step + horizon // 2, gpus)
        try:
            result = search(Hardware(target.cluster), target, self.factors, constraints=self.constraints)
        except InfeasibleError as err:
            reason = f"no feasible plan on {gpus} GPUs: {err}"
            return Decision(m.step, "keep", reason, current_s=current.step_time_s if current else math.inf,
                            horizon=horizon)
        cand = result.plan
        self._basis = (target.workload.response.mean, target.workload.response.max, gpus, dict(self.factors))
        cur_s = math.inf if current is None else current.step_time_s
        if forced:
            why = "the plan uses lost GPUs" if lost else f"the plan is predicted infeasible: {current.violations[0]}"
            self._last_move = step
            cost = self.transition_cost(self.hw, target, self.plan, cand)
            return Decision(m.step, "forced", why, cur_s, result.estimate.step_time_s, math.inf, cost, horizon,
                            plan=cand)
        return self._admit(m.step, horizon, cur_s, result.estimate.step_time_s, cand, target)

    def _admit(self, step: int, horizon: int, cur_s: float, cand_s: float, cand: Plan, job: JobSpec) -> Decision:
        """Cheap tests first; the transition graph is built only for a candidate that passes them."""
        cfg = self.config
        gain = (cur_s - cand_s) * horizon
        quick = getattr(self.transition_cost, "quick", self.transition_cost)(self.hw, job, self.plan, cand) \
            if cand != self.plan else 0.0
        numbers = dict(current_s=cur_s, candidate_s=cand_s, gain_s=gain, cost_s=quick, horizon=horizon)
        if cand == self.plan:
            return Decision(step, "keep", "the current plan is still the best", **numbers)
        if cfg.calibrate and not self.factors:
            return Decision(step, "keep", "no calibration fit yet: optional moves wait for the first fit", **numbers)
        threshold = max(cfg.min_gain, self.residual)
        if cand_s > cur_s * (1 - threshold):
            why = "min_gain" if threshold == cfg.min_gain else "the calibration's residual error"
            return Decision(step, "keep", f"candidate faster by under {threshold:.0%} per step ({why})", **numbers)
        if step + 1 - self._last_move < cfg.cooldown:
            return Decision(step, "keep", f"cooldown: last transition {step + 1 - self._last_move} steps ago",
                            **numbers)
        if gain <= quick * (1 + cfg.margin):
            return Decision(step, "keep", f"gain over {horizon} steps does not beat the estimated transition "
                                          f"cost by {cfg.margin:.0%}", **numbers)
        numbers["cost_s"] = cost = self.transition_cost(self.hw, job, self.plan, cand)
        if gain <= cost * (1 + cfg.margin):
            return Decision(step, "keep", f"gain over {horizon} steps does not beat the scheduled transition "
                                          f"cost by {cfg.margin:.0%}", **numbers)
        self._last_move = step + 1
        return Decision(step, "transition", "predicted gain beats the transition cost", **numbers, plan=cand)

    def _should_replan(self, job: JobSpec, step: int, gpus: int) -> bool:
        mean, limit, basis_gpus, factors = self._basis
        resp = job.workload.response
        if gpus != basis_gpus or resp.max != limit or step - self._last_plan_step >= self.config.replan_every:
            return True
        if abs(resp.mean / max(mean, 1.0) - 1) > self.config.drift:
            return True
        # relative change of each factor since the plan was chosen; the change of a factor NNLS had fitted
        # to 0 then is scaled by the prior 1 (a factor that stays at 0 has not changed)
        return any(abs(v - before) > self.config.drift * (abs(before) or 1.0)
                   for k, v in self.factors.items() for before in [factors.get(k, 1.0)])

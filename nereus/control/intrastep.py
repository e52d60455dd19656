"""Decisions inside the step: when to switch a generation stage to its tail layout, and to which.

``PhasedPolicy`` wraps a between-step policy (the controller, or a static baseline) unchanged: after each of
its decisions it sets the phases of the next step's generation stage on the plan in force
(``Plan.generation``, a ``spec.generation.TailPhase``), and inside the step it answers the backend's
decision points from them: at the start, look again once at most ``trigger_live`` sequences are still
generating; there, ``ChangeTailLayout``. How it picks the phases is a ``TailRule``, on the generation
stage's pricing (``cost.generation``):

- ``NereusTail``: from the calibrated cost model, on the forecast's length quantiles — every tail TP (the
  bulk TP and its multiples within a node) × replicas (powers of two) × trigger (live sequences), the
  predicted step with the tail's freed GPUs running inference; admitted only when the predicted gain over
  the remaining tail beats the move's predicted cost by ``margin``. The move's transfer cost is calibrated
  on the moves it has measured (median of realised ÷ modelled), like the controller's per-term factors.
- ``PatTail``: PAT's rule (arXiv 2605.23945): once the batch has drained (no more live sequences than
  bulk replicas), switch the stage's GPUs to the widest TP in a node, migrating or recomputing each
  sequence's KV caches, whichever is cheaper; no overlap; no cost test.
- ``RlhfuseTail``: RLHFuse's rule (arXiv 2409.13221): once at most 5% of the samples are left, pack them onto
  as few instances of the same TP as hold them and start the inference stages on the GPUs freed.
"""

from __future__ import annotations

import statistics
from abc import ABC, abstractmethod
from dataclasses import asdict, replace

from nereus.control.backend import ClusterState, Decision, Policy, StepMetrics, TransitionMetrics
from nereus.control.controller import usable_gpus
from nereus.control.held import HeldPlan
from nereus.control.pools import (
    MEASURE_STEPS,
    STALENESS,
    PoolMove,
    PoolRule,
    pools_of,
    rollout_tp,
    runs_apart,
    tokens_per_s,
)
from nereus.control.tail_policy import LeverRule, generation_forecast, padded_rest, powers_of_two, speculation_decision
from nereus.cost.generation import Prediction, no_move, predict
from nereus.spec.generation import (
    ChangeTailLayout,
    Continue,
    GenerationDecision,
    GenerationStatus,
    NextLook,
    TailPhase,
)
from nereus.spec.job import JobSpec
from nereus.spec.layout import Plan
from nereus.spec.levers import GenerationLevers
from nereus.spec.parallel_dims import tp_splits


class TailRule(ABC):
    """Chooses the next step's generation phases; ``observe`` sees each measured step."""

    name = "none"

    @abstractmethod
    def choose(self, job: JobSpec, plan: Plan, factors: dict[str, float]) -> TailPhase | None:
        """The phases of the next step's generation stage, or None to run it in one layout."""

    def observe(self, m: StepMetrics) -> None:  # noqa: B027 - a rule that learns nothing keeps this default
        """Default: learn nothing from measurements."""


def _tail_tps(job: JobSpec, bulk_tp: int) -> list[int]:
    arch, gpn = job.models["actor"], job.cluster.gpus_per_node
    tps, t = [], bulk_tp
    while t <= gpn:
        if tp_splits(arch, t):
            tps.append(t)
        t *= 2
    return tps


class NereusTail(TailRule):
    name = "nereus"

    def __init__(self, margin: float = 0.5, min_gain: float = 0.01, wait_for_fit: bool = True) -> None:
        self.margin, self.min_gain = margin, min_gain
        # as the controller's optional moves: none before the first calibration fit
        self.wait_for_fit = wait_for_fit
        self.ratios: list[float] = []  # realised ÷ modelled migration transfer time, per measured move

    @property
    def transfer(self) -> float:
        return statistics.median(self.ratios[-10:]) if self.ratios else 1.0

    def observe(self, m: StepMetrics) -> None:
        for e in m.generation:
            modelled = e.outcome.figures.get("migration_modelled_s", 0.0)
            if isinstance(e.decision, ChangeTailLayout) and e.outcome.applied and modelled > 0:
                self.ratios.append(e.outcome.cost_s / modelled)

    def choose(self, job: JobSpec, plan: Plan, factors: dict[str, float]) -> TailPhase | None:
        if self.wait_for_fit and not factors:
            return None
        model, bulk, f, inference_s = generation_forecast(job, plan, factors, self.transfer)
        lay, n = model.placement.layout, len(bulk.lengths)
        base = no_move(model, bulk)
        gpus = len(model.placement.gpus)
        tried: list[tuple[float, TailPhase, Prediction]] = []

        def trial(k: int, tp: int, replicas: int) -> None:
            pred = predict(model, bulk, TailPhase(k, tp, replicas, overlap=True, policy=self.name), f,
                           inference_s, base)
            if pred.outcome.moved:
                tried.append((pred.phased_s, TailPhase(k, tp, replicas, True, policy=self.name), pred))

        # coarse: every tail layout at one trigger; fine: the two best layouts at every trigger
        shapes = [(tp, r) for tp in _tail_tps(job, lay.tp) for r in powers_of_two(gpus // tp)]
        for tp, r in shapes:
            trial(max(r, n // 16), tp, r)
        for _, ph, _ in sorted(tried, key=lambda x: x[0])[:2]:
            for k in sorted({max(ph.tail_replicas, n // d) for d in (128, 64, 32, 8, 4)}):
                trial(k, ph.tail_tp, ph.tail_replicas)
        if not tried:
            return None
        _, phase, pred = min(tried, key=lambda x: x[0])
        gross = pred.gain_s + pred.migration_s  # what the tail layout saves before paying for the move
        if gross <= pred.migration_s * (1 + self.margin) or pred.gain_s <= self.min_gain * pred.base_s:
            return None
        return TailPhase(phase.trigger_live, phase.tail_tp, phase.tail_replicas, True, "cheaper", self.name,
                         {**pred.to_dict(), "transfer_factor": self.transfer, "factors": asdict(f)})


class PatTail(TailRule):
    name = "pat-like"

    def choose(self, job: JobSpec, plan: Plan, factors: dict[str, float]) -> TailPhase | None:
        model, bulk, f, inference_s = generation_forecast(job, plan, {})
        lay = model.placement.layout
        tp = _tail_tps(job, lay.tp)[-1] if _tail_tps(job, lay.tp) else lay.tp
        if tp == lay.tp:
            return None  # already at the widest TP: nothing to switch
        phase = TailPhase(max(1, lay.dp), tp, len(model.placement.gpus) // tp, False, "cheaper", self.name)
        pred = predict(model, bulk, phase, f, inference_s)
        return TailPhase(phase.trigger_live, tp, phase.tail_replicas, False, "cheaper", self.name, pred.to_dict())


class NoTail(TailRule):
    """No tail layout: the stage runs in its bulk layout (a baseline whose only inside-the-step lever is
    another one)."""

    def choose(self, job: JobSpec, plan: Plan, factors: dict[str, float]) -> TailPhase | None:
        return None


class RlhfuseTail(TailRule):
    name = "rlhfuse-like"
    share = 0.05  # samples left when the tail migrates (an assumption: RLHFuse tunes its threshold per job)

    def choose(self, job: JobSpec, plan: Plan, factors: dict[str, float]) -> TailPhase | None:
        model, bulk, f, inference_s = generation_forecast(job, plan, {})
        lay = model.placement.layout
        k = max(1, int(self.share * len(bulk.lengths)))
        replicas = min(lay.dp, max(1, -(-k // model.tail_slots(lay.tp)) if model.tail_slots(lay.tp) else lay.dp))
        if replicas >= lay.dp:
            return None
        phase = TailPhase(k, lay.tp, replicas, True, "cheaper", self.name)
        pred = predict(model, bulk, phase, f, inference_s)
        return TailPhase(k, lay.tp, replicas, True, "cheaper", self.name, pred.to_dict())


class PhasedPolicy:
    """A between-step policy whose generation stages switch to a tail layout inside the step, or use the
    levers ``levers`` picks (``control.tail_policy``): whichever predicts the larger gain, within
    ``policy_lag``. With ``pools`` it also chooses at the start, every ``PoolRule.every`` steps on the
    calibrated model and whenever the GPU count changes the rollout's tensor parallelism priced with the
    levers and, at a policy lag of one step or more, whether the rollout runs one-step-off on GPUs of its
    own (``control.pools``); the inner policy then adapts the layouts under that choice, and every plan
    whose rollout holds GPUs apart runs one-step-off."""

    def __init__(self, name: str, inner: Policy, rule: TailRule, every: int = 10, levers: LeverRule | None = None,
                 policy_lag: int = 0, pools: PoolRule | None = None, calibrated_levers: bool = False) -> None:
        self.name, self.inner, self.rule, self.every = name, inner, rule, every
        self.levers, self.policy_lag = levers, policy_lag
        # levers on the calibrated model only (a backend whose priors are far off): none before the
        # controller's first fit, and one only when its predicted gain beats the calibration's residual
        # error, as the controller admits a plan (a gain smaller than the model's own error is not a gain)
        self.calibrated_levers = calibrated_levers
        self.pools = pools
        self._colocated = self.controller.constraints if self.pools else None  # the inner policy's own
        self._levers: GenerationLevers | None = None
        self._last: tuple[int, Plan | None] = (-10**9, None)
        self._phase: TailPhase | None = None
        self._base: Plan | None = None  # the inner policy's plan object (a new one: re-choose the phases)
        self._fitted = False  # whether the controller had a calibration fit at the last choice
        self._recent: list[tuple[float, float]] = []  # the last steps' (tokens, seconds), a pool move's yardstick
        self._move: PoolMove | None = None  # a pool move on trial
        self._undone: dict[tuple[int | None, int], int] = {}  # pools whose move was undone -> the step it was

    @property
    def controller(self):
        """The object holding the forecast and the calibration: a held plan's re-planner, the controller a
        baseline wraps, or the inner policy itself."""
        if isinstance(self.inner, HeldPlan):
            return self.inner.replanner
        return getattr(self.inner, "inner", self.inner)

    @property
    def log(self) -> list[Decision]:
        return self.inner.log

    def _phased(self, base: Plan, step: int) -> Plan:
        """``base`` with the phases of step ``step``'s generation, chosen anew every ``every`` steps, on a
        new plan and when the controller's first calibration fit arrives."""
        self._base = base
        last_step, last_plan = self._last
        ctrl = self.controller
        fitted = bool(ctrl.factors)
        if last_plan is not base or step - last_step >= self.every or fitted != self._fitted:
            self._fitted = fitted
            job = ctrl.job_for(step, base.num_gpus)
            self._phase = self.rule.choose(job, base, ctrl.factors)
            self._levers = self._choose_levers(job, base, ctrl.factors)
            self._last = (step, base)
        if self._levers is not None:
            return replace(base, generation=None, levers=self._levers)
        return replace(base, generation=self._phase, levers=None)

    def _choose_levers(self, job: JobSpec, base: Plan, factors: dict[str, float]) -> GenerationLevers | None:
        """The lever rule's choice when it predicts more than the tail layout's gain (None: the tail layout);
        on a plan whose rollout runs apart under ``pools``, one-step-off with the levers of one step less of
        lag."""
        if self.pools is not None and self.policy_lag >= STALENESS and runs_apart(base):
            return self._async_levers(job, base, factors)
        if self.levers is None or (self.calibrated_levers and not factors):
            return None
        model, bulk, f, _ = generation_forecast(job, base, factors)
        cap = getattr(self.controller.constraints, "capability", None)  # the simulator's backend has none
        rest = padded_rest(job, base, factors) if cap is not None and cap.padded_rollouts else None
        choice = self.levers.choose(model, bulk, f, self.policy_lag, rest)
        if choice is not None and self.calibrated_levers:
            lv, residual = choice.levers, getattr(self.controller, "residual", 0.0)
            if choice.gain_s <= residual * lv.predicted.get("base_s", 0.0):  # declined: its numbers kept
                return GenerationLevers(policy=lv.policy, predicted={**lv.predicted, "residual": residual})
        if choice is None or self._phase is None:
            return None if choice is None else choice.levers
        return choice.levers if choice.gain_s > self._phase.predicted.get("gain_s", 0.0) else None

    def _async_levers(self, job: JobSpec, base: Plan, factors: dict[str, float]) -> GenerationLevers:
        self._phase = None  # the rollout's pool holds no inference a tail layout could start early
        return self.pools.price(job, factors, self.levers, self.policy_lag, base).levers

    def _choose_pools(self, step: int, num_gpus: int, colocated: Plan | None = None) -> Plan:
        """The pool split for ``num_gpus`` (``control.pools``; ``colocated``: the inner policy's plan for it,
        when it has one), priced on the calibrated model (the priors before its first fit): the inner
        policy plans under the choice's constraints from now on; returns the choice's plan."""
        ctrl = self.controller
        job = ctrl.job_for(step, num_gpus)
        self._recent, self._move, self._undone = [], None, {}  # steps on other GPUs measure nothing here
        choice = self.pools.choose(job, ctrl.factors, self.levers, self.policy_lag, self._colocated, colocated)
        ctrl.constraints = choice.constraints
        return choice.plan

    def initial_plan(self, num_gpus: int) -> Plan:
        base = self.inner.initial_plan(num_gpus)
        if self.pools is not None:
            base = self._choose_pools(0, num_gpus, base)
            self.inner.resume(base)
        return self._phased(base, 0)

    def resume(self, plan: Plan) -> None:
        self.inner.resume(plan)
        self._base = plan

    def survivor_plan(self, num_gpus: int, step: int) -> Plan:
        if self.pools is not None:
            self._choose_pools(step, num_gpus)
        return self._phased(self.inner.survivor_plan(num_gpus, step), step)

    def after_step(self, m: StepMetrics, cluster: ClusterState) -> Decision:
        self.rule.observe(m)
        if self.levers is not None:
            self.levers.observe(m)
        if self.pools is not None:  # the split is chosen again when the GPU count changes
            self._recent = [*self._recent[1 - MEASURE_STEPS:], (m.tokens, m.step_time_s)]
            ctrl = self.controller
            gpus = usable_gpus(cluster.num_gpus, ctrl.job.cluster.gpus_per_node)
            if gpus != ctrl.plan.num_gpus:
                self._choose_pools(m.step + 1, gpus)
        d = self.inner.after_step(m, cluster)
        if self.pools is not None and d.plan is None:  # the controller kept its plan: a pool move's turn
            d = self._judge_pool_move(m, d)
            if d.plan is None:
                d = self._recheck_pools(m, d)
        base = d.plan if d.plan is not None and d.plan != self._base else self._base
        return replace(d, plan=self._phased(base, m.step + 1))

    def _recheck_pools(self, m: StepMetrics, kept: Decision) -> Decision:
        """Every ``PoolRule.every`` steps once the controller has a fit, the pools chosen again on the
        calibrated model (``PoolRule.recheck``); a move there is admitted as the controller admits a plan
        (its gain over the horizon beats the transition's cost by the margin) and the controller plans
        under the new pools from then on. Else ``kept``, the controller's own decision."""
        ctrl, step = self.controller, m.step + 1
        if not ctrl.factors or step % self.pools.every or self._move is not None or len(self._recent) < MEASURE_STEPS:
            return kept
        horizon = ctrl.config.horizon
        job = ctrl.job_for(step + horizon // 2, ctrl.plan.num_gpus)
        found = self.pools.recheck(job, ctrl.factors, self.levers, self.policy_lag, self._colocated, ctrl.plan,
                                   ctrl.residual)
        if found is None:
            return kept
        current, choice = found
        pools = pools_of(choice)
        undone = self._undone.get(pools)
        if undone is not None and step - undone < 4 * self.pools.every:  # measured slower lately
            return kept
        gain, cost = (current.step_s - choice.step_s) * horizon, ctrl.transition_cost(ctrl.hw, job, ctrl.plan,
                                                                                       choice.plan)
        if gain <= cost * (1 + ctrl.config.margin):
            return kept
        self._move = PoolMove(step, tokens_per_s(self._recent), ctrl.plan, ctrl.constraints, pools)
        where = "colocated" if choice.gen_gpus is None else f"the rollout apart on {choice.gen_gpus} GPUs"
        d = Decision(m.step, "transition", f"pools on the calibrated model: {where}, rollout TP "
                                           f"{rollout_tp(choice.plan)}", current.step_s, choice.step_s,
                     gain, cost, horizon, overhead_s=kept.overhead_s, plan=choice.plan)
        ctrl.adopt(choice.plan, choice.constraints, step, d)
        return d

    def _judge_pool_move(self, m: StepMetrics, kept: Decision) -> Decision:
        """A pool move's verdict once ``MEASURE_STEPS`` steps ran on it (``control.pools.PoolMove``): kept, or
        undone back to the plan it left when it measured fewer tokens per second than the steps before it
        by ``PoolRule.switch_gain``; its pools are then not tried again for four re-checks."""
        move, ctrl = self._move, self.controller
        if move is None or m.step + 1 < move.step + MEASURE_STEPS:
            return kept
        self._move = None
        after = tokens_per_s(self._recent)
        if after >= move.before_tokens_per_s * (1 - self.pools.switch_gain):
            return kept
        self._undone[move.pools] = m.step + 1
        job = ctrl.job_for(m.step + 1, ctrl.plan.num_gpus)
        cost = ctrl.transition_cost(ctrl.hw, job, ctrl.plan, move.old_plan)
        d = Decision(m.step, "transition", f"pool move undone: {after:.0f} tokens/s measured on it against "
                                           f"{move.before_tokens_per_s:.0f} before it", cost_s=cost,
                     overhead_s=kept.overhead_s, plan=move.old_plan)
        ctrl.adopt(move.old_plan, move.old_constraints, m.step + 1, d)
        return d

    def transition_done(self, old: Plan, new: Plan, tm: TransitionMetrics) -> None:
        self.inner.transition_done(old, new, tm)

    def during_generation(self, status: GenerationStatus) -> GenerationDecision:
        """From the plan's levers (speculation on at the start) or phases (look again at their trigger,
        switch there)."""
        if status.point == "start" and (spec := speculation_decision(status.levers)) is not None:
            return spec
        phase = status.phases
        if phase is None:
            return Continue()
        if status.point == "start":
            return Continue(look=NextLook(live_at_most=phase.trigger_live))
        return ChangeTailLayout(phase=phase, gain_s=phase.predicted.get("gain_s", 0.0),
                                cost_s=phase.predicted.get("migration_s", 0.0),
                                reason=f"{phase.policy or self.name}: at most {phase.trigger_live} sequences left")

"""Decisions inside the step: when to switch a generation stage to its tail layout, and to which.

``PhasedPolicy`` wraps a between-step policy (the controller, or a static baseline) unchanged: after each of
its decisions it sets the phases of the next step's generation stage on the plan in force
(``Plan.meta["generation_phases"]``, a ``control.phased.TailPhase``). How it picks them is a ``TailRule``:

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
from dataclasses import asdict, dataclass

import numpy as np

from nereus.control.backend import ClusterState, Decision, StepMetrics
from nereus.control.phased import (
    Factors,
    GenModel,
    GenOutcome,
    TailPhase,
    no_move,
    overlapped_inference,
    run_bulk,
    with_tail,
)
from nereus.cost.hardware import Hardware
from nereus.cost.plan_cost import estimate_plan
from nereus.spec.job import JobSpec, ResponseLength
from nereus.spec.layout import Plan


def forecast_lengths(resp: ResponseLength, n: int) -> np.ndarray:
    """``n`` response lengths standing for the forecast: equally weighted quantiles, the largest set to the
    expected longest of ``n`` draws, in a fixed shuffled order (sequence i runs on replica i mod dp)."""
    q = np.array(resp.quantiles(64), float)
    lengths = np.interp(np.linspace(0, len(q) - 1, n), np.arange(len(q)), q)
    lengths[-1] = max(lengths[-1], float(resp.longest(n)))
    return np.maximum(1.0, lengths[np.random.default_rng(0).permutation(n)])


def inference_gpus(plan: Plan) -> frozenset[int]:
    return frozenset(g for p in plan.placements if p.model_stage.stage == "inference" for g in p.gpus)


@dataclass
class Prediction:
    """The model's view of one step's generation and inference, with and without the move."""

    base_s: float  # generation + inference without a move
    phased_s: float  # with it (inference overlapped on the freed GPUs)
    migration_s: float
    outcome: GenOutcome

    @property
    def gain_s(self) -> float:
        return self.base_s - self.phased_s

    def to_dict(self) -> dict:
        return {"base_s": self.base_s, "phased_s": self.phased_s, "gain_s": self.gain_s,
                "migration_s": self.migration_s}


def predict(model: GenModel, bulk, phase: TailPhase, f: Factors, inference_s: float,
            base: GenOutcome | None = None) -> Prediction:
    base = base or no_move(model, bulk)
    out = with_tail(model, bulk, phase, f, inference_gpus(model.plan))
    after, _ = overlapped_inference(inference_s, out, len(bulk.lengths))
    return Prediction(base.generation_s + inference_s, out.generation_s + after, out.migration_s, out)


class TailRule(ABC):
    """Chooses the next step's generation phases; ``observe`` sees each measured step."""

    name = "none"

    @abstractmethod
    def choose(self, job: JobSpec, plan: Plan, factors: dict[str, float]) -> TailPhase | None:
        """The phases of the next step's generation stage, or None to run it in one layout."""

    def observe(self, m: StepMetrics) -> None:  # noqa: B027 - a rule that learns nothing keeps this default
        """Default: learn nothing from measurements."""

    @staticmethod
    def setup(job: JobSpec, plan: Plan, factors: dict[str, float], transfer: float = 1.0):
        hw = Hardware(job.cluster)
        est = estimate_plan(hw, job, plan, factors or None)
        model = GenModel.of(hw, job, plan, est)
        f = Factors.of(factors, transfer)
        lengths = forecast_lengths(job.workload.response, job.sequences_per_step())
        return model, run_bulk(model, lengths, f), f, est.phase_times["inference"]


def _tail_tps(job: JobSpec, bulk_tp: int) -> list[int]:
    heads, gpn = job.models["actor"].heads, job.cluster.gpus_per_node
    tps, t = [], bulk_tp
    while t <= gpn:
        if heads % t == 0:
            tps.append(t)
        t *= 2
    return tps


def _powers(limit: int) -> list[int]:
    out, k = [], 1
    while k <= limit:
        out.append(k)
        k *= 2
    return out


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
        rec = m.detail.get("intrastep")
        if rec and rec.get("moved") and rec.get("migration_modelled_s", 0) > 0:
            self.ratios.append(rec["migration_s"] / rec["migration_modelled_s"])

    def choose(self, job: JobSpec, plan: Plan, factors: dict[str, float]) -> TailPhase | None:
        if self.wait_for_fit and not factors:
            return None
        model, bulk, f, inference_s = self.setup(job, plan, factors, self.transfer)
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
        shapes = [(tp, r) for tp in _tail_tps(job, lay.tp) for r in _powers(gpus // tp)]
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
        model, bulk, f, inference_s = self.setup(job, plan, {})
        lay = model.placement.layout
        tp = _tail_tps(job, lay.tp)[-1] if _tail_tps(job, lay.tp) else lay.tp
        if tp == lay.tp:
            return None  # already at the widest TP: nothing to switch
        phase = TailPhase(max(1, lay.dp), tp, len(model.placement.gpus) // tp, False, "cheaper", self.name)
        pred = predict(model, bulk, phase, f, inference_s)
        return TailPhase(phase.trigger_live, tp, phase.tail_replicas, False, "cheaper", self.name, pred.to_dict())


class RlhfuseTail(TailRule):
    name = "rlhfuse-like"
    share = 0.05  # samples left when the tail migrates (an assumption: RLHFuse tunes its threshold per job)

    def choose(self, job: JobSpec, plan: Plan, factors: dict[str, float]) -> TailPhase | None:
        model, bulk, f, inference_s = self.setup(job, plan, {})
        lay = model.placement.layout
        k = max(1, int(self.share * len(bulk.lengths)))
        replicas = min(lay.dp, max(1, -(-k // model.tail_slots(lay.tp)) if model.tail_slots(lay.tp) else lay.dp))
        if replicas >= lay.dp:
            return None
        phase = TailPhase(k, lay.tp, replicas, True, "cheaper", self.name)
        pred = predict(model, bulk, phase, f, inference_s)
        return TailPhase(k, lay.tp, replicas, True, "cheaper", self.name, pred.to_dict())


class PhasedPolicy:
    """A between-step policy whose generation stages switch to a tail layout inside the step."""

    def __init__(self, name: str, inner, rule: TailRule, every: int = 10) -> None:
        self.name, self.inner, self.rule, self.every = name, inner, rule, every
        self._last: tuple[int, Plan | None] = (-10**9, None)
        self._phase: TailPhase | None = None
        self._in_force: Plan | None = None  # the plan object the loop runs (it keeps its own on equal plans)
        self._fitted = False  # whether the controller had a calibration fit at the last choice

    @property
    def controller(self):
        """The object holding the plan, the forecast and the calibration (a baseline wraps a controller)."""
        return getattr(self.inner, "inner", self.inner)

    @property
    def log(self) -> list[Decision]:
        return self.inner.log

    def _set_phases(self, plan: Plan, step: int) -> Plan:
        last_step, last_plan = self._last
        ctrl = self.controller
        fitted = bool(ctrl.factors)
        if last_plan is not plan or step - last_step >= self.every or fitted != self._fitted:
            self._fitted = fitted
            job = ctrl.job_for(step, plan.num_gpus)
            self._phase = self.rule.choose(job, plan, ctrl.factors)
            self._last = (step, plan)
        if self._phase is None:
            plan.meta.pop("generation_phases", None)
        else:
            plan.meta["generation_phases"] = self._phase.to_dict()
        return plan

    def initial_plan(self, num_gpus: int) -> Plan:
        self._in_force = self._set_phases(self.inner.initial_plan(num_gpus), 0)
        return self._in_force

    def resume(self, plan: Plan) -> None:
        self.inner.resume(plan)
        self._in_force = plan

    def survivor_plan(self, num_gpus: int, step: int) -> Plan:
        self._in_force = self._set_phases(self.inner.survivor_plan(num_gpus, step), step)
        return self._in_force

    def after_step(self, m: StepMetrics, cluster: ClusterState) -> Decision:
        self.rule.observe(m)
        d = self.inner.after_step(m, cluster)
        if d.plan is not None and d.plan != self._in_force:
            self._in_force = d.plan
        self._set_phases(self._in_force, m.step + 1)
        return d

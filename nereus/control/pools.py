"""Decisions about the rollout's GPUs: whether it gets GPUs of its own (bounded asynchrony), how many, and
its tensor parallelism priced with the levers.

With ``run.policy_lag`` >= 1 the controller may run one-step-off: the rollout alone on g GPUs generates
step k + 1 while every other model trains step k on the n - g others (verl's one-step-off recipe;
``cost.tail.async_split``: a step takes the slower pool plus the weight sync). ``PoolRule`` prices the
colocated plan against every split whose rollout pool is a power of two from one node up to half the GPUs
(the planner lays out both pools under ``split_constraints``; the GPU counts the search splits by are
powers of two, so other pool sizes leave GPUs idle), each with the generation levers the lever rule picks
for it — at one step less of lag on a split, whose every token is already a step old — and keeps the
fastest. A split is admitted only when it beats the colocated step by ``min_gain``. At every policy lag
the colocated plan, and the fastest split, are also priced with the rollout at half and twice the
planner's TP, since the levers' gain depends on the batch a replica holds (``PoolRule._at_rollout_tps``).

Within a split the pools are independent (the rollout's layout sets the generation time, the others'
the training time), so the controller's usual search, which minimises their sum, also minimises the
slower pool: it keeps adapting each pool's layout between steps under the split's constraints.

The split and the rollout's TP are chosen at the start on the priors, then on the calibrated model every
``PoolRule.every`` steps (``PoolRule.recheck``: a move only for ``switch_gain`` of the step, as the
controller admits a plan, against its transition cost) and when the GPU count changes. The calibration fits
the generation factors to plain-equivalent times (``cost.calibration.plain_equivalent``: a lever-on step's
generation times the lever's predicted plain / lever seconds), so a calibrated price counts a lever's gain
once; fitted to the measured times as they were, it counted it twice (a split measured at 85 s of
generation was priced at 46 s). The rollout's TP is pinned for the controller even where the planner's own
stays (``rollout_tp_constraints``): its search ranks rollout layouts without the levers, and moved a split's
rollout from TP 2 to a TP 4 that ran 10-20% slower with speculation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from nereus.control.tail_policy import LeverRule, generation_forecast, powers_of_two
from nereus.cost.generation import ROLLOUT
from nereus.cost.hardware import Hardware
from nereus.cost.plan_cost import PlanEstimate, estimate_plan
from nereus.cost.tail.async_split import async_step
from nereus.planner.candidates import enumerate_layouts, tp_degrees
from nereus.planner.search import Constraints, placement_units, search
from nereus.spec.capability import RuntimeCapability
from nereus.spec.errors import InfeasibleError
from nereus.spec.job import JobSpec
from nereus.spec.layout import Layout, ModelStage, Plan
from nereus.spec.levers import AsyncSplit, GenerationLevers

STALENESS = 1  # one-step-off: the only asynchrony run.policy_lag 1 allows


def split_constraints(job: JobSpec, gen_gpus: int,
                      layout_filter: Callable[[ModelStage, Layout], bool] | None = None,
                      capability: RuntimeCapability | None = None) -> Constraints:
    """The rollout alone on exactly ``gen_gpus`` GPUs, every other model together on the rest (within
    ``layout_filter``, when given; ``capability``: the runtime the plan is for, kept on the constraints)."""
    n = job.cluster.num_gpus
    others = "+".join(u for u in placement_units(job) if u != "rollout")

    def pools(ms: ModelStage, layout: Layout) -> bool:
        fits = layout.world == gen_gpus if ms == ROLLOUT else layout.world <= n - gen_gpus
        return fits and (layout_filter is None or layout_filter(ms, layout))

    return Constraints((f"rollout | {others}",), pools, capability)


def rollout_tp_constraints(base: Constraints | None, tp: int) -> Constraints:
    """``base`` with the rollout's tensor parallelism pinned at ``tp``."""
    given = base.layout_filter if base is not None else None

    def pinned(ms: ModelStage, layout: Layout) -> bool:
        return (ms != ROLLOUT or layout.tp == tp) and (given is None or given(ms, layout))

    return Constraints(base.strategies if base is not None else None, pinned,
                       base.capability if base is not None else None)


def rollout_at_tp(job: JobSpec, plan: Plan, tp: int, factors: dict[str, float],
                  layout_filter: Callable[[ModelStage, Layout], bool] | None = None,
                  ) -> tuple[Plan, PlanEstimate] | None:
    """``plan`` with its rollout re-laid at TP ``tp`` on the same GPUs, every other placement kept: of the
    layouts the planner enumerates there (within ``layout_filter``), the one whose plan is predicted
    fastest and fits every device; None when none does."""
    hw, rollout = Hardware(job.cluster), plan.placement(str(ROLLOUT))
    best = None
    for lay in enumerate_layouts(job, ROLLOUT, len(rollout.gpus)):
        if lay.tp != tp or lay.world != len(rollout.gpus) or (layout_filter and not layout_filter(ROLLOUT, lay)):
            continue
        cand = replace(plan, placements=tuple(replace(p, layout=lay) if p.model_stage == ROLLOUT else p
                                              for p in plan.placements))
        est = estimate_plan(hw, job, cand, factors or None)
        if est.feasible and (best is None or est.step_time_s < best[1].step_time_s):
            best = (cand, est)
    return best


def rollout_tp(plan: Plan) -> int:
    return plan.placement(str(ROLLOUT)).layout.tp


def runs_apart(plan: Plan) -> bool:
    """Whether the rollout's GPUs hold nothing else (a plan one-step-off asynchrony can run on)."""
    rollout = set(plan.placement(str(ROLLOUT)).gpus)
    return all(not rollout & set(p.gpus) for p in plan.placements if p.model_stage != ROLLOUT)


def runs_one_step_off(plan: Plan) -> bool:
    """Whether ``plan`` runs one-step-off: its levers ask for it and its rollout holds GPUs apart."""
    return plan.levers is not None and plan.levers.async_split is not None and runs_apart(plan)


@dataclass(frozen=True)
class PoolMove:
    """A re-check's move on trial: kept when its first ``MEASURE_STEPS`` steps deliver at least the tokens per
    second of the ``MEASURE_STEPS`` before it (less ``PoolRule.switch_gain``), else undone back to
    ``old_plan`` under ``old_constraints``: the calibration prices pools and TPs it never measured by
    extrapolation (a GRPO split's 8-GPU TP-1 rollout priced at 90 s of generation ran 176 s)."""

    step: int  # the first step on the new pools
    before_tokens_per_s: float
    old_plan: Plan
    old_constraints: Constraints | None
    pools: tuple[int | None, int]  # the new pools: the rollout's GPUs apart (None: colocated), its TP


MEASURE_STEPS = 10  # steps measured before a pool move and after it


def tokens_per_s(steps: list[tuple[float, float]]) -> float:
    """Throughput of measured (tokens, seconds) steps."""
    seconds = sum(s for _, s in steps)
    return sum(t for t, _ in steps) / seconds if seconds > 0 else 0.0


def pools_of(choice: PoolChoice) -> tuple[int | None, int]:
    return choice.gen_gpus, rollout_tp(choice.plan)


@dataclass(frozen=True)
class PoolChoice:
    """A priced option: the plan (colocated when ``gen_gpus`` is None), its levers and predicted step."""

    plan: Plan
    constraints: Constraints | None
    gen_gpus: int | None
    levers: GenerationLevers | None
    step_s: float

    @property
    def predicted(self) -> dict[str, float]:
        if self.gen_gpus is None:
            return {"colocated_step_s": self.step_s}
        return dict(self.levers.predicted)


@dataclass
class PoolRule:
    min_gain: float = 0.02  # of the colocated step: a split moves every model, so it must pay clearly
    name: str = "nereus"
    # the calibrated re-check (``recheck``): every ``every`` steps, and a move away from the pools in force
    # only when it predicts ``switch_gain`` of the step (or the calibration's residual error, if larger)
    every: int = 50
    switch_gain: float = 0.05

    def recheck(self, job: JobSpec, factors: dict[str, float], levers: LeverRule | None, policy_lag: int,
                base: Constraints | None, plan: Plan, residual: float = 0.0) -> tuple[PoolChoice, PoolChoice] | None:
        """The pools chosen again on the calibrated model (``factors``, fitted on plain-equivalent generation
        times, ``cost.calibration.plain_equivalent``, so a lever's gain is priced once): (``plan`` priced so,
        the choice) when the choice lays the rollout out otherwise than ``plan`` (colocated against apart,
        another pool size or another TP) and is faster by ``switch_gain`` or ``residual``; None otherwise. The start's
        choice is on the priors; this one on what the job measured (a split whose training pool turns out
        the slower, under a hardware truth far from the model's, goes back to colocated)."""
        current = self.price(job, factors, levers, policy_lag, plan)
        colocated = current.gen_gpus is None  # then ``plan`` is the colocated plan, laid out by the controller
        choice = self.choose(job, factors, levers, policy_lag, base, plan if colocated else None,
                             current if colocated else None)
        if pools_of(choice) == pools_of(current):
            return None
        if choice.step_s >= current.step_s * (1 - max(self.switch_gain, residual)):
            return None
        return current, choice

    def choose(self, job: JobSpec, factors: dict[str, float], levers: LeverRule | None, policy_lag: int,
               base: Constraints | None, colocated_plan: Plan | None = None,
               priced: PoolChoice | None = None) -> PoolChoice:
        """The fastest of the colocated plan (under ``base``; ``colocated_plan`` when the caller has searched
        it already, ``priced`` when it has priced it too) and the splits of ``job``'s GPUs, each with its
        levers, the colocated plan and the fastest split also at the neighbouring rollout TPs
        (``_at_rollout_tps``); the planner's own choice unless another beats it by ``min_gain``."""
        if colocated_plan is None:
            colocated = self._price(job, factors, levers, policy_lag, base, None)
        else:
            priced = priced or self.price(job, factors, levers, policy_lag, colocated_plan)
            colocated = replace(priced, constraints=base)
        colocated = self._at_rollout_tps(job, factors, levers, policy_lag, base, None, colocated)
        if policy_lag < STALENESS:
            return colocated
        n, node = job.cluster.num_gpus, job.cluster.gpus_per_node
        sizes = [g for g in powers_of_two(n // 2) if g >= min(node, n // 2)]
        given, cap = (base.layout_filter, base.capability) if base is not None else (None, None)
        splits = [c for g in sizes
                  if (c := self._price(job, factors, levers, policy_lag, split_constraints(job, g, given, cap), g))]
        best = min(splits, key=lambda c: c.step_s, default=None)
        if best is not None:  # the fastest split's rollout at the neighbouring TPs too
            best = self._at_rollout_tps(job, factors, levers, policy_lag, best.constraints, best.gen_gpus, best)
        if best is None or best.step_s >= colocated.step_s * (1 - self.min_gain):
            return colocated
        return best

    def _at_rollout_tps(self, job: JobSpec, factors: dict[str, float], levers: LeverRule | None, policy_lag: int,
                        constraints: Constraints | None, gen_gpus: int | None, planned: PoolChoice) -> PoolChoice:
        """``planned`` (the planner's plan under ``constraints``, priced with its levers) against the same plan
        with the rollout at half and twice its TP: the planner ranks rollout layouts without the levers, yet
        speculation's verification turns compute-bound sooner on a wide replica's large batch (256 live
        sequences per TP-4 replica against 128 per TP-2 one), so the best layout with the levers can differ,
        and it moves with the batch a replica holds, which halves or doubles with each step of TP. Another
        TP is kept only when it beats ``planned`` by ``min_gain``; it re-lays the rollout alone on its GPUs
        (``rollout_at_tp``: no second search, which at 1,024 GPUs costs as much as the lever choice), and
        the controller plans every stage under that TP from then on (``rollout_tp_constraints``)."""
        if levers is None:
            return planned
        own = rollout_tp(planned.plan)
        best = planned
        given = constraints.layout_filter if constraints is not None else None
        for tp in sorted(set(tp_degrees(job, ROLLOUT.model, gen_gpus or job.cluster.num_gpus)) & {own // 2, own * 2}):
            relaid = rollout_at_tp(job, planned.plan, tp, factors, given)
            if relaid is None:
                continue
            c = self.price(job, factors, levers, policy_lag, *relaid)
            if c.step_s < planned.step_s * (1 - self.min_gain) and c.step_s < best.step_s:
                best = replace(c, constraints=rollout_tp_constraints(constraints, tp))
        if best is planned:  # pinned too: the controller's search would rank the rollout's TP without the levers
            best = replace(planned, constraints=rollout_tp_constraints(constraints, own))
        return best

    def _price(self, job: JobSpec, factors: dict[str, float], levers: LeverRule | None, policy_lag: int,
               constraints: Constraints | None, gen_gpus: int | None) -> PoolChoice | None:
        """The planner's plan under ``constraints`` priced with its levers; None where none fits a split's
        pools (the colocated plan itself must fit: its error names the model-stage)."""
        try:
            result = search(Hardware(job.cluster), job, factors or None, constraints=constraints)
        except InfeasibleError:
            if gen_gpus is None:
                raise
            return None
        choice = self.price(job, factors, levers, policy_lag, result.plan, result.estimate)
        return replace(choice, constraints=constraints)

    def price(self, job: JobSpec, factors: dict[str, float], levers: LeverRule | None, policy_lag: int, plan: Plan,
              est: PlanEstimate | None = None) -> PoolChoice:
        """``plan`` priced as it runs: one-step-off when its rollout holds GPUs apart and ``policy_lag``
        allows it, else synchronously; its generation with the levers ``levers`` picks for it."""
        est = est or estimate_plan(Hardware(job.cluster), job, plan, factors or None)
        apart = policy_lag >= STALENESS and runs_apart(plan)
        gen_gpus = len(plan.placement(str(ROLLOUT)).gpus) if apart else None
        chosen = None
        if levers is not None:
            model, bulk, f, _ = generation_forecast(job, plan, factors)
            chosen = levers.choose(model, bulk, f, policy_lag - STALENESS if apart else policy_lag)
        gain = chosen.gain_s if chosen is not None else 0.0
        if gen_gpus is None:
            return PoolChoice(plan, None, None, chosen.levers if chosen else None, est.step_time_s - gain)
        p = est.phase_times
        a = async_step(gen_gpus, job.cluster.num_gpus - gen_gpus, p["generation"] - gain,
                       p["inference"] + p["training"], p["weight_sync"], STALENESS)
        kept = chosen.levers if chosen is not None else GenerationLevers(policy=self.name)
        predicted = {**kept.predicted, "async_step_s": a.step_s, "async_gen_s": a.gen_s,
                     "async_train_s": a.train_s, "async_sync_s": a.sync_s}
        split = replace(kept, async_split=AsyncSplit(gen_gpus, STALENESS), policy=self.name, predicted=predicted)
        return PoolChoice(plan, None, gen_gpus, split, a.step_s)

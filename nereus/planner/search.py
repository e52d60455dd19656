"""Global plan search: colocation groups, GPU counts per group, a layout per model-stage.

The step runs generation → inference → training, then syncs the actor's weights to its generation
layout. Model-stages are gathered into *units* that always share GPUs (a model's inference and training
stages; the rollout of the actor may sit elsewhere, as in disaggregated systems). Units are partitioned
into colocation groups; each group gets a node-aligned share of the cluster; inside a group model-stages
take turns on all of its GPUs, and groups run concurrently. A group's best layouts come from the
Pareto-pruned candidate table and a greedy repair that trades time for memory until the group fits.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache

from nereus.cost.hardware import Hardware
from nereus.cost.plan_cost import PlanEstimate, estimate_plan, sync_time
from nereus.cost.stages import StageCost
from nereus.planner.candidates import CandidateTable
from nereus.spec.capability import RuntimeCapability
from nereus.spec.errors import InfeasibleError
from nereus.spec.job import JobSpec
from nereus.spec.layout import STAGES, Layout, ModelStage, Placement, Plan

GIB = 2**30
MAX_GROUP_SPLIT_UNITS = 16  # GPU-share resolution of a split between colocation groups


def placement_units(job: JobSpec) -> dict[str, tuple[ModelStage, ...]]:
    """Model-stages that always share GPUs: the rollout, and each model's remaining stages."""
    units: dict[str, list[ModelStage]] = {}
    for ms in job.model_stages():
        name = "rollout" if ms.stage == "generation" else ms.model
        units.setdefault(name, []).append(ms)
    return {k: tuple(v) for k, v in units.items()}


def set_partitions(items: list[str]) -> list[list[tuple[str, ...]]]:
    if not items:
        return [[]]
    first, rest = items[0], items[1:]
    out = []
    for part in set_partitions(rest):
        out.append([(first,), *part])
        for i in range(len(part)):
            out.append([*part[:i], (first, *part[i]), *part[i + 1:]])
    return out


def compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    """Ordered ways to write ``total`` as ``parts`` positive integers."""
    return [tuple(b - a for a, b in zip((0, *cuts), (*cuts, total), strict=True))
            for cuts in itertools.combinations(range(1, total), parts - 1)]


def split_unit(num_gpus: int, gpus_per_node: int) -> int:
    """GPUs per share of a split: a power of two giving at most MAX_GROUP_SPLIT_UNITS shares, whole
    nodes once the cluster has that many nodes (small clusters may split a node, as OpenRLHF places a
    reference model on two GPUs)."""
    unit = 1
    while num_gpus // unit > MAX_GROUP_SPLIT_UNITS:
        unit *= 2
    if unit > gpus_per_node:
        unit = gpus_per_node * max(1, math.ceil(num_gpus // gpus_per_node / MAX_GROUP_SPLIT_UNITS))
    return unit


def _pow2_factor(n: int) -> int:
    return n & -n


@dataclass
class GroupChoice:
    units: tuple[str, ...]
    gpus: int
    chosen: dict[ModelStage, tuple[float, StageCost]]
    peak_bytes: float
    phase_times: dict[str, float]


@dataclass
class Candidate:
    step_time_s: float
    groups: list[GroupChoice]
    sync_s: float
    strategy: str
    split: tuple[int, ...] = ()  # GPU shares per group


@dataclass
class SearchResult:
    plan: Plan
    estimate: PlanEstimate
    runners_up: list[Candidate] = field(default_factory=list)
    evaluated_layouts: int = 0
    search_time_s: float = 0.0
    best: Candidate | None = None


class GroupEvaluator:
    """Best layouts for a set of units sharing ``gpus`` devices; cached per (units, gpus)."""

    def __init__(self, table: CandidateTable, units: dict[str, tuple[ModelStage, ...]]) -> None:
        self.table, self.units = table, units
        self.usable = table.hw.usable_bytes()
        self.evaluate = lru_cache(maxsize=None)(self._evaluate)

    def _evaluate(self, group: tuple[str, ...], gpus: int) -> GroupChoice | None:
        stages = [ms for u in group for ms in self.units[u] if ms.stage != "generation"]
        rollout = next((ms for u in group for ms in self.units[u] if ms.stage == "generation"), None)
        options = [self.table.get(ms, gpus) for ms in stages]
        if any(not o for o in options):
            return None
        idx = [0] * len(stages)
        for _ in range(8 * len(stages) + 1):
            picked = [options[k][i] for k, i in enumerate(idx)]
            resident = sum(c.resident_bytes for _, c in picked)
            transient = max((c.transient_bytes for _, c in picked), default=0.0)
            gen = self._rollout(rollout, gpus, resident)
            peak = self._peak(resident, transient, gen, rollout)
            if peak <= self.usable:
                chosen = dict(zip(stages, picked, strict=True))
                if gen is not None:
                    chosen[rollout] = gen
                return GroupChoice(group, gpus, chosen, peak, self._phase_times(chosen))
            swap = self._cheapest_swap(options, idx, picked, resident, rollout, gpus, peak)
            if swap is None:
                return None
            idx[swap[0]] = swap[1]
        return None

    def _rollout(self, rollout: ModelStage | None, gpus: int, resident: float) -> tuple[float, StageCost] | None:
        if rollout is None:
            return None
        return self.table.generation(rollout, gpus, math.ceil(resident / GIB))

    def _peak(self, resident: float, transient: float, gen: tuple[float, StageCost] | None,
              rollout: ModelStage | None) -> float:
        if gen is not None:
            return resident + gen[1].resident_bytes + max(transient, gen[1].transient_bytes)
        if rollout is not None:
            return math.inf  # the rollout does not fit beside the others at all
        return resident + transient

    def _cheapest_swap(self, options: list, idx: list[int], picked: list, resident: float,
                       rollout: ModelStage | None, gpus: int, peak: float) -> tuple[int, int] | None:
        """The replacement layout that lowers the group's peak memory at the least time per byte saved."""
        best, best_ratio = None, math.inf
        # Stages that share the largest transient (two inference passes at the same micro-batch) block
        # each other: swapping one alone leaves the peak where it is. Such a swap still counts when it
        # shrinks its own transient without raising the resident memory; the next round swaps the other.
        tied, tied_ratio = None, math.inf
        trans = [c.transient_bytes for _, c in picked]
        top = max(trans, default=0.0)
        for k, i in enumerate(idx):
            others_trans = max((t for m, t in enumerate(trans) if m != k), default=0.0)
            t_i, c_i = picked[k]
            for j in range(i + 1, len(options[k])):
                t_j, c_j = options[k][j]
                new_res = resident - c_i.resident_bytes + c_j.resident_bytes
                new_peak = self._peak(new_res, max(others_trans, c_j.transient_bytes),
                                      self._rollout(rollout, gpus, new_res), rollout)
                saved = peak - new_peak if math.isfinite(peak) else c_i.resident_bytes - c_j.resident_bytes
                if saved <= 0:
                    shrunk = c_i.transient_bytes - c_j.transient_bytes
                    if trans[k] == top and shrunk > 0 and new_res <= resident and math.isfinite(peak):
                        ratio = (t_j - t_i) / shrunk
                        if ratio < tied_ratio:
                            tied, tied_ratio = (k, j), ratio
                    continue
                ratio = (t_j - t_i) / saved
                if ratio < best_ratio:
                    best, best_ratio = (k, j), ratio
        return best if best is not None else tied

    @staticmethod
    def _phase_times(chosen: dict[ModelStage, tuple[float, StageCost]]) -> dict[str, float]:
        times = dict.fromkeys(STAGES, 0.0)
        for ms, (t, _) in chosen.items():
            times[ms.stage] += t
        return times


def _strategy_name(partition: list[tuple[str, ...]]) -> str:
    if len(partition) == 1:
        return "colocated"
    return " | ".join("+".join(g) for g in partition)


ACTOR_TRAIN, ACTOR_GEN = ModelStage("actor", "training"), ModelStage("actor", "generation")


class _Combiner:
    """Step time of a set of groups: the slowest group of each phase, plus the actor's weight sync."""

    def __init__(self, job: JobSpec, hw: Hardware, factors: dict | None) -> None:
        self.job, self.hw = job, hw
        self.sync_factor = (factors or {}).get("sync", 1.0)
        self.rl = job.algorithm.name != "train"
        self._sync: dict[tuple, float] = {}

    def __call__(self, groups: list[GroupChoice]) -> tuple[float, float]:
        # groups on disjoint GPUs run a phase concurrently, unless the runtime runs stages one at a time
        agg = max if self.job.options.concurrent_stages else sum
        step = sum(agg(g.phase_times[s] for g in groups) for s in STAGES)
        if not self.rl:
            return step, 0.0
        tg = next(g for g in groups if ACTOR_TRAIN in g.chosen)
        gg = next(g for g in groups if ACTOR_GEN in g.chosen)
        key = (tg.chosen[ACTOR_TRAIN][1].layout, gg.chosen[ACTOR_GEN][1].layout, tg is gg)
        if key not in self._sync:
            cross = not key[2] and self.hw.cluster.nodes > 1
            self._sync[key] = self.sync_factor * sync_time(self.hw, self.job, key[0], key[1], key[2], cross)
        return step + self._sync[key], self._sync[key]


REFINED_STRATEGIES = 2  # coarse winners refined at full GPU-share resolution


class _SplitSearch:
    """Best GPU split of one partition: coarse compositions, then hill-climbing at full resolution."""

    def __init__(self, evaluator: GroupEvaluator, combine: _Combiner, n: int, unit: int) -> None:
        self.evaluator, self.combine, self.n, self.unit = evaluator, combine, n, unit
        self.shares = n // unit

    def score(self, partition: list[tuple[str, ...]], split: tuple[int, ...]) -> Candidate | None:
        sizes = [s * self.unit for s in split]
        sizes[-1] += self.n - self.shares * self.unit  # the remainder goes to the last group
        groups = []
        for g, size in zip(partition, sizes, strict=True):
            choice = self.evaluator.evaluate(g, size)
            if choice is None:
                return None
            groups.append(choice)
        step, sync = self.combine(groups)
        return Candidate(step, groups, sync, _strategy_name(partition), split)

    def coarse(self, partition: list[tuple[str, ...]]) -> Candidate | None:
        k = len(partition)
        coarse_shares = min(self.shares, max(4, k))
        scale = self.shares // coarse_shares
        best = None
        for split in compositions(coarse_shares, k):
            fine = tuple(s * scale for s in split[:-1]) + (self.shares - scale * sum(split[:-1]),)
            cand = self.score(partition, fine)
            if cand is not None and (best is None or cand.step_time_s < best.step_time_s):
                best = cand
        return best

    def refine(self, partition: list[tuple[str, ...]], start: Candidate) -> Candidate:
        """Move one or two shares between two groups while the step gets faster."""
        best = start
        for _ in range(16):
            improved = None
            split = best.split
            for i, j in itertools.permutations(range(len(split)), 2):
                for d in (1, 2):
                    if split[i] - d < 1:
                        continue
                    trial = list(split)
                    trial[i] -= d
                    trial[j] += d
                    cand = self.score(partition, tuple(trial))
                    if cand is not None and cand.step_time_s < (improved or best).step_time_s * (1 - 1e-9):
                        improved = cand
            if improved is None:
                return best
            best = improved
        return best


@dataclass(frozen=True)
class Constraints:
    """Restrictions a caller puts on the search (baseline policies use them to model other systems).

    ``strategies``: allowed colocation strategies by name (``"colocated"``, ``"disaggregated"`` for one
    group per unit, or a name as ``_strategy_name`` writes it); ``layout_filter``: layouts allowed per
    model-stage; ``capability``: the runtime the plan is for (``spec.capability``) — layouts it cannot run
    are never proposed (folded into ``layout_filter``, so the search reads one predicate)."""

    strategies: tuple[str, ...] | None = None
    layout_filter: Callable[[ModelStage, Layout], bool] | None = None
    capability: RuntimeCapability | None = None

    def __post_init__(self) -> None:
        cap, given = self.capability, self.layout_filter
        if cap is None:
            return

        def runnable(ms: ModelStage, lay: Layout) -> bool:
            return not cap.supports(lay, ms.stage) and (given is None or given(ms, lay))

        object.__setattr__(self, "layout_filter", runnable)

    def allows(self, partition: list[tuple[str, ...]], units: int) -> bool:
        if self.strategies is None:
            return True
        name = _strategy_name(partition)
        return name in self.strategies or ("disaggregated" in self.strategies and len(partition) == units)


def search(hw: Hardware, job: JobSpec, factors: dict[str, float] | None = None, keep: int = 5,
           constraints: Constraints | None = None) -> SearchResult:
    """The plan with the least predicted step time whose every device fits; raises InfeasibleError
    naming the model-stage that fits nowhere when none does."""
    start = time.perf_counter()
    constraints = constraints or Constraints()
    table = CandidateTable(hw, job, factors, constraints.layout_filter)
    units = placement_units(job)
    n = job.cluster.num_gpus
    splits = _SplitSearch(GroupEvaluator(table, units), _Combiner(job, hw, factors), n,
                          split_unit(n, job.cluster.gpus_per_node))
    coarse: list[tuple[Candidate, list[tuple[str, ...]]]] = []
    for partition in set_partitions(list(units)):
        if not constraints.allows(partition, len(units)):
            continue
        if len(partition) <= splits.shares and (cand := splits.coarse(partition)) is not None:
            coarse.append((cand, partition))
    coarse.sort(key=lambda cp: cp[0].step_time_s)
    ranked = [splits.refine(p, c) for c, p in coarse[:REFINED_STRATEGIES]] + [c for c, _ in coarse[REFINED_STRATEGIES:]]
    ranked.sort(key=lambda c: c.step_time_s)
    for cand in ranked:
        plan = materialize(job, cand)
        estimate = estimate_plan(hw, job, plan, factors)
        if estimate.feasible:
            others = [c for c in ranked if c is not cand][:keep]
            return SearchResult(replace(plan, strategy=cand.strategy), estimate, others, table.evaluated,
                                time.perf_counter() - start, cand)
    raise _infeasible(table, job, n)


def materialize(job: JobSpec, cand: Candidate) -> Plan:
    """Contiguous GPU ranges per group. Groups are laid out by decreasing power-of-two factor of their
    size, so every group starts at a multiple of any TP degree it can use (TP divides the group size)
    and no TP group straddles a node."""
    placements, start = [], 0
    for g in sorted(cand.groups, key=lambda g: -_pow2_factor(g.gpus)):
        gpus = tuple(range(start, start + g.gpus))
        for ms, (_, cost) in g.chosen.items():
            placements.append(Placement(ms, cost.layout, gpus[: cost.layout.world]))
        start += g.gpus
    order = {str(ms): i for i, ms in enumerate(job.model_stages())}
    placements.sort(key=lambda p: order[str(p.model_stage)])
    return Plan(tuple(placements), job.cluster.num_gpus)


def _infeasible(table: CandidateTable, job: JobSpec, n: int) -> InfeasibleError:
    """Name the model-stage that is furthest from fitting even with every GPU to itself."""
    usable = table.hw.usable_bytes()
    worst = None
    for ms in job.model_stages():
        need, layout = table.min_memory(ms, n)
        if worst is None or need / usable > worst[1] / usable:
            worst = (ms, need, layout)
    ms, need, layout = worst
    if layout is None:
        return InfeasibleError(str(ms), 0.0, table.hw.capacity_bytes,
                               f"no layout splits the step's {job.sequences_per_step()} sequences; raise "
                               "workload.prompts_per_step or lower algorithm.mini_batches")
    detail = f"best layout {layout.short()} on {layout.world} of {n} GPUs"
    if need <= usable:
        detail += "; it fits alone but not beside the job's other models: add GPUs or drop a model"
    return InfeasibleError(str(ms), need + table.hw.priors.reserved_bytes, table.hw.capacity_bytes, detail)

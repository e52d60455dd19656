"""Cost of a whole plan: per-stage times, the step time, per-device memory at every phase."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from nereus.cost.hardware import Hardware
from nereus.cost.memory import BF16
from nereus.cost.stages import StageCost, stage_cost
from nereus.cost.verl_weight_sync import SYNC_TIMES
from nereus.cost.weight_sync import engine_reload_time
from nereus.spec.errors import SpecError
from nereus.spec.job import JobSpec
from nereus.spec.layout import STAGES, Layout, ModelStage, Placement, Plan
from nereus.spec.parallel_dims import ParallelDims


@dataclass
class PlanEstimate:
    step_time_s: float
    phase_times: dict[str, float]  # generation, inference, training, weight_sync
    costs: dict[str, StageCost]
    stage_times: dict[str, float]  # per model-stage, calibrated
    device_peak_bytes: list[float]
    capacity_bytes: float
    violations: list[str] = field(default_factory=list)

    @property
    def feasible(self) -> bool:
        return not self.violations

    def to_dict(self) -> dict:
        return {
            "step_time_s": self.step_time_s,
            "feasible": self.feasible,
            "violations": self.violations,
            "phase_times_s": self.phase_times,
            "model_stages": {
                name: {
                    "layout": c.layout.to_dict(),
                    "time_s": self.stage_times[name],
                    "terms_s": c.terms,
                    "memory_bytes": c.memory,
                    "peak_bytes": c.peak_bytes,
                    **({"detail": c.detail} if c.detail else {}),
                }
                for name, c in self.costs.items()
            },
            "device_peak_bytes": self.device_peak_bytes,
            "capacity_bytes": self.capacity_bytes,
        }


def sync_time(hw: Hardware, job: JobSpec, train: Layout, gen: Layout, same_gpus: bool, cross_node: bool) -> float:
    """Per-step copy of the actor's weights from its training layout to its generation layout.

    Nothing moves when both use the same shards on the same GPUs. Otherwise every generation device
    receives its shard (W/(tp·pp)) and the training devices together send dp_gen full copies, half of
    each already in place when the two share GPUs; the time is the busier side over the link bandwidth
    (NVLink inside a group's nodes, InfiniBand between groups). The transition graph (nereus.elastic)
    schedules the exact transfers; this is its bandwidth bound.
    """
    if same_gpus and (train.tp, train.pp, train.dp) == (gen.tp, gen.pp, gen.dp):
        return 0.0
    weights = job.models["actor"].params() * BF16
    recv = weights / (gen.tp * gen.pp) * (0.5 if same_gpus else 1.0)
    send = gen.dp * weights * (0.5 if same_gpus else 1.0) / train.world
    return hw.p2p_time(max(recv, send), cross_node=cross_node)


def weight_sync_time(hw: Hardware, job: JobSpec, train: Placement, gen: Placement) -> float:
    same = set(train.gpus) == set(gen.gpus)
    nodes = {hw.cluster.node_of(x) for x in train.gpus}
    cross = any(hw.cluster.node_of(x) not in nodes for x in gen.gpus) or (not same and hw.cluster.nodes > 1)
    return sync_time(hw, job, train.layout, gen.layout, same, cross)


def _components(placements: list[Placement]) -> list[list[Placement]]:
    """Model-stages of one phase grouped by shared GPUs: groups run concurrently, members take turns."""
    groups: list[tuple[set[int], list[Placement]]] = []
    for p in placements:
        gpus, members = set(p.gpus), [p]
        for g in [g for g in groups if g[0] & gpus]:
            groups.remove(g)
            gpus |= g[0]
            members += g[1]
        groups.append((gpus, members))
    return [m for _, m in groups]


def resident_per_device(hw: Hardware, job: JobSpec, plan: Plan, costs: dict[str, StageCost]) -> list[float]:
    """Memory held across the whole step on each device. Weights shared by two stages of one model with
    the same shards on the same GPUs count once; training stages add gradients and optimizer state."""
    return _resident(plan, costs).tolist()


@lru_cache(maxsize=1024)
def _index(gpus: tuple[int, ...]) -> np.ndarray:
    """A placement's GPUs as a read-only index array (plans at 1,024 GPUs index with the same few tuples)."""
    index = np.array(gpus, np.int64)
    index.flags.writeable = False
    return index


def _resident(plan: Plan, costs: dict[str, StageCost]) -> np.ndarray:
    """``resident_per_device`` as an array (one float64 add per placement and GPU, as a loop would do;
    arrays because plans at 1,024 GPUs made these per-GPU loops the simulator's hot spot)."""
    resident = np.zeros(plan.num_gpus)
    seen_weights: set[tuple] = set()
    for p in plan.placements:
        c = costs[str(p.model_stage)]
        key = (p.model_stage.model, p.layout.tp, p.layout.pp, p.layout.dp, p.gpus)
        share = c.resident_bytes
        if key in seen_weights:
            share -= c.memory.get("weights", 0.0)
        seen_weights.add(key)
        resident[_index(p.gpus)] += share  # a placement's GPUs are distinct (spec.layout.Placement)
    return resident


def estimate_plan(hw: Hardware, job: JobSpec, plan: Plan, factors: dict[str, float] | None = None) -> PlanEstimate:
    """Predicted step time and per-device memory of ``plan``; violations list what does not fit."""
    _check_covers(job, plan)
    costs: dict[str, StageCost] = {}
    for p in plan.placements:
        if p.model_stage.stage != "generation":
            costs[str(p.model_stage)] = _cost_or_error(hw, job, p)
    partial = Plan(tuple(p for p in plan.placements if p.model_stage.stage != "generation"), plan.num_gpus)
    resident = _resident(partial, costs)
    for p in plan.placements:
        if p.model_stage.stage == "generation":
            others = float(resident[_index(p.gpus)].max())
            costs[str(p.model_stage)] = _cost_or_error(hw, job, p, others)
    resident = _resident(plan, costs)
    stage_times = {name: c.time(factors) for name, c in costs.items()}
    phase_times, peak = {}, resident.copy()
    for stage in STAGES:
        active = [p for p in plan.placements if p.model_stage.stage == stage]
        groups = [sum(stage_times[str(m.model_stage)] for m in comp) for comp in _components(active)]
        agg = max if job.options.concurrent_stages else sum  # see Options.concurrent_stages
        phase_times[stage] = agg(groups) if groups else 0.0
        transient = np.zeros(plan.num_gpus)
        for p in active:
            gpus = _index(p.gpus)
            transient[gpus] = np.maximum(transient[gpus], costs[str(p.model_stage)].transient_bytes)
        peak = np.maximum(peak, resident + transient)
    sync = 0.0
    if job.algorithm.name != "train":
        train = plan.placement(ModelStage("actor", "training"))
        gen = plan.placement(ModelStage("actor", "generation"))
        # a plan run by another system's mechanism says so (nereus.cost.verl_weight_sync; simulator baselines)
        mechanism = SYNC_TIMES.get(plan.weight_sync, weight_sync_time)
        sync = mechanism(hw, job, train, gen)
        if job.run is not None and job.run.rollout_engine.traits.own_weights:  # then into the engine's own copy
            sync += engine_reload_time(hw, job, gen.layout)
        sync *= (factors or {}).get("sync", 1.0)
    phase_times["weight_sync"] = sync
    usable = hw.usable_bytes()
    violations = [f"GPU {g}: needs {b / 1e9:.1f} GB, usable {usable / 1e9:.1f} GB "
                  f"(capacity {hw.capacity_bytes / 1e9:.1f} GB less reserve)"
                  for g, b in enumerate(peak.tolist()) if b > usable]
    return PlanEstimate(sum(phase_times.values()), phase_times, costs, stage_times, peak.tolist(),
                        hw.capacity_bytes, violations)


def _cost_or_error(hw: Hardware, job: JobSpec, p: Placement, others: float = 0.0) -> StageCost:
    # priced: a published layout's uneven pipeline split too; the planner proposes and run accepts only even
    # ones, and `nereus estimate --plan` checks a user's plan as run does (``check_runnable``)
    ParallelDims.of(p.layout, job.models[p.model_stage.model], f"plan.{p.model_stage}.layout", priced=True)
    cost = stage_cost(hw, job, p.model_stage, p.layout, others)
    if cost is None:
        raise SpecError(f"plan.{p.model_stage}.layout",
                        f"{p.layout.short()} cannot split the {job.sequences_per_step()} sequences of a step "
                        f"(dp and micro_batch_size too large)")
    return cost


def check_runnable(job: JobSpec, plan: Plan) -> None:
    """``SpecError`` at the first placement whose layout the planner and runtime cannot run (an uneven
    pipeline split among them, which ``estimate_plan`` still prices): a user's own plan file."""
    for p in plan.placements:
        if p.model_stage.model in job.models:
            ParallelDims.of(p.layout, job.models[p.model_stage.model], f"plan.{p.model_stage}.layout")


def _check_covers(job: JobSpec, plan: Plan) -> None:
    need = {str(ms) for ms in job.model_stages()}
    have = {str(p.model_stage) for p in plan.placements}
    if need - have:
        raise SpecError("plan.placements", f"missing model-stages {sorted(need - have)}")
    if have - need:
        raise SpecError("plan.placements", f"{sorted(have - need)} are not model-stages of this job")
    if plan.num_gpus > job.cluster.num_gpus:
        raise SpecError("plan.num_gpus", f"{plan.num_gpus} exceeds the cluster's {job.cluster.num_gpus} GPUs")

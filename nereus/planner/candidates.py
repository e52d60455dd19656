"""Layouts worth considering for one model-stage on a given number of GPUs, costed and pruned."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from functools import lru_cache

from nereus.cost.hardware import Hardware
from nereus.cost.stages import StageCost, stage_cost
from nereus.planner.defaults import generation_layout, planned_token_budget
from nereus.spec.job import JobSpec
from nereus.spec.layout import RECOMPUTE, Layout, ModelStage
from nereus.spec.parallel_dims import tp_splits

# Up to 32: on CPU workers, where each pass costs a fixed few ms (priors.micro_batch_overhead_s), one pass of
# a replica's 32 rows costs about half of four passes of 8 (measured here: 33 vs 60 ms for the long-tail job's
# actor); verl's example scripts set log_prob_micro_batch_size_per_gpu=32. Memory prunes the large ones where it binds.
MICRO_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
MAX_INTERLEAVE = 8


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_degrees(job: JobSpec, model: str, gpus: int) -> list[int]:
    """Powers of two inside one node that split the attention heads and the KV heads evenly (KV heads
    are replicated when TP exceeds them): ``spec.parallel_dims.tp_splits``."""
    arch = job.models[model]
    limit = min(job.cluster.gpus_per_node, gpus)
    out, tp = [], 1
    while tp <= limit:
        if tp_splits(arch, tp):
            out.append(tp)
        tp *= 2
    return out


def ep_degrees(job: JobSpec, model: str, dp: int) -> list[int]:
    """Expert-parallel degrees of an MoE model: those dividing both dp and the expert count (Megatron-Core's
    rule, ``spec.parallel_dims.split_problem``), or the job's fixed ``options.ep`` where it fits; [1] for a
    dense model and where the runtime has no expert parallelism (``RuntimeCapability.planning_options``)."""
    moe, fixed = job.models[model].moe, job.options.ep
    if moe is None:
        return [1]
    if isinstance(fixed, int):
        return [fixed] if dp % fixed == 0 and moe.experts % fixed == 0 else [1]
    return [e for e in divisors(dp) if moe.experts % e == 0]


def pp_degrees(job: JobSpec, ms: ModelStage, gpus_per_replica_limit: int) -> list[int]:
    """Pipeline depths that split the layers evenly; generation keeps pipelines short (decode latency)."""
    layers = job.models[ms.model].layers
    limit = 4 if ms.stage == "generation" else layers
    return [d for d in divisors(layers) if d <= min(limit, gpus_per_replica_limit)]


def enumerate_layouts(job: JobSpec, ms: ModelStage, gpus: int) -> list[Layout]:
    """Every layout of ``ms`` on ``gpus`` devices that the options allow. A layout uses as many of them as
    its TP·PP divides, and fewer when the step has fewer sequences than data-parallel replicas (the
    rest of the group's GPUs then sit out this model-stage)."""
    opts = job.options
    seqs = job.sequences_per_step() // (job.algorithm.mini_batches if ms.stage == "training" else 1)
    recomputes = RECOMPUTE if opts.recompute == "auto" else (opts.recompute,)
    layouts = []
    for tp in tp_degrees(job, ms.model, gpus):
        for pp in pp_degrees(job, ms, gpus // tp):
            if gpus % (tp * pp) and gpus > tp * pp * seqs:
                continue
            dp = min(gpus // (tp * pp), seqs)
            if dp < 1:
                continue
            eps = ep_degrees(job, ms.model, dp)
            if ms.stage == "generation":
                layouts.extend(generation_layout(tp, pp, dp, ep) for ep in eps)
                continue
            per_replica = -(-seqs // dp)
            mbs_options = [opts.micro_batch_size] if isinstance(opts.micro_batch_size, int) else [
                b for b in MICRO_BATCH_SIZES if b <= per_replica]
            if ms.stage == "training" and pp > 1:
                chunks = job.models[ms.model].layers // pp
                v_options = ([opts.interleave] if isinstance(opts.interleave, int)
                             else [v for v in divisors(chunks) if v <= MAX_INTERLEAVE])
            else:
                v_options = [1]
            stage_recomputes = recomputes if ms.stage == "training" else ("none",)
            fsdp_options = (False, True) if opts.fsdp == "auto" and dp > 1 else (bool(opts.fsdp) and dp > 1,)
            for ep, mbs, v, rc, fsdp in itertools.product(eps, mbs_options, v_options, stage_recomputes,
                                                          fsdp_options):
                layouts.append(Layout(tp=tp, pp=pp, dp=dp, ep=ep, micro_batch_size=mbs, interleave=v, recompute=rc,
                                      sequence_parallel=opts.sequence_parallel and tp > 1,
                                      zero1=opts.zero1 and ms.stage == "training" and not fsdp, fsdp=fsdp,
                                      max_token_len=planned_token_budget(job, ms, mbs)))
    return layouts


def pareto(costs: list[StageCost], factors: dict[str, float] | None) -> list[tuple[float, StageCost]]:
    """Costs no other beats on time, resident and transient memory at once, fastest first."""
    ranked = sorted(((c.time(factors), c) for c in costs), key=lambda tc: (tc[0], tc[1].peak_bytes))
    kept: list[tuple[float, StageCost]] = []
    for t, c in ranked:
        if all(c.resident_bytes < k.resident_bytes or c.transient_bytes < k.transient_bytes for _, k in kept):
            kept.append((t, c))
    return kept


class CandidateTable:
    """Costed, Pareto-pruned layouts per (model-stage, GPU count), computed once per search."""

    def __init__(self, hw: Hardware, job: JobSpec, factors: dict[str, float] | None = None,
                 layout_filter: Callable[[ModelStage, Layout], bool] | None = None) -> None:
        self.hw, self.job, self.factors = hw, job, factors
        self.layout_filter = layout_filter
        self.evaluated = 0
        self._get = lru_cache(maxsize=None)(self._compute)
        self._gen = lru_cache(maxsize=None)(self._generation)
        self._alone: dict[tuple[ModelStage, int], list[StageCost]] = {}

    def layouts(self, ms: ModelStage, gpus: int) -> list[Layout]:
        layouts = enumerate_layouts(self.job, ms, gpus)
        if self.layout_filter is None:
            return layouts
        return [lay for lay in layouts if self.layout_filter(ms, lay)]

    def get(self, ms: ModelStage, gpus: int) -> list[tuple[float, StageCost]]:
        return self._get(ms, gpus)

    def _compute(self, ms: ModelStage, gpus: int) -> list[tuple[float, StageCost]]:
        usable = self.hw.usable_bytes()
        costs = []
        for layout in self.layouts(ms, gpus):
            self.evaluated += 1
            cost = stage_cost(self.hw, self.job, ms, layout)
            if cost is not None and cost.peak_bytes <= usable:
                costs.append(cost)
        return pareto(costs, self.factors)

    def generation(self, ms: ModelStage, gpus: int, others_gib: int) -> tuple[float, StageCost] | None:
        """Fastest generation layout when colocated models hold ``others_gib`` GiB per device."""
        return self._gen(ms, gpus, others_gib)

    def _generation(self, ms: ModelStage, gpus: int, others_gib: int) -> tuple[float, StageCost] | None:
        others = others_gib * 2**30
        best = None
        for alone in self._gen_alone(ms, gpus):
            # Colocated models only matter when they squeeze the KV cache below what the batch uses.
            cost = alone
            if alone.peak_bytes + others > self.hw.usable_bytes() * self.hw.priors.kv_memory_fraction:
                self.evaluated += 1
                cost = stage_cost(self.hw, self.job, ms, alone.layout, others)
            if cost is None or cost.detail.get("infeasible"):
                continue
            t = cost.time(self.factors)
            if best is None or t < best[0]:
                best = (t, cost)
        return best

    def _gen_alone(self, ms: ModelStage, gpus: int) -> list[StageCost]:
        key = (ms, gpus)
        if key not in self._alone:
            self._alone[key] = []
            for layout in self.layouts(ms, gpus):
                self.evaluated += 1
                cost = stage_cost(self.hw, self.job, ms, layout)
                if cost is not None:
                    self._alone[key].append(cost)
        return self._alone[key]

    def min_memory(self, ms: ModelStage, gpus: int) -> tuple[float, Layout | None]:
        """Smallest per-device peak over all layouts, feasible or not (for error messages)."""
        best: tuple[float, Layout | None] = (float("inf"), None)
        for layout in self.layouts(ms, gpus):
            cost = stage_cost(self.hw, self.job, ms, layout)
            if cost is not None and cost.peak_bytes < best[0]:
                best = (cost.peak_bytes, layout)
        return best

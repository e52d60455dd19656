"""Build the transition plan between two plans of a job: every model and stage at once, as typed steps
(``nereus.elastic.plan``). Groups and situations (``groups``, ``geometry``) say what each device keeps,
re-slices and must receive; ``assign`` picks the sources; memory planning picks detours; ``ops`` emits the
steps. Data edges run alloc → copy/send → commit; memory edges run free_early → alloc and
free → alloc_grads.
"""

from __future__ import annotations

from dataclasses import dataclass

from nereus.cost.hardware import Hardware
from nereus.elastic.assign import Assigner, Need
from nereus.elastic.emu import check_plan, placement_states
from nereus.elastic.errors import TransitionMemoryError
from nereus.elastic.geometry import Holder, Situation, SourceKey, StateGeometry, device_slots
from nereus.elastic.groups import ModelGroups, TensorGroup
from nereus.elastic.links import Links
from nereus.elastic.ops import Bundle, emit_steps
from nereus.elastic.plan import BandwidthInputs, BundleBytes, SourceSet, StateSize, TransitionPlan
from nereus.spec.errors import SpecError
from nereus.spec.job import JobSpec
from nereus.spec.layout import Plan

MIB = 2**20
GIB = 2**30
# Default chunk: staging buffers of 256 MiB at each end of a transfer are 0.3% of an 80 GB device, and
# large enough that per-chunk latency (~10 µs, Hardware priors) costs < 0.1% at 50 GB/s.
DEFAULT_CHUNK_BYTES = 256 * MIB
# Host memory a device may fill with detour copies: a DGX A100 has 1–2 TB of system memory for 8 GPUs,
# a DGX H100 2 TB (NVIDIA DGX datasheets); 128 GiB per GPU leaves room for the rest of the host.
DEFAULT_HOST_BYTES_PER_DEVICE = 128 * GIB


@dataclass(frozen=True)
class TransitionOptions:
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    host_bytes_per_device: float = DEFAULT_HOST_BYTES_PER_DEVICE
    # Process groups are created ahead of the move while the old layout still runs, so by
    # default they cost nothing on the critical path; set this to charge each new layout's groups.
    group_setup_s: float = 0.0


def _holders(job: JobSpec, plan: Plan) -> dict[tuple[str, str], list[Holder]]:
    out: dict[tuple[str, str], list[Holder]] = {}
    for i, p in enumerate(plan.placements):
        for kind, zero in placement_states(job, p):
            out.setdefault((p.model_stage.model, kind.name), []).append(Holder(i, p, zero))
    return out


def _state_kinds(job: JobSpec, old: Plan, new: Plan) -> dict[str, object]:
    kinds = {}
    for plan in (old, new):
        for p in plan.placements:
            for kind, _ in placement_states(job, p):
                kinds[kind.name] = kind
    return kinds


class _Builder:
    def __init__(self, job: JobSpec, old: Plan, new: Plan, hw: Hardware, options: TransitionOptions):
        self.job, self.old, self.new, self.hw, self.opt = job, old, new, hw, options
        self.n = max(old.num_gpus, new.num_gpus)
        self.gpn = job.cluster.gpus_per_node
        self.usable = hw.usable_bytes()
        self.groups: list[TensorGroup] = []
        self.bundles: dict[tuple[int, str, str], Bundle] = {}
        self.holders_old = _holders(job, old)
        self.holders_new = _holders(job, new)
        self.geometry: dict[tuple[str, str], StateGeometry] = {}
        self._candidates: dict[tuple, list[int]] = {}
        self._per_device: tuple[list[int], list[int], list[int], list[int]] | None = None

    def state_groups(self, model: str, old: list[Holder], new: list[Holder]) -> ModelGroups:
        """Groups of one model state, cut only by the pipelines of the placements that hold it (the
        optimizer follows the training layouts alone, so its groups are coarser than the weights')."""
        pipes = [h.pipeline for h in old + new]
        mg = ModelGroups(model, self.job.models[model], self.job.has_value_head(model), pipes, len(self.groups),
                         singletons=any(h.zero for h in old + new))
        self.groups += mg.groups
        return mg

    def situations(self) -> None:
        kinds = _state_kinds(self.job, self.old, self.new)
        for model in self.job.models:
            for name, kind in kinds.items():
                old = self.holders_old.get((model, name), [])
                new = self.holders_new.get((model, name), [])
                if not old and not new:
                    continue
                if new and not old and kind.carries_data:
                    where = next(i for i, p in enumerate(self.new.placements) if p.model_stage.model == model)
                    raise SpecError(f"to.placements[{where}]", f"{model}'s {name} has no source: the old plan "
                                                                f"holds no {name} of {model}")
                geo = StateGeometry(self.state_groups(model, old, new), kind, old, new)
                self.geometry[(model, name)] = geo
                old_slots, new_slots = device_slots(old), device_slots(new)
                solved: dict[tuple, Situation] = {}
                for g in sorted(set(old_slots) | set(new_slots)):
                    key = (old_slots.get(g, ()), new_slots.get(g, ()))
                    if key not in solved:
                        solved[key] = geo.solve(*key)
                    self.bundles[(g, model, name)] = Bundle(g, model, name, kind.carries_data, solved[key])

    def candidates(self, key: SourceKey, model: str, state: str) -> list[int]:
        """Devices holding the cells of ``key`` in the old plan (cached: many devices share a key)."""
        k = (key, model, state)
        if k not in self._candidates:
            self._candidates[k] = self._holders_of(key, model, state)
        return self._candidates[k]

    def _holders_of(self, key: SourceKey, model: str, state: str) -> list[int]:
        holders = self.geometry[(model, state)].old
        devices = set()
        for hi, s, ts, r in key:
            h = holders[hi]
            for rr in (range(h.placement.layout.dp) if r is None else (r,)):
                for t in ts:
                    devices.add(h.device(s, rr, t))
        return sorted(devices)

    def per_device(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """Resident bytes before and after, bytes freed early (grads) and allocated before commit
        (computed once: the bundles do not change after ``situations``)."""
        if self._per_device is None:
            self._per_device = self._sum_per_device()
        return self._per_device

    def _sum_per_device(self) -> tuple[list[int], list[int], list[int], list[int]]:
        old, new, early, alloc = ([0] * self.n for _ in range(4))
        for (g, _, _), b in self.bundles.items():
            old[g] += b.situation.old_bytes
            new[g] += b.situation.new_bytes
            if b.carries_data:
                alloc[g] += b.alloc_bytes
            else:
                early[g] += b.free_bytes
        return old, new, early, alloc

    def plan_memory(self) -> set[tuple[int, str, str]]:
        """Check every device before, during and after; pick memory detours where old and new state
        do not fit together. Returns the bundles to offload."""
        old, new, early, alloc = self.per_device()
        chunk = self.opt.chunk_bytes
        tight = any(old[g] - early[g] + alloc[g] + chunk > self.usable for g in range(self.n))
        busy = self.transfer_bytes() if tight else {}  # exact staging reserves only where memory is tight
        offload: set[tuple[int, str, str]] = set()
        for g in range(self.n):
            if old[g] > self.usable:
                raise TransitionMemoryError(g, old[g], self.usable, "the old plan itself")
            if new[g] > self.usable:
                raise TransitionMemoryError(g, new[g], self.usable, "the new plan's state")
            staging = min(chunk, busy.get(g, 0)) if tight else chunk
            need = old[g] - early[g] + alloc[g] + staging
            if need <= self.usable:
                continue
            movable = sorted((b for (d, _, _), b in self.bundles.items() if d == g and b.carries_data
                              and b.free_bytes > 0), key=lambda b: -b.free_bytes)
            host = 0
            for b in movable:
                if need <= self.usable:
                    break
                offload.add((g, b.model, b.state))
                b.offloaded = True
                need -= b.free_bytes
                host += b.free_bytes
            if need > self.usable:
                raise TransitionMemoryError(g, need, self.usable, "the new state beside what it keeps, with one "
                                                                  "chunk of staging (even after moving every old "
                                                                  "buffer it can to host memory)")
            if host > self.opt.host_bytes_per_device:
                raise TransitionMemoryError(g, host, self.opt.host_bytes_per_device, "host memory for the old "
                                                                                     "buffers moved off the GPU")
        return offload

    def transfer_bytes(self) -> dict[int, int]:
        """Per device that may send or receive, the most bytes one of its transfers can carry (all it
        receives, or all its candidate keys could ask of it): its staging never exceeds that."""
        most: dict[int, int] = {}
        per_key: dict[tuple, int] = {}
        for (g, model, name), b in self.bundles.items():
            if b.situation.needs:
                most[g] = most.get(g, 0) + sum(b.situation.need_bytes.values())
                for key, nbytes in b.situation.need_bytes.items():
                    per_key[(key, model, name)] = per_key.get((key, model, name), 0) + nbytes
        sources: dict[int, int] = {}
        for k, nbytes in per_key.items():
            for c in self.candidates(*k):
                sources[c] = sources.get(c, 0) + nbytes
        for c, nbytes in sources.items():
            most[c] = max(most.get(c, 0), nbytes)
        return most

    def needs(self) -> list[Need]:
        return [Need(g, model, name, key, pieces, b.situation.need_bytes[key])
                for (g, model, name), b in self.bundles.items() for key, pieces in b.situation.needs.items()]


def build_graph(job: JobSpec, old: Plan, new: Plan, hw: Hardware | None = None,
                options: TransitionOptions | None = None) -> TransitionPlan:
    """The transition graph from plan ``old`` to plan ``new`` of ``job`` (all model-stages at once).

    Raises ``SpecError`` for plans the job cannot hold and ``TransitionMemoryError`` naming the device,
    the bytes needed and the capacity when the new state cannot fit even with chunking and detours.
    """
    hw = hw or Hardware(job.cluster)
    options = options or TransitionOptions()
    if options.chunk_bytes < 1:
        raise SpecError("chunk_bytes", f"must be >= 1, got {options.chunk_bytes}")
    n = max(old.num_gpus, new.num_gpus)
    if n > job.cluster.num_gpus:
        raise SpecError("plan.num_gpus", f"{n} GPUs exceed the job's cluster of {job.cluster.num_gpus}; "
                                         f"give the job a cluster that large")
    check_plan(job, old, "from")
    check_plan(job, new, "to")
    b = _Builder(job, old, new, hw, options)
    b.situations()
    offloaded = b.plan_memory()
    links = Links.of(hw)
    assigner = Assigner(b.gpn, b.candidates, offloaded, b.n, options.chunk_bytes, links.nvlink, links.ib)
    needs = b.needs()
    choices = assigner.assign(needs)
    emitted = emit_steps(b.bundles, choices, old, new, options.chunk_bytes)
    old_bytes, new_bytes, _, _ = b.per_device()
    return TransitionPlan(
        emitted.steps, tuple(g.record() for g in b.groups), b.n, b.gpn, b.usable, options.chunk_bytes,
        tuple(old_bytes), tuple(new_bytes), lower_bound_bytes=sum(c.need.bytes for c in choices),
        detours=emitted.detours, group_setup_s=options.group_setup_s,
        bundles=tuple(BundleBytes(g, m, st, x.situation.old_bytes, x.situation.new_bytes, x.situation.retained_bytes)
                      for (g, m, st), x in b.bundles.items()),
        state_bytes=_state_sizes(b), bandwidth=_bandwidth_inputs(b, needs))


def _state_sizes(b: _Builder) -> dict[str, StateSize]:
    """Bytes and tensor count of one full copy of each data-carrying model state (for the baselines)."""
    out = {}
    for (model, state), geo in b.geometry.items():
        if geo.kind.carries_data:
            groups = geo.groups.groups
            out[f"{model}/{state}"] = StateSize(sum(g.elements * g.count for g in groups) * geo.kind.bytes_per_element,
                                                sum(g.count for g in groups))
    return out


def _bandwidth_inputs(b: _Builder, needs: list[Need]) -> BandwidthInputs:
    """What any schedule must carry: per device, bytes to receive (and the part no holder on its node
    has) and bytes to copy locally; per set of holders, bytes only they hold (and the part bound for
    nodes where none of them sits)."""
    recv, far, local = ([0] * b.n for _ in range(3))
    sources: dict[tuple, list[int]] = {}
    nodes_of: dict[tuple, set[int]] = {}
    for need in needs:
        k = (need.key, need.model, need.state)
        if k not in nodes_of:
            nodes_of[k] = {c // b.gpn for c in b.candidates(*k)}
            sources[k] = [0, 0]
        recv[need.dst] += need.bytes
        sources[k][0] += need.bytes
        if need.dst // b.gpn not in nodes_of[k]:
            far[need.dst] += need.bytes
            sources[k][1] += need.bytes
    merged: dict[tuple[int, ...], list[int]] = {}  # keys with the same holder set add up
    for k, (total, far_bytes) in sources.items():
        entry = merged.setdefault(tuple(b.candidates(*k)), [0, 0])
        entry[0] += total
        entry[1] += far_bytes
    for (g, _, _), bundle in b.bundles.items():
        local[g] += bundle.situation.local_bytes
    return BandwidthInputs(tuple(recv), tuple(far), tuple(local), _nested_source_sets(merged))


# Holder sets up to this size are checked against each other; larger ones (replicated state, held by
# many devices) never bound the time, and comparing them would cost O(sets² · size).
SMALL_SOURCE_SET = 64


def _nested_source_sets(merged: dict[tuple[int, ...], list[int]]) -> tuple[SourceSet, ...]:
    """For each small holder set S, the bytes of every key whose holders all lie in S: S's links must
    carry them all, whichever of its devices sends each piece."""
    small = [(frozenset(devs), tot) for devs, tot in merged.items() if len(devs) <= SMALL_SOURCE_SET]
    by_first: dict[int, list[tuple[frozenset, list[int]]]] = {}
    for s, tot in small:
        by_first.setdefault(min(s), []).append((s, tot))
    out = []
    for s, _ in small:
        total = far_bytes = 0
        for d in s:  # a subset of S has its smallest device in S
            for other, (t, f) in by_first.get(d, ()):
                if other <= s:
                    total += t
                    far_bytes += f
        out.append(SourceSet(len(s), total, far_bytes))
    return tuple(out)


__all__ = ["TransitionOptions", "TransitionPlan", "build_graph"]

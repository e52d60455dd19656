"""Elastic Model Units: the distributed state of one replica of one model-stage, as plain data.

For every tensor of a model-stage — its weights, and for a training stage also the fp32 master weights
with Adam's two moments (ZeRO-1 shards them over data parallelism) and the gradient buffers — an EMU
lists the global shape, dtype and the shards as (device, global boxes). Where each shard lives is the
contract of ``nereus.spec.sharding``, the same one the runtime builds its shards from.

Coverage: a replica's weight shards cover each tensor once, up to identical copies on tensor-parallel
ranks (norms, and K/V heads when TP exceeds the KV heads). With ZeRO-1 each replica owns 1/dp of the
optimizer state (``sharding.zero_shards``); the replicas of a model-stage together cover it once. With
FSDP (``Layout.fsdp``, ZeRO-3) weights and gradient buffers are sharded the same way. Under expert
parallelism a replica holds only its EP rank's routed experts (``sharding.holds``): the ``ep`` replicas of
an EP group together cover each expert once.
"""

from __future__ import annotations

from dataclasses import dataclass

from nereus.cost.memory import BF16, OPTIMIZER_BYTES_PER_PARAM
from nereus.elastic.boxes import BoxSet, set_volume
from nereus.spec.errors import SpecError
from nereus.spec.job import JobSpec
from nereus.spec.layout import Layout, ModelStage, Placement, Plan
from nereus.spec.parallel_dims import layer_problem, split_problem
from nereus.spec.sharding import box_volume, holds, model_tensors, tensor_stage, tp_box, zero_shards


@dataclass(frozen=True)
class StateKind:
    """One kind of per-tensor state. ``carries_data`` is False for gradient buffers: they are zeroed at
    every step, so a transition frees and allocates them but moves nothing."""

    name: str
    dtype: str
    bytes_per_element: int
    components: tuple[str, ...]
    carries_data: bool = True


WEIGHTS = StateKind("weights", "bfloat16", BF16, ("weight",))
# Mixed-precision Adam keeps three fp32 tensors per weight that share one shard layout (cost.memory).
OPTIMIZER = StateKind("optimizer", "float32", OPTIMIZER_BYTES_PER_PARAM, ("master", "exp_avg", "exp_avg_sq"))


def weights_kind(weight_bytes: int) -> StateKind:
    """Weights as the job computes in them (``options.weight_bytes``: bf16 on GPUs, fp32 on CPU workers)."""
    return WEIGHTS if weight_bytes == BF16 else StateKind("weights", "float32", weight_bytes, ("weight",))


def grads_kind(grad_bytes: int) -> StateKind:
    return StateKind("grads", "float32" if grad_bytes == 4 else "bfloat16", grad_bytes, ("main_grad",), False)


def placement_states(job: JobSpec, p: Placement) -> tuple[tuple[StateKind, bool], ...]:
    """(state, sharded over DP) held by a placement: weights always (sharded under FSDP); training adds
    the optimizer state (sharded under ZeRO-1 or FSDP) and gradient buffers (sharded under FSDP)."""
    lay = p.layout
    weights = weights_kind(job.options.weight_bytes)
    if p.model_stage.stage != "training":
        return ((weights, lay.fsdp),)
    return ((weights, lay.fsdp), (OPTIMIZER, lay.zero1 or lay.fsdp), (grads_kind(job.options.grad_bytes), lay.fsdp))


@dataclass(frozen=True)
class Shard:
    device: int
    boxes: BoxSet

    def to_dict(self) -> dict:
        return {"device": self.device, "boxes": [list(map(list, b)) for b in self.boxes]}


@dataclass(frozen=True)
class TensorState:
    name: str
    state: str
    shape: tuple[int, ...]
    dtype: str
    bytes_per_element: int
    shards: tuple[Shard, ...]

    def to_dict(self) -> dict:
        return {"name": self.name, "state": self.state, "shape": list(self.shape), "dtype": self.dtype,
                "bytes_per_element": self.bytes_per_element, "shards": [s.to_dict() for s in self.shards]}


@dataclass(frozen=True)
class EMU:
    model_stage: ModelStage
    replica: int
    layout: Layout
    devices: tuple[int, ...]
    tensors: tuple[TensorState, ...]

    def bytes_per_device(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for t in self.tensors:
            for s in t.shards:
                out[s.device] = out.get(s.device, 0) + set_volume(s.boxes) * t.bytes_per_element
        return out

    def to_dict(self) -> dict:
        return {"model_stage": str(self.model_stage), "replica": self.replica, "layout": self.layout.to_dict(),
                "devices": list(self.devices), "tensors": [t.to_dict() for t in self.tensors]}


def _nonempty(box: tuple) -> tuple:
    """A TP shard as a box set; empty when a dimension has fewer elements than TP ranks."""
    return (box,) if box_volume(box) else ()


def replica_devices(p: Placement, replica: int) -> tuple[int, ...]:
    dims = p.layout.dims
    return tuple(p.gpus[dims.rank(s, replica, t)] for s in range(dims.pp) for t in range(dims.tp))


def placement_emus(job: JobSpec, p: Placement) -> list[EMU]:
    """One EMU per data-parallel replica of a placement, every tensor of every state listed."""
    model = p.model_stage.model
    arch, value_head = job.models[model], job.has_value_head(model)
    lay = p.layout
    dims = lay.dims
    specs = model_tensors(arch, value_head)
    stages = [tensor_stage(t, arch, dims.pp) for t in specs]
    emus = []
    for r in range(dims.dp):
        parts = {(s, t): zero_shards(arch, dims, s, t, r, value_head) for s in range(dims.pp) for t in range(dims.tp)}
        tensors = []
        for kind, sharded in placement_states(job, p):
            for spec, s in zip(specs, stages, strict=True):
                held = holds(spec, arch, dims, r)  # under EP, only this replica's experts
                shards = tuple(Shard(p.gpus[dims.rank(s, r, t)], parts[(s, t)].get(spec.name, ()) if sharded
                                     else _nonempty(tp_box(spec, arch, dims.tp, t)) if held else ())
                               for t in range(dims.tp))
                tensors.append(TensorState(spec.name, kind.name, spec.shape, kind.dtype, kind.bytes_per_element,
                                           tuple(sh for sh in shards if sh.boxes)))
        emus.append(EMU(p.model_stage, r, lay, replica_devices(p, r), tuple(tensors)))
    return emus


def build_emus(job: JobSpec, plan: Plan) -> list[EMU]:
    """Every EMU of a plan (per tensor: use for small jobs, tests and a worker's own shards; the graph
    builder works on groups of identically sharded tensors instead)."""
    check_plan(job, plan)
    return [e for p in plan.placements for e in placement_emus(job, p)]


def device_buffers(job: JobSpec, plan: Plan) -> dict[int, dict[tuple[str, str, str], set[BoxSet]]]:
    """Per device, the distinct buffers held: (model, state, tensor) → box sets. Two model-stages of one
    model holding the same shard on one device share it, as the cost model counts them once."""
    out: dict[int, dict[tuple[str, str, str], set[BoxSet]]] = {}
    for emu in build_emus(job, plan):
        for t in emu.tensors:
            for s in t.shards:
                out.setdefault(s.device, {}).setdefault((emu.model_stage.model, t.state, t.name), set()).add(s.boxes)
    return out


def check_plan(job: JobSpec, plan: Plan, where: str = "plan") -> None:
    """Refuse a plan whose layouts the sharding contract cannot place, naming the field: TP over whole heads
    (``spec.parallel_dims.split_problem``), a layer for every virtual pipeline stage (uneven stages place)."""
    for i, p in enumerate(plan.placements):
        path = f"{where}.placements[{i}]"
        model = p.model_stage.model
        if model not in job.models:
            raise SpecError(f"{path}.model_stage", f"model {model!r} is not in the job ({sorted(job.models)})")
        arch, lay = job.models[model], p.layout
        problem = (split_problem(arch, lay.tp, lay.ep, dp=lay.dp)
                   or layer_problem(arch.layers, lay.pp, lay.interleave, runnable=False))
        if problem is not None:
            raise problem.at(f"{path}.layout")
        if max(p.gpus) >= job.cluster.num_gpus:
            raise SpecError(f"{path}.gpus", f"GPU {max(p.gpus)} is beyond the cluster's {job.cluster.num_gpus} GPUs")

"""Live transitions of a worker's model shards: every runtime key (a model-stage, or several stages of one
model sharing a layout) moves from its old layout to its new one in one graph, weights and Adam state.

``KeySpec`` is the plain description of one key's placement, the same on every rank. ``plan_of`` turns a
list of them into the ``Plan`` the transition graph is built from, so the executor moves exactly what the
graph planned. ``transition_keys`` runs on every rank of the world (a Ray worker, or a forked rank in
tests and benchmarks): it views the rank's old shards as ``Holdings``, lists the buffers its new keys
need, runs the ``Execution`` and installs new ``ShardedModel``\\ s (with their ``ShardedAdam``) around the
new buffers. New buffers identical on one device for two keys of a model are one tensor, as the graph
counts them once. The new layouts' process groups are created by the caller beforehand.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nereus.elastic.plan import TransitionPlan
from nereus.runtime.comm.faults import FaultHook
from nereus.runtime.comm.groups import ParallelGroups
from nereus.runtime.comm.transfer import TransferComm
from nereus.runtime.model.decoder import ModelConfig
from nereus.runtime.model.dtypes import torch_dtype
from nereus.runtime.parallel.dp import AdamFacts
from nereus.runtime.parallel.sharded import ShardedModel, shard_boxes, tied_head
from nereus.runtime.transitions.executor import Execution, NewBuffers, TransferMeasures, new_tensor
from nereus.runtime.transitions.holdings import (
    OPTIMIZER,
    WEIGHTS,
    BufferKey,
    Holdings,
    extent,
    holdings_of,
    optimizer_boxes,
    weight_boxes,
    weight_buffers,
)
from nereus.spec.layout import Layout, ModelStage, Placement, Plan


@dataclass(frozen=True)
class KeySpec:
    """One runtime key: the model it holds, the stage it stands for in the plan, its layout and ranks."""

    key: str
    model: str
    stage: str
    cfg: ModelConfig
    layout: Layout
    ranks: tuple[int, ...]
    dtype: str = "float32"

    @property
    def training(self) -> bool:
        return self.stage == "training"


@dataclass(frozen=True)
class TransitionAnswer:
    """One worker's answer to a transition (``Worker.transition``): committed (``ok``) or the error, its
    wall time, and what it measured (None when it failed: every worker then keeps its old shards)."""

    ok: bool
    error: str
    wall_s: float
    measured: TransferMeasures | None = None


@dataclass(frozen=True)
class MoveResult:
    """A transition or weight sync over the world (``Runtime.transition``, ``Runtime.sync_weights``): the
    slowest worker's wall time, each worker's measurements by rank, and the graph it ran (None when there
    was nothing to move)."""

    wall_s: float
    workers: tuple[TransferMeasures, ...] = ()
    graph: TransitionPlan | None = None


def plan_of(specs: list[KeySpec], world: int) -> Plan:
    return Plan(tuple(Placement(ModelStage(s.model, s.stage), s.layout, tuple(s.ranks)) for s in specs), world)


def new_needs(specs: list[KeySpec], groups: dict[str, ParallelGroups]) -> dict[BufferKey, tuple[torch.dtype, ...]]:
    """Buffer key → component dtypes of every buffer this rank's new keys hold."""
    needs: dict[BufferKey, tuple[torch.dtype, ...]] = {}
    for s in specs:
        g = groups[s.key]
        if not g.member:
            continue
        for name, bset in weight_buffers(s.cfg, g):
            needs[(s.model, WEIGHTS, name, bset)] = (torch_dtype(s.dtype),)
        if s.training:
            for name, bset in optimizer_boxes(s.cfg, g):
                needs[(s.model, OPTIMIZER, name, bset)] = (torch.float32,) * 3
    return needs


def _adam_facts(old: dict[str, ShardedModel], specs: list[KeySpec], comm: TransferComm) -> dict[str, AdamFacts]:
    """Per trained model: its Adam settings and step count, agreed over all ranks (a rank new to the
    model's training layout holds no old optimizer to read them from)."""
    mine = {}
    for s in specs:
        sm = old.get(s.key)
        if s.training and sm is not None:
            opt = sm.optimizer or sm.make_optimizer()
            opt.ensure_state()
            mine[s.model] = opt.facts()
    facts: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(facts, mine, group=comm.control)
    out: dict[str, AdamFacts] = {}
    for f in facts:
        out.update(f)
    return out


def _fill_tied_heads(models: list[ShardedModel], comm: TransferComm) -> None:
    """Each first pipeline stage sends its (new) embedding rows to its last stage's ``tied_head``:
    point to point with the transfer timeout, so a failed peer cannot hang the install."""
    ops = []
    for sm in models:
        g = sm.groups
        if g.embed_group is None or not tied_head(sm.cfg):
            continue
        if g.first_stage:
            ops.append(dist.P2POp(dist.isend, sm.embedding_weight().data, g.pp_peer(g.layout.pp - 1),
                                  group=comm.transfer))
        if g.last_stage:
            ops.append(dist.P2POp(dist.irecv, sm.model.tied_head.data, g.pp_peer(0), group=comm.transfer))
    if ops:
        comm.wait(dist.batch_isend_irecv(ops))


def _new_weights(s: KeySpec, g: ParallelGroups, h: Holdings) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """A new key's weights from the new buffers: its tensors by name, or under ZeRO-3 none and its range
    (the buffers of the tensors the range touches, end to end)."""
    if s.layout.fsdp:
        buffers = [h.get((s.model, WEIGHTS, name, bset)) for name, bset in weight_buffers(s.cfg, g)]
        return {}, torch.cat([b.comps[0] for b in buffers])
    return {name: new_tensor(h.get((s.model, WEIGHTS, name, (box,))), box)
            for name, box in weight_boxes(s.cfg, g).items()}, None


def installer(specs: list[KeySpec], groups: dict[str, ParallelGroups], adam: dict[str, AdamFacts], schedule: str,
             comm: TransferComm) -> Callable[[Holdings], dict[str, ShardedModel]]:
    def install(h: Holdings) -> dict[str, ShardedModel]:
        models = {}
        for s in specs:
            g = groups[s.key]
            if not g.member:
                continue
            tensors, zero3 = _new_weights(s, g, h)
            box = shard_boxes(s.cfg, g).get("tied_head")
            if box is not None:  # filled from the first stage's embedding below (_fill_tied_heads)
                tensors["tied_head"] = torch.empty(extent(box), dtype=torch_dtype(s.dtype), device=g.device)
            sm = ShardedModel(s.cfg, g, tensors, dtype=torch_dtype(s.dtype), schedule=schedule, assign=True,
                              zero3_weights=zero3)
            if s.training and s.model in adam:
                facts = adam[s.model]
                opt = sm.make_optimizer(init_master=False, **facts.settings())
                bufs = [h.get((s.model, OPTIMIZER, name, bset)) for name, bset in optimizer_boxes(s.cfg, g)]
                opt.install_state([b.comps[0] for b in bufs], [b.comps[1] for b in bufs],
                                  [b.comps[2] for b in bufs], facts.step)
            models[s.key] = sm
        _fill_tied_heads(list(models.values()), comm)
        return models
    return install


def transition_keys(graph: TransitionPlan, old: dict[str, ShardedModel], old_specs: list[KeySpec],
                    new_specs: list[KeySpec], new_groups: dict[str, ParallelGroups], comm: TransferComm,
                    faults: FaultHook | None = None, schedule: str = "1f1b",
                    fault_scope: str = "transition") -> tuple[dict[str, ShardedModel], TransferMeasures]:
    """This rank's new shards (key → ``ShardedModel``) once every rank committed; raises
    ``TransitionExecutionError`` on every rank otherwise, ``old`` untouched. ``old``: this rank's shards by
    key (keys of ``old_specs``); ``new_groups``: every new key's groups, created by all ranks beforehand.
    ``fault_scope``: the fault points' prefix (``"sync"`` for a weight sync, ``comm.faults``)."""
    adam = _adam_facts(old, old_specs, comm)
    held = Holdings()
    dtypes: dict[str, torch.dtype] = {}
    for s in old_specs + new_specs:
        dtypes.setdefault(s.model, torch_dtype(s.dtype))
    for s in old_specs:
        if s.key in old:
            holdings_of(s.model, old[s.key], into=held)
    resident = [sm.model.tied_head for sm in old.values() if sm.model.tied_head is not None]
    device = next((g.device for g in new_groups.values()), torch.device("cpu"))
    ex = Execution(graph, held, NewBuffers(new_needs(new_specs, new_groups), device), comm, dtypes, faults, resident,
                   fault_scope)
    models = ex.run(installer(new_specs, new_groups, adam, schedule, comm))
    ex.resident = [sm.model.tied_head for sm in models.values() if sm.model.tied_head is not None]
    ex.finish()
    return models, ex.measured


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are views of the very same elements (storage, offset, shape, strides, dtype)."""
    return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.dtype == b.dtype
            and a.storage_offset() == b.storage_offset() and a.shape == b.shape and a.stride() == b.stride())


def follows(target: ShardedModel, source: ShardedModel | None) -> bool:
    """Whether every parameter of ``target`` (tied copies included) is the very memory of ``source``'s
    parameter of the same name, so that ``source``'s in-place updates (Adam) are ``target``'s too and a
    weight sync between them would move nothing. The executor aliases a box only onto the same box, so
    aliasing implies that each tensor holds the box the sync would give it."""
    if source is None:
        return False
    mine = dict(source.model.named_parameters())
    return all(name in mine and same_memory(p, mine[name]) for name, p in target.model.named_parameters())


def rebuild(sm: ShardedModel, groups: ParallelGroups) -> ShardedModel:
    """``sm`` on new process groups of the same layout (after the world was re-formed): the same
    parameter tensors adopted, the same Adam segments, moments and step count handed over."""
    tensors = {name: p.data for name, p in sm.model.named_parameters()}  # under ZeRO-3 a tied head at most
    zero3 = sm.zero3.weights if sm.zero3 is not None else None
    new = ShardedModel(sm.cfg, groups, tensors, dtype=sm.dtype, schedule=sm.schedule, assign=True,
                       zero3_weights=zero3)
    old = sm.optimizer
    if old is not None:
        old.ensure_state()
        opt = new.make_optimizer(init_master=False, **old.hyper)
        avg, sq, step = old.moments() or ([], [], None)
        opt.install_state(old.master, avg, sq, step)
    return new

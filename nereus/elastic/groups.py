"""Groups of identically sharded tensors: the unit the transition graph works on.

Two tensors of a model belong to one group (per model state) when every layout holding that state in
either plan gives them the same boxes (same shape, split dimension and unit) on the same pipeline
stage. An 8B Llama's 291 weights fall into
a few dozen groups (q/k·v/o/gate·up/down/norms per run of layers that share stages), so the graph is
built per group and per device situation instead of per tensor and device, and stays exact: a piece of
a group applies the same box to every member tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from nereus.elastic.boxes import BoxSet
from nereus.elastic.plan import Group
from nereus.spec.model import ModelArch
from nereus.spec.sharding import Box, TensorSpec, model_tensors, tensor_stage, tp_box

Pipeline = int  # the PP degree: all a tensor's stage depends on (interleaving does not move layers)


def box_class(spec: TensorSpec) -> tuple:
    """What a tensor's boxes depend on besides the layout (see ``sharding.tp_box``): its shape, the
    dimension TP splits and the unit it splits it into."""
    return (spec.shape, spec.tp_dim, spec.unit)


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one object per group
class TensorGroup:
    id: int
    model: str
    names: tuple[str, ...]
    spec: TensorSpec  # the first member; every member has the same boxes under every layout
    stages: dict[Pipeline, int]
    cls: tuple = ()  # box_class(spec), kept to avoid recomputing it
    count: int = 0  # len(names)

    @property
    def elements(self) -> int:
        n = 1
        for d in self.spec.shape:
            n *= d
        return n

    def record(self) -> Group:
        """The group as the transition plan names it (what an executor needs: the member tensors)."""
        return Group(self.id, self.model, self.names, tuple(self.spec.shape))


class ModelGroups:
    """The groups of one model for a set of pipelines (every (pp, interleave) either plan uses)."""

    def __init__(self, model: str, arch: ModelArch, value_head: bool, pipelines: list[Pipeline], first_id: int,
                 singletons: bool = False):
        """``singletons``: one group per tensor, for states sharded over DP by a flat buffer (ZeRO, FSDP),
        where each tensor's part depends on its offset in the buffer. Groups are in checkpoint order."""
        self.model, self.arch = model, arch
        self.pipelines = sorted(set(pipelines))
        keyed: dict[tuple, list[TensorSpec]] = {}
        for spec in model_tensors(arch, value_head):
            stages = tuple(tensor_stage(spec, arch, pp) for pp in self.pipelines)
            # routed experts apart: expert parallelism places each on its own ranks (``sharding.holds``)
            key = (box_class(spec), stages, spec.name if singletons else "", spec.expert)
            keyed.setdefault(key, []).append(spec)
        self.groups: list[TensorGroup] = []
        for i, ((_, stages, _, _), specs) in enumerate(keyed.items()):
            self.groups.append(TensorGroup(first_id + i, model, tuple(s.name for s in specs), specs[0],
                                           dict(zip(self.pipelines, stages, strict=True)), box_class(specs[0]),
                                           len(specs)))
        self._at: dict[tuple[Pipeline, int], tuple[TensorGroup, ...]] = {}
        for g in self.groups:
            for pipe, s in g.stages.items():
                self._at.setdefault((pipe, s), ())
                self._at[(pipe, s)] += (g,)

    def at_stage(self, pipeline: Pipeline, stage: int) -> tuple[TensorGroup, ...]:
        return self._at.get((pipeline, stage), ())

def _canonical(cls: tuple) -> TensorSpec:
    """A tensor of class ``cls``: ``tp_box`` reads only the shape, the split dimension and its unit."""
    shape, tp_dim, unit = cls
    return TensorSpec("tensor", shape, tp_dim, None, unit=unit)


@lru_cache(maxsize=1 << 16)
def class_tp_box(cls: tuple, arch: ModelArch, tp: int, tp_rank: int) -> Box:
    return tp_box(_canonical(cls), arch, tp, tp_rank)


@lru_cache(maxsize=1 << 18)
def class_boxes(cls: tuple, arch: ModelArch, tp: int, tp_rank: int) -> BoxSet:
    """The boxes a rank holds of any tensor of class ``cls`` unsharded over DP (shared by the class)."""
    return (class_tp_box(cls, arch, tp, tp_rank),)

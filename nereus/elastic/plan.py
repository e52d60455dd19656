"""The transition plan as typed data: ``TransitionPlan`` holds the steps and the numbers the scheduler and
the bounds need, with the plan-level records (detours, per-device bundles, state sizes, bandwidth inputs).

This module is the contract between the graph builder (``graph``, ``ops``) and everything that reads a
plan: the scheduler, the verifier, the timeline, the baselines and the runtime's executor. The step and
piece kinds a plan is made of live in ``elastic.steps`` (listed there) and are re-exported here, so
``from nereus.elastic.plan import Send`` keeps working. It imports only ``steps`` and the box helpers, so no
file cycle can run through it; everything here is plain immutable data that round-trips through JSON
(``TransitionPlan.to_json`` / ``from_json``, the ``--graph`` file).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from functools import cached_property

from nereus.elastic.steps import (
    KV_PIECE_KINDS,
    KV_STEP_KINDS,
    NO_EFFECTS,
    PIECE_KINDS,
    STEP_KINDS,
    Alloc,
    AllocGrads,
    BufferStep,
    Commit,
    Copy,
    CreateGroups,
    Delta,
    DropHost,
    Free,
    FreeEarly,
    Group,
    Keep,
    KVFree,
    KVPiece,
    KVSend,
    LocalPiece,
    MemoryEffects,
    Offload,
    Piece,
    Refill,
    Send,
    SentPiece,
    SeqPiece,
    StatePart,
    Step,
    WholeBuffer,
    step_from_json,
)

__all__ = [  # the step and piece kinds (``elastic.steps``) re-exported, and this module's own
    "Alloc", "AllocGrads", "BufferStep", "Commit", "Copy", "CreateGroups", "Delta", "DropHost", "Free",
    "FreeEarly", "Group", "KVFree", "KVPiece", "KVSend", "KV_PIECE_KINDS", "KV_STEP_KINDS", "Keep",
    "LocalPiece", "MemoryEffects", "NO_EFFECTS", "Offload", "PIECE_KINDS", "Piece", "Refill", "STEP_KINDS",
    "Send", "SentPiece", "SeqPiece", "StatePart", "Step", "WholeBuffer", "step_from_json", "FORMAT", "Detour",
    "BundleBytes", "StateSize", "SourceSet", "BandwidthInputs", "TransitionPlan"]

FORMAT = "nereus.transition-plan/2"


# ----- plan-level records ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Detour:
    """Old buffers of one model state on one device that go through host memory to make room."""

    device: int
    model: str
    state: str
    bytes: int
    reason: str = "old and new state do not fit together on this device"

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class BundleBytes:
    """Bytes of one model state on one device: before, after, and kept in place (the baselines' input)."""

    device: int
    model: str
    state: str
    old: int
    new: int
    kept: int


@dataclass(frozen=True, slots=True)
class StateSize:
    """One full copy of a data-carrying model state: bytes and tensor count."""

    bytes: int
    tensors: int


@dataclass(frozen=True, slots=True)
class SourceSet:
    """A set of old holders: how many devices, the bytes only they hold, and of those the bytes bound for
    nodes where none of them sits."""

    devices: int
    bytes: int
    far_bytes: int


@dataclass(frozen=True)
class BandwidthInputs:
    """What any schedule must carry, per device (received, of which no node-mate holds, re-sliced
    locally) and per holder set: the inputs of ``transition.bandwidth_bound``."""

    recv_bytes: tuple[int, ...] = ()
    recv_far_bytes: tuple[int, ...] = ()
    local_copy_bytes: tuple[int, ...] = ()
    source_sets: tuple[SourceSet, ...] = ()


def _records_json(records: tuple) -> list:
    return [{f.name: getattr(r, f.name) for f in fields(r)} for r in records]


@dataclass(frozen=True)
class TransitionPlan:
    """Every step of a transition between two plans (ids = positions), the tensor groups its pieces name
    (ids = positions), and the per-device numbers the scheduler, verifier and bounds read."""

    steps: tuple[Step, ...]
    groups: tuple[Group, ...]
    num_gpus: int
    gpus_per_node: int
    capacity_bytes: float  # usable per device (capacity less the runtime's reserve)
    chunk_bytes: int
    old_bytes: tuple[int, ...]  # resident per device before and after
    new_bytes: tuple[int, ...]
    lower_bound_bytes: int  # bytes that must reach a device that does not hold them
    detours: tuple[Detour, ...] = ()
    group_setup_s: float = 0.0
    bundles: tuple[BundleBytes, ...] = ()
    state_bytes: Mapping[str, StateSize] = field(default_factory=dict)  # "actor/weights" → one full copy
    bandwidth: BandwidthInputs = BandwidthInputs()

    @cached_property
    def commit(self) -> int:
        """The id of the commit step (-1 when the plan has none: ``verify`` reports that)."""
        return next((s.id for s in self.steps if isinstance(s, Commit)), -1)

    @cached_property
    def bytes_sent(self) -> int:
        return sum(s.bytes for s in self.steps if isinstance(s, Send))

    @cached_property
    def detour_bytes(self) -> int:
        """Bytes over PCIe for memory detours: offloads plus re-slices from host memory."""
        return sum(s.bytes for s in self.steps if isinstance(s, Offload) or (isinstance(s, Copy) and s.from_host))

    def count(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.steps:
            out[s.kind] = out.get(s.kind, 0) + 1
        return out

    def to_json(self) -> dict:
        return {"format": FORMAT, "num_gpus": self.num_gpus, "gpus_per_node": self.gpus_per_node,
                "capacity_bytes": self.capacity_bytes, "chunk_bytes": self.chunk_bytes,
                "old_bytes": list(self.old_bytes), "new_bytes": list(self.new_bytes),
                "lower_bound_bytes": self.lower_bound_bytes, "group_setup_s": self.group_setup_s,
                "commit": self.commit, "bytes_sent": self.bytes_sent, "detour_bytes": self.detour_bytes,
                "detours": [d.to_json() for d in self.detours],
                "bundles": _records_json(self.bundles),
                "state_bytes": {k: {"bytes": v.bytes, "tensors": v.tensors} for k, v in self.state_bytes.items()},
                "bandwidth": {"recv_bytes": list(self.bandwidth.recv_bytes),
                              "recv_far_bytes": list(self.bandwidth.recv_far_bytes),
                              "local_copy_bytes": list(self.bandwidth.local_copy_bytes),
                              "source_sets": _records_json(self.bandwidth.source_sets)},
                "groups": [g.to_json() for g in self.groups], "steps": [s.to_json() for s in self.steps]}

    @staticmethod
    def from_json(d: dict) -> TransitionPlan:
        """The plan ``to_json`` wrote; raises ``ValueError`` for another format or misnumbered ids."""
        if d.get("format") != FORMAT:
            raise ValueError(f"format: expected {FORMAT!r}, got {d.get('format')!r}")
        steps = tuple(step_from_json(s) for s in d["steps"])
        groups = tuple(Group.from_json(g) for g in d["groups"])
        for what, items in (("steps", steps), ("groups", groups)):
            if any(x.id != i for i, x in enumerate(items)):
                raise ValueError(f"{what}: ids must be 0, 1, ... in order")
        bw = d["bandwidth"]
        return TransitionPlan(
            steps, groups, d["num_gpus"], d["gpus_per_node"], d["capacity_bytes"], d["chunk_bytes"],
            tuple(d["old_bytes"]), tuple(d["new_bytes"]), d["lower_bound_bytes"],
            tuple(Detour(**x) for x in d["detours"]), d["group_setup_s"],
            tuple(BundleBytes(**x) for x in d["bundles"]),
            {k: StateSize(v["bytes"], v["tensors"]) for k, v in d["state_bytes"].items()},
            BandwidthInputs(tuple(bw["recv_bytes"]), tuple(bw["recv_far_bytes"]), tuple(bw["local_copy_bytes"]),
                            tuple(SourceSet(**x) for x in bw["source_sets"])))

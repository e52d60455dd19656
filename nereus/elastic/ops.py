"""Emit the typed steps of a transition plan from the solved situations and the chosen sources.

One step per device for each kind of buffer work (its parts name the model states), so an executor
allocates, keeps, re-slices and frees a device's buffers in one step each; one ``Send`` per (source,
destination) pair with every model state coalesced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nereus.elastic.assign import Choice
from nereus.elastic.geometry import Situation
from nereus.elastic.plan import (
    Alloc,
    AllocGrads,
    BufferStep,
    Commit,
    Copy,
    CreateGroups,
    Detour,
    DropHost,
    Free,
    FreeEarly,
    Keep,
    Offload,
    Send,
    StatePart,
    Step,
)
from nereus.spec.layout import Plan

BundleKey = tuple[int, str, str]  # (device, model, state)


@dataclass
class Bundle:
    """One device's buffers of one model state, old and new (the unit of offload; allocs and frees
    gather a device's bundles)."""

    device: int
    model: str
    state: str
    carries_data: bool
    situation: Situation
    offloaded: bool = False

    @property
    def alloc_bytes(self) -> int:
        return self.situation.new_bytes - self.situation.retained_bytes

    @property
    def free_bytes(self) -> int:
        return self.situation.old_bytes - self.situation.retained_bytes


def chunk_count(nbytes: int, chunk: int) -> int:
    return max(1, math.ceil(nbytes / chunk))


@dataclass(frozen=True)
class Emitted:
    steps: tuple[Step, ...]
    detours: tuple[Detour, ...]


class _Emitter:
    def __init__(self, bundles: dict[BundleKey, Bundle], chunk_bytes: int):
        self.chunk = chunk_bytes
        self.steps: list[Step] = []
        self.early: dict[int, list[int]] = {}
        self.offload: dict[BundleKey, int] = {}
        self.alloc: dict[int, int] = {}
        self.frees: dict[int, list[int]] = {}
        self.detours: list[Detour] = []
        self.by_device: dict[int, list[Bundle]] = {}
        for (g, _, _), bun in bundles.items():
            self.by_device.setdefault(g, []).append(bun)

    def add(self, cls: type[Step], **kw) -> Step:
        step = cls(id=len(self.steps), **kw)
        self.steps.append(step)
        return step

    def add_parts(self, cls: type[BufferStep], device: int, parts: list[StatePart], nbytes: int,
                  deps: tuple[int, ...] = (), **kw) -> Step | None:
        if not parts:
            return None
        return self.add(cls, deps=deps, device=device, bytes=nbytes, parts=tuple(parts), **kw)

    def early_frees(self) -> None:
        for g, buns in self.by_device.items():
            grads = [b for b in buns if not b.carries_data and b.free_bytes > 0]
            step = self.add_parts(FreeEarly, g, [StatePart(b.model, b.state, b.situation.dropped) for b in grads],
                                  sum(b.free_bytes for b in grads))
            if step is not None:
                self.early.setdefault(g, []).append(step.id)
            for bun in buns:
                if bun.offloaded:
                    self._detour(g, bun)

    def _detour(self, g: int, bun: Bundle) -> None:
        parts = [StatePart(bun.model, bun.state, bun.situation.dropped)]
        off = self.add_parts(Offload, g, parts, bun.free_bytes)
        self.offload[(g, bun.model, bun.state)] = off.id
        step = self.add_parts(FreeEarly, g, parts, bun.free_bytes, deps=(off.id,))  # restorable from host
        self.early.setdefault(g, []).append(step.id)
        self.detours.append(Detour(g, bun.model, bun.state, bun.free_bytes))

    def allocs_keeps_copies(self) -> None:
        for g, buns in self.by_device.items():
            data = [b for b in buns if b.carries_data]
            step = self.add_parts(Alloc, g, [StatePart(b.model, b.state, b.situation.created) for b in data
                                             if b.alloc_bytes],
                                  sum(b.alloc_bytes for b in data), deps=tuple(self.early.get(g, ())))
            if step is not None:
                self.alloc[g] = step.id
            self.add_parts(Keep, g, [StatePart(b.model, b.state, b.situation.retained) for b in buns
                                     if b.situation.retained], sum(b.situation.retained_bytes for b in buns))
            for host in (False, True):
                local = [b for b in data if b.situation.local and b.offloaded == host]
                if not local:
                    continue
                deps = (self.alloc[g],) + tuple(self.offload[(g, b.model, b.state)] for b in local if host)
                self.add_parts(Copy, g, [StatePart(b.model, b.state, tuple(b.situation.local)) for b in local],
                               sum(b.situation.local_bytes for b in local), deps=deps, from_host=host)

    def sends(self, choices: list[Choice]) -> None:
        """One send per (source, destination) pair: every model state's pieces coalesced, as the executor
        batches them into one point-to-point exchange per peer."""
        merged: dict[tuple[int, int, bool], list] = {}
        for c in choices:
            entry = merged.setdefault((c.src, c.need.dst, c.from_host), [0, [], set()])
            entry[0] += c.need.bytes
            entry[1].append(StatePart(c.need.model, c.need.state, c.need.pieces))  # shared pieces, not copies
            entry[2].add((c.need.model, c.need.state))
        for (src, dst, host), (nbytes, parts, states) in sorted(merged.items()):
            deps = (self.alloc[dst],)
            if host:
                deps += tuple(self.offload[(src, m, st)] for m, st in sorted(states) if (src, m, st) in self.offload)
            self.add(Send, deps=deps, src=src, dst=dst, bytes=nbytes, parts=tuple(parts), from_host=host,
                     chunks=chunk_count(nbytes, self.chunk), staging=min(nbytes, self.chunk))

    def process_groups(self, old: Plan, new: Plan) -> None:
        """The new layouts' process groups (TP, PP, DP) where no old placement already has them."""
        existing = {((p.layout.tp, p.layout.pp, p.layout.dp), p.gpus) for p in old.placements}
        made = set()
        for p in new.placements:
            key = ((p.layout.tp, p.layout.pp, p.layout.dp), p.gpus)
            if key not in existing and key not in made:
                made.add(key)
                self.add(CreateGroups, deps=(), model_stage=str(p.model_stage), layout=p.layout.short(),
                         gpus=tuple(p.gpus))

    def commit_and_release(self) -> None:
        commit = self.add(Commit, deps=tuple(s.id for s in self.steps)).id
        for g, buns in self.by_device.items():
            freed = [b for b in buns if b.carries_data and b.free_bytes > 0 and not b.offloaded]
            step = self.add_parts(Free, g, [StatePart(b.model, b.state, b.situation.dropped) for b in freed],
                                  sum(b.free_bytes for b in freed), deps=(commit,))
            if step is not None:
                self.frees[g] = [step.id]
            hosted = [b for b in buns if b.offloaded]
            self.add_parts(DropHost, g, [StatePart(b.model, b.state, b.situation.dropped) for b in hosted],
                           sum(b.free_bytes for b in hosted), deps=(commit,))
        for g, buns in self.by_device.items():
            grads = [b for b in buns if not b.carries_data and b.alloc_bytes > 0]
            self.add_parts(AllocGrads, g, [StatePart(b.model, b.state, b.situation.created) for b in grads],
                           sum(b.alloc_bytes for b in grads), deps=(commit, *self.frees.get(g, ())))


def emit_steps(bundles: dict[BundleKey, Bundle], choices: list[Choice], old: Plan, new: Plan,
               chunk_bytes: int) -> Emitted:
    """The steps in plan order (ids = positions): early frees and detours, allocations, keeps and local
    copies, sends, process groups, the commit, then releases and the new gradient buffers."""
    e = _Emitter(bundles, chunk_bytes)
    e.early_frees()
    e.allocs_keeps_copies()
    e.sends(choices)
    e.process_groups(old, new)
    e.commit_and_release()
    return Emitted(tuple(e.steps), tuple(e.detours))

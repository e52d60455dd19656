"""Emit the operations of a transition graph from the solved situations and the chosen sources."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nereus.elastic.assign import Choice
from nereus.elastic.graph import Op, TransitionGraph, chunk_count

if TYPE_CHECKING:
    from nereus.elastic.graph import Bundle, _Builder

BundleKey = tuple[int, str, str]


def _joined(parts: list[tuple[str, str, tuple]]) -> tuple[str, str]:
    """Op-level labels of the model states an op touches ("actor+critic", "optimizer+weights")."""
    return "+".join(sorted({m for m, _, _ in parts})), "+".join(sorted({st for _, st, _ in parts}))


class _Emitter:
    """One op per device for each kind of buffer work (its parts name the model states), so an
    executor allocates, keeps, re-slices and frees a device's buffers in one step each."""

    def __init__(self, b: _Builder):
        self.b = b
        self.ops: list[Op] = []
        self.early: dict[int, list[int]] = {}
        self.offload: dict[BundleKey, int] = {}
        self.alloc: dict[int, int] = {}
        self.frees: dict[int, list[int]] = {}
        self.detours: list[dict] = []
        self.detour_bytes = 0
        self.by_device: dict[int, list[Bundle]] = {}
        for (g, _, _), bun in b.bundles.items():
            self.by_device.setdefault(g, []).append(bun)

    def add(self, kind: str, device: int, **kw) -> Op:
        op = Op(len(self.ops), kind, device, **kw)
        self.ops.append(op)
        return op

    def add_parts(self, kind: str, device: int, parts: list[tuple[str, str, tuple]], nbytes: int, **kw) -> Op | None:
        if not parts:
            return None
        model, state = _joined(parts)
        return self.add(kind, device, bytes=nbytes, model=model, state=state, parts=tuple(parts), **kw)

    def early_frees(self) -> None:
        for g, buns in self.by_device.items():
            grads = [b for b in buns if not b.carries_data and b.free_bytes > 0]
            op = self.add_parts("free_early", g, [(b.model, b.state, b.situation.dropped) for b in grads],
                                sum(b.free_bytes for b in grads), detail="gradient buffers hold no state between steps")
            if op is not None:
                self.early.setdefault(g, []).append(op.id)
            for bun in buns:
                if bun.offloaded:
                    self._detour(g, bun)

    def _detour(self, g: int, bun: Bundle) -> None:
        parts = [(bun.model, bun.state, bun.situation.dropped)]
        off = self.add_parts("offload", g, parts, bun.free_bytes, detail="memory detour: old buffers to host memory")
        self.offload[(g, bun.model, bun.state)] = off.id
        op = self.add_parts("free_early", g, parts, bun.free_bytes, deps=(off.id,),
                            detail="restorable from host memory until commit")
        self.early.setdefault(g, []).append(op.id)
        self.detours.append({"device": g, "model": bun.model, "state": bun.state, "bytes": bun.free_bytes,
                             "reason": "old and new state do not fit together on this device"})
        self.detour_bytes += bun.free_bytes

    def allocs_keeps_copies(self) -> None:
        for g, buns in self.by_device.items():
            data = [b for b in buns if b.carries_data]
            op = self.add_parts("alloc", g, [(b.model, b.state, b.situation.created) for b in data if b.alloc_bytes],
                                sum(b.alloc_bytes for b in data), deps=tuple(self.early.get(g, ())))
            if op is not None:
                self.alloc[g] = op.id
            self.add_parts("keep", g, [(b.model, b.state, tuple(b.situation.retained)) for b in buns
                                       if b.situation.retained], sum(b.situation.retained_bytes for b in buns))
            for host in (False, True):
                local = [b for b in data if b.situation.local and b.offloaded == host]
                if not local:
                    continue
                deps = (self.alloc[g],) + tuple(self.offload[(g, b.model, b.state)] for b in local if host)
                op = self.add_parts("copy", g, [(b.model, b.state, tuple(b.situation.local)) for b in local],
                                    sum(b.situation.local_bytes for b in local), deps=deps, from_host=host)
                if op is not None and host:
                    self.detour_bytes += op.bytes

    def sends(self, choices: list[Choice]) -> int:
        """One send per (source, destination) pair: every model state's pieces coalesced, as the executor
        batches them into one point-to-point exchange per peer."""
        merged: dict[tuple[int, int, bool], list] = {}
        for c in choices:
            entry = merged.setdefault((c.src, c.need.dst, c.from_host), [0, [], set()])
            entry[0] += c.need.bytes
            entry[1].append((c.need.model, c.need.state, c.need.pieces))  # shared tuples, not copies
            entry[2].add((c.need.model, c.need.state))
        chunk = self.b.opt.chunk_bytes
        sent = 0
        for (src, dst, host), (nbytes, parts, states) in sorted(merged.items()):
            deps = (self.alloc[dst],)
            if host:
                deps += tuple(self.offload[(src, m, st)] for m, st in sorted(states) if (src, m, st) in self.offload)
            model = "+".join(sorted({m for m, _ in states}))
            state = "+".join(sorted({st for _, st in states}))
            self.add("send", src, peer=dst, bytes=nbytes, model=model, state=state, parts=tuple(parts), deps=deps,
                     from_host=host, chunks=chunk_count(nbytes, chunk), staging=min(nbytes, chunk))
            sent += nbytes
        return sent

    def process_groups(self) -> None:
        """The new layouts' process groups (TP, PP, DP) where no old placement already has them."""
        existing = {((p.layout.tp, p.layout.pp, p.layout.dp), p.gpus) for p in self.b.old.placements}
        made = set()
        for p in self.b.new.placements:
            key = ((p.layout.tp, p.layout.pp, p.layout.dp), p.gpus)
            if key not in existing and key not in made:
                made.add(key)
                self.add("group", p.gpus[0], detail=f"{p.model_stage} {p.layout.short()} on {len(p.gpus)} GPUs")

    def commit_and_release(self) -> int:
        commit = self.add("commit", -1, deps=tuple(op.id for op in self.ops)).id
        for g, buns in self.by_device.items():
            freed = [b for b in buns if b.carries_data and b.free_bytes > 0 and not b.offloaded]
            op = self.add_parts("free", g, [(b.model, b.state, b.situation.dropped) for b in freed],
                                sum(b.free_bytes for b in freed), deps=(commit,), precommit=False)
            if op is not None:
                self.frees[g] = [op.id]
            hosted = [b for b in buns if b.offloaded]
            self.add_parts("drop_host", g, [(b.model, b.state, b.situation.dropped) for b in hosted],
                           sum(b.free_bytes for b in hosted), deps=(commit,), precommit=False)
        for g, buns in self.by_device.items():
            grads = [b for b in buns if not b.carries_data and b.alloc_bytes > 0]
            self.add_parts("alloc_grads", g, [(b.model, b.state, b.situation.created) for b in grads],
                           sum(b.alloc_bytes for b in grads), deps=(commit, *self.frees.get(g, ())),
                           precommit=False)
        return commit


def emit_ops(b: _Builder, choices: list[Choice]) -> TransitionGraph:
    e = _Emitter(b)
    e.early_frees()
    e.allocs_keeps_copies()
    sent = e.sends(choices)
    e.process_groups()
    commit = e.commit_and_release()
    old, new, _, _ = b.per_device()
    lower = sum(c.need.bytes for c in choices)
    bundles = [(g, m, st, x.situation.old_bytes, x.situation.new_bytes, x.situation.retained_bytes)
               for (g, m, st), x in b.bundles.items()]
    state_bytes = {}
    for (model, state), geo in b.geometry.items():
        if geo.kind.carries_data:
            groups = geo.groups.groups
            state_bytes[f"{model}/{state}"] = (sum(g.elements * g.count for g in groups) * geo.kind.bytes_per_element,
                                               sum(g.count for g in groups))
    return TransitionGraph(e.ops, commit, b.groups, b.n, b.gpn, b.usable, old, new, lower, sent,
                           e.detour_bytes, e.detours, b.opt.chunk_bytes, group_setup_s=b.opt.group_setup_s,
                           bundles=bundles, state_bytes=state_bytes)

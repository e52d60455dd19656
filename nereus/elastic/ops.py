"""Emit the operations of a transition graph from the solved situations and the chosen sources."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nereus.elastic.assign import Choice
from nereus.elastic.graph import Op, TransitionGraph

if TYPE_CHECKING:
    from nereus.elastic.graph import Bundle, _Builder

BundleKey = tuple[int, str, str]


class _Emitter:
    def __init__(self, b: _Builder):
        self.b = b
        self.ops: list[Op] = []
        self.early: dict[int, list[int]] = {}
        self.offload: dict[BundleKey, int] = {}
        self.alloc: dict[BundleKey, int] = {}
        self.frees: dict[int, list[int]] = {}
        self.detours: list[dict] = []
        self.detour_bytes = 0

    def add(self, kind: str, device: int, **kw) -> Op:
        op = Op(len(self.ops), kind, device, **kw)
        self.ops.append(op)
        return op

    def early_frees(self) -> None:
        for key, bun in self.b.bundles.items():
            g, model, state = key
            if not bun.carries_data and bun.free_bytes > 0:
                op = self.add("free_early", g, bytes=bun.free_bytes, model=model, state=state,
                              detail="gradient buffers hold no state between steps")
                self.early.setdefault(g, []).append(op.id)
            if bun.offloaded:
                off = self.add("offload", g, bytes=bun.free_bytes, model=model, state=state,
                               pieces=_dropped(bun), detail="memory detour: old buffers to host memory")
                self.offload[key] = off.id
                op = self.add("free_early", g, bytes=bun.free_bytes, model=model, state=state, deps=(off.id,),
                              detail="restorable from host memory until commit")
                self.early.setdefault(g, []).append(op.id)
                self.detours.append({"device": g, "model": model, "state": state, "bytes": bun.free_bytes,
                                     "reason": "old and new state do not fit together on this device"})
                self.detour_bytes += bun.free_bytes

    def allocs_keeps_copies(self) -> None:
        for key, bun in self.b.bundles.items():
            g, model, state = key
            sit = bun.situation
            if bun.carries_data and bun.alloc_bytes > 0:
                self.alloc[key] = self.add("alloc", g, bytes=bun.alloc_bytes, model=model, state=state,
                                           pieces=_created(bun), deps=tuple(self.early.get(g, ()))).id
            if sit.retained:
                self.add("keep", g, bytes=sit.retained_bytes, model=model, state=state, pieces=tuple(sit.retained))
            if sit.local:
                deps = (self.alloc[key],) + ((self.offload[key],) if bun.offloaded else ())
                self.add("copy", g, bytes=sit.local_bytes, model=model, state=state, pieces=tuple(sit.local),
                         deps=deps, from_host=bun.offloaded)
                if bun.offloaded:
                    self.detour_bytes += sit.local_bytes

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
            deps = tuple(self.alloc[(dst, m, st)] for m, st in sorted(states))
            if host:
                deps += tuple(self.offload[(src, m, st)] for m, st in sorted(states) if (src, m, st) in self.offload)
            model = "+".join(sorted({m for m, _ in states}))
            state = "+".join(sorted({st for _, st in states}))
            self.add("send", src, peer=dst, bytes=nbytes, model=model, state=state, parts=tuple(parts), deps=deps,
                     from_host=host, chunks=-(-nbytes // chunk), staging=min(nbytes, chunk))
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
        for key, bun in self.b.bundles.items():
            g, model, state = key
            if bun.carries_data and bun.free_bytes > 0 and not bun.offloaded:
                op = self.add("free", g, bytes=bun.free_bytes, model=model, state=state, pieces=_dropped(bun),
                              deps=(commit,), precommit=False)
                self.frees.setdefault(g, []).append(op.id)
            if bun.offloaded:
                self.add("drop_host", g, bytes=bun.free_bytes, model=model, state=state, deps=(commit,),
                         precommit=False)
        for key, bun in self.b.bundles.items():
            g, model, state = key
            if not bun.carries_data and bun.alloc_bytes > 0:
                self.add("alloc_grads", g, bytes=bun.alloc_bytes, model=model, state=state, pieces=_created(bun),
                         deps=(commit, *self.frees.get(g, ())), precommit=False)
        return commit


def _created(bun: Bundle) -> tuple:
    return bun.situation.created


def _dropped(bun: Bundle) -> tuple:
    return bun.situation.dropped


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

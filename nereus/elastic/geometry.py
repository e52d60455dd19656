"""Where each destination box of a transition comes from: kept in place, copied on its own device, or
received from devices that hold it — by box intersection, per model state and device situation.

A device's *situation* for one model state is the list of (placement, stage, tp rank, dp rank) it holds
in the old plan and in the new one. Devices in the same situation (most DP replicas) need the same
pieces from the same kind of source, so each situation is solved once; only the choice of the source
device (``assign``) is per device.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

from nereus.elastic.boxes import BoxSet, bounding, intersect_sets, set_contains, set_volume, subtract
from nereus.elastic.emu import StateKind
from nereus.elastic.ep_buffers import ExpertRankBuffers
from nereus.elastic.groups import ModelGroups, Pipeline, TensorGroup, class_boxes, class_tp_box
from nereus.elastic.plan import LocalPiece, SentPiece, WholeBuffer
from nereus.spec.layout import Placement
from nereus.spec.sharding import Box, box_volume, flat_range_boxes, intersect, split_range

Slot = tuple[int, int, int, int | None]  # (holder index, pp stage, tp rank, dp rank or None)
Alt = tuple[int, tuple[int, ...], int | None]  # (holder index, tp ranks holding it, dp rank or None: any)
SourceKey = tuple[tuple[int, int, tuple[int, ...], int | None], ...]  # Alts with the stage resolved


@dataclass(frozen=True)
class Holder:
    """A placement holding one state of one model (``zero``: sharded over its DP ranks by the flat-buffer
    split of ``sharding.zero_shards``, as ZeRO-1 shards the optimizer and FSDP every state)."""

    index: int  # position in its plan's placements
    placement: Placement
    zero: bool

    @property
    def pipeline(self) -> Pipeline:
        return self.placement.layout.pp

    def device(self, stage: int, dp_rank: int, tp_rank: int) -> int:
        return self.placement.gpus[self.placement.layout.dims.rank(stage, dp_rank, tp_rank)]

    @property
    def per_rank(self) -> bool:
        """Whether what a rank holds depends on its DP rank: DP-sharded, or experts split by EP."""
        return self.zero or self.placement.layout.ep > 1


def device_slots(holders: list[Holder]) -> dict[int, tuple[Slot, ...]]:
    slots: dict[int, list[Slot]] = {}
    for hi, h in enumerate(holders):
        dims = h.placement.layout.dims
        for rank, g in enumerate(h.placement.gpus):
            s, r, t = dims.coords(rank)
            slots.setdefault(g, []).append((hi, s, t, r if h.per_rank else None))
    return {g: tuple(v) for g, v in slots.items()}


class RankBuffers:
    """Offsets of the tensors (singleton groups, checkpoint order) in the flat buffer of each rank of a
    DP-sharded holder, and each DP rank's part of them (``sharding.zero_shards``, per group)."""

    def __init__(self, h: Holder, groups: ModelGroups):
        self.h, self.groups = h, groups
        self._ranks: dict[tuple[int, int], tuple[list[TensorGroup], list[Box], list[int], list[int]]] = {}

    def rank(self, s: int, t: int) -> tuple[list[TensorGroup], list[Box], list[int], list[int]]:
        """(groups, their TP boxes, start offsets, DP range starts) of rank (stage s, TP rank t)."""
        if (s, t) not in self._ranks:
            lay = self.h.placement.layout
            gs = list(self.groups.at_stage(self.h.pipeline, s))
            boxes = [class_tp_box(g.cls, self.groups.arch, lay.tp, t) for g in gs]
            offsets, total = [], 0
            for b in boxes:
                offsets.append(total)
                total += box_volume(b)
            starts = [split_range(total, lay.dp, r)[0] for r in range(lay.dp)] + [total]
            self._ranks[(s, t)] = (gs, boxes, offsets, starts)
        return self._ranks[(s, t)]

    def part(self, s: int, t: int, r: int) -> list[tuple[TensorGroup, BoxSet]]:
        """What DP rank r of rank (s, t) owns: (group, boxes) of every tensor its range touches."""
        gs, boxes, offsets, starts = self.rank(s, t)
        lo, hi = starts[r], starts[r + 1]
        out = []
        i = max(0, bisect_right(offsets, lo) - 1)
        while i < len(gs) and offsets[i] < hi:
            n = box_volume(boxes[i])
            a, b = max(lo, offsets[i]), min(hi, offsets[i] + n)
            if a < b:
                out.append((gs[i], flat_range_boxes(boxes[i], a - offsets[i], b - offsets[i])))
            i += 1
        return out

    def cells(self, g: TensorGroup) -> list[tuple[BoxSet, int, int]]:
        """(boxes, tp rank, dp rank) of every DP part of tensor ``g`` over all TP ranks."""
        s = g.stages[self.h.pipeline]
        out = []
        for t in range(self.h.placement.layout.tp):
            gs, boxes, offsets, starts = self.rank(s, t)
            i = gs.index(g)
            o, n = offsets[i], box_volume(boxes[i])
            r = bisect_right(starts, o) - 1
            while r < len(starts) - 1 and starts[r] < o + n:
                a, b = max(starts[r], o), min(starts[r + 1], o + n)
                if a < b:
                    out.append((flat_range_boxes(boxes[i], a - o, b - o), t, r))
                r += 1
        return out


def rank_buffers(h: Holder, groups: ModelGroups) -> RankBuffers | ExpertRankBuffers:
    """What each DP rank of a ``per_rank`` holder holds (``ep_buffers`` under expert parallelism)."""
    return ExpertRankBuffers(h, groups) if h.placement.layout.ep > 1 else RankBuffers(h, groups)


class Partition:
    """The cells one old holder splits a tensor (class) into, indexed for box queries.

    A TP-replicated tensor (norms, shared K/V heads) is held by several TP ranks; unsharded they hold the
    same box (one cell, several ranks), but a flat-buffer DP split cuts each rank's copy at its own
    offsets, so their cells overlap. The cover therefore uses the cells of the lowest TP rank of each
    distinct TP box (disjoint, ordered along dimension 0); the other ranks' cells are alternatives for
    any piece one of them holds whole.
    """

    def __init__(self, holder_index: int, h: Holder, g: TensorGroup, groups: ModelGroups,
                 buffers: RankBuffers | None):
        lay = h.placement.layout
        cells: dict[tuple[BoxSet, int | None], list[int]] = {}  # (boxes, dp rank) → TP ranks holding them
        if buffers is not None:
            for bs, t, r in buffers.cells(g):
                cells.setdefault((bs, r), []).append(t)
        else:
            for t in range(lay.tp):
                bs = class_boxes(g.cls, groups.arch, lay.tp, t)
                if set_volume(bs):
                    cells.setdefault((bs, None), []).append(t)
        first: dict[Box, int] = {}
        for t in range(lay.tp):
            first.setdefault(class_tp_box(g.cls, groups.arch, lay.tp, t), t)
        by_band: dict[Box, list[tuple[BoxSet, Alt]]] = {}
        self.extra: list[tuple[BoxSet, Alt]] = []
        for (bs, r), ts in cells.items():
            band = class_tp_box(g.cls, groups.arch, lay.tp, ts[0])
            alt = (holder_index, tuple(ts), r)
            if first[band] in ts:
                by_band.setdefault(band, []).append((bs, alt))
            else:
                self.extra.append((bs, alt))
        self.bands: list[tuple[Box, list[int], list[int], list[tuple[BoxSet, Alt]]]] = []
        for band, items in by_band.items():
            items.sort(key=lambda it: bounding(it[0])[0])
            self.bands.append((band, [bounding(b)[0][0] for b, _ in items], [bounding(b)[0][1] for b, _ in items],
                               items))

    def query(self, region: list[Box]) -> list[tuple[BoxSet, Alt]]:
        """Each cover cell meeting ``region`` with the part of the region inside it (disjoint parts)."""
        out = []
        bb = bounding(tuple(region))
        lo, hi = bb[0]
        for band, starts, ends, items in self.bands:
            if intersect(band, bb) is None:
                continue
            i = bisect_right(ends, lo)
            while i < len(items) and starts[i] < hi:
                piece = intersect_sets(tuple(region), items[i][0])
                if piece:
                    out.append((piece, items[i][1]))
                i += 1
        return out

    def containing(self, piece: BoxSet) -> list[Alt]:
        """Every cell (cover or alternative) holding all of ``piece``."""
        out = []
        hits = self.query(list(piece))
        if len(hits) == 1 and set_volume(hits[0][0]) == set_volume(piece):
            out.append(hits[0][1])
        out += [alt for bs, alt in self.extra if set_contains(bs, piece)]
        return out


@dataclass
class Situation:
    """What a device in one situation holds and needs for one model state (group-level, exact).
    Shared by every device in the situation: treat as read-only."""

    retained: tuple[WholeBuffer, ...] = ()  # new buffers equal to old ones: kept
    # re-sliced on the device itself
    local: list[LocalPiece] = field(default_factory=list)
    # per source key, the pieces to receive from a device holding that key's cells
    needs: dict[SourceKey, tuple[SentPiece, ...]] = field(default_factory=dict)
    new_bytes: int = 0
    old_bytes: int = 0
    retained_bytes: int = 0
    local_bytes: int = 0
    need_bytes: dict[SourceKey, int] = field(default_factory=dict)
    created: tuple[WholeBuffer, ...] = ()  # new buffers not kept: allocated
    dropped: tuple[WholeBuffer, ...] = ()  # old buffers not kept: freed


class StateGeometry:
    """Solves situations for one (model, state): old holders → new holders."""

    def __init__(self, groups: ModelGroups, kind: StateKind, old: list[Holder], new: list[Holder]):
        self.groups, self.kind, self.old, self.new = groups, kind, old, new
        # The coarsest old split cuts what must be received into the fewest pieces (so the fewest
        # messages); finer holders still serve a piece when one of their cells holds it whole. Ties go to
        # the holder with more devices.
        self.primary = min(range(len(old)), key=lambda i: (old[i].placement.layout.tp,
                                                           -len(old[i].placement.gpus), i)) if old else None
        self._partitions: dict[tuple[int, object], Partition] = {}
        self._cache: dict[tuple, tuple] = {}
        self._slots: dict[tuple, list] = {}
        self._skeys: dict[tuple, SourceKey] = {}
        self._buffers = {(which, i): rank_buffers(h, groups) for which, hs in (("old", old), ("new", new))
                         for i, h in enumerate(hs) if h.per_rank}
        # Unsharded holders place every tensor of a box class alike; sharded ones (and EP) each tensor apart.
        self.per_tensor = any(h.per_rank for h in old)

    def partition(self, hi: int, g: TensorGroup) -> Partition:
        key = (hi, g.id if self.old[hi].per_rank else g.cls)
        if key not in self._partitions:
            self._partitions[key] = Partition(hi, self.old[hi], g, self.groups, self._buffers.get(("old", hi)))
        return self._partitions[key]

    def _slot_buffers(self, holders: list[Holder], slot: Slot) -> list[tuple[TensorGroup, BoxSet, int]]:
        """(group, boxes, bytes) a slot holds; cached, since every replica in a slot position repeats it."""
        which = "old" if holders is self.old else "new"
        key = (which, slot)
        if key not in self._slots:
            hi, s, t, r = slot
            h = holders[hi]
            bpe = self.kind.bytes_per_element
            if h.per_rank:
                parts = self._buffers[(which, hi)].part(s, t, r)
                out = [(g, bs, set_volume(bs) * bpe * g.count) for g, bs in parts]
            else:
                lay = h.placement.layout
                out = []
                for g in self.groups.at_stage(h.pipeline, s):
                    bs = class_boxes(g.cls, self.groups.arch, lay.tp, t)
                    size = set_volume(bs) * bpe * g.count
                    if size:  # a dimension smaller than TP leaves some ranks nothing
                        out.append((g, bs, size))
            self._slots[key] = out
        return self._slots[key]

    def _holdings(self, holders: list[Holder], slots: tuple[Slot, ...]) -> dict[TensorGroup, dict[BoxSet, int]]:
        out: dict[TensorGroup, dict[BoxSet, int]] = {}
        for slot in slots:
            for g, bs, size in self._slot_buffers(holders, slot):
                out.setdefault(g, {})[bs] = size
        return out

    def solve(self, old_slots: tuple[Slot, ...], new_slots: tuple[Slot, ...]) -> Situation:
        sit = Situation()
        old_h, new_h = self._holdings(self.old, old_slots), self._holdings(self.new, new_slots)
        for sets in old_h.values():
            sit.old_bytes += sum(sets.values())
        needs: dict[SourceKey, list] = {}
        created, retained = [], []
        for g, sets in new_h.items():
            olds = old_h.get(g, {})
            for bs, size in sets.items():
                sit.new_bytes += size
                if bs in olds:
                    retained.append(WholeBuffer(g.id, bs))
                    sit.retained_bytes += size
                    continue
                created.append(WholeBuffer(g.id, bs))
                if self.kind.carries_data:
                    self._place(sit, needs, g, bs, tuple(olds))
        sit.needs = {k: tuple(v) for k, v in needs.items()}
        sit.created, sit.retained = tuple(created), tuple(retained)
        kept = set(retained)
        sit.dropped = tuple(x for x in (WholeBuffer(g.id, bs) for g, sets in old_h.items() for bs in sets)
                            if x not in kept)
        return sit

    def _place(self, sit: Situation, needs: dict, g: TensorGroup, dest: BoxSet, local: tuple[BoxSet, ...]) -> None:
        key = (g.id if self.per_tensor else g.cls, dest, local)
        if key not in self._cache:
            self._cache[key] = self._pieces(g, dest, local)
        local_pieces, remote = self._cache[key]
        scale = g.count * self.kind.bytes_per_element
        for piece, src, vol in local_pieces:
            sit.local.append(LocalPiece(g.id, piece, src, dest))
            sit.local_bytes += vol * scale
        for piece, alts, vol in remote:
            skey = self._source_key(alts, g)
            needs.setdefault(skey, []).append(SentPiece(g.id, piece, dest))
            sit.need_bytes[skey] = sit.need_bytes.get(skey, 0) + vol * scale

    def _source_key(self, alts: tuple[Alt, ...], g: TensorGroup) -> SourceKey:
        """The alternatives with each holder's stage for this group resolved (groups differ in stage).
        Cached by identity: ``alts`` tuples live in ``self._cache`` for the builder's lifetime."""
        key = (id(alts), g.id)
        if key not in self._skeys:
            self._skeys[key] = tuple(sorted((hi, g.stages[self.old[hi].pipeline], ts, r) for hi, ts, r in alts))
        return self._skeys[key]

    def _pieces(self, g: TensorGroup, dest: BoxSet, local: tuple[BoxSet, ...]) -> tuple[list, list]:
        """Cut ``dest`` into local pieces (each inside one buffer this device holds) and remote pieces
        (each inside a cell of the primary split), with every old cell that holds a remote piece whole."""
        region = list(dest)
        local_pieces = []
        for src in sorted(local, key=lambda bs: -set_volume(intersect_sets(dest, bs))):
            inside = intersect_sets(tuple(region), src)
            if inside:
                local_pieces.append((inside, src, set_volume(inside)))
                for box in src:
                    region = [p for x in region for p in subtract(x, box)]
        remote = []
        if region:
            if self.primary is None:
                raise ValueError("no old holder for a state that must be received")
            primary = self.partition(self.primary, g)
            for piece, alt in primary.query(region):
                alts = [alt] + [a for bs, a in primary.extra if set_contains(bs, piece)]
                for hi in range(len(self.old)):
                    if hi != self.primary:
                        alts += self.partition(hi, g).containing(piece)
                remote.append((piece, tuple(alts), set_volume(piece)))
        return local_pieces, remote

"""What each rank of an expert-parallel holder holds of one model state, by tensor group: the transition
graph's view of ``sharding.holds`` and ``sharding.zero_shards`` under ``ep`` > 1.

Without EP a holder's unsharded state is the same on every DP rank, and its DP-sharded state one flat buffer
split over DP (``geometry.RankBuffers``). With EP a rank's routed experts depend on its EP rank (``dp_rank %
ep``): its state is the dense tensors (whole, or the DP rank's range of their flat buffer) and its experts
(whole, or its range of their flat buffer split over the ``dp / ep`` ranks holding the same experts). So an
EP holder is solved per DP rank, as a DP-sharded one is; the groups keep each expert apart
(``groups.ModelGroups`` keys by expert). A cell of unsharded dense state can come from any DP rank; one of
an expert, from the first DP rank holding it (EP rank ``e`` of the first EP group: DP rank ``e``).
"""

from __future__ import annotations

from nereus.elastic.boxes import BoxSet
from nereus.elastic.groups import ModelGroups, TensorGroup, class_tp_box
from nereus.spec.sharding import Box, box_volume, expert_range, flat_range_boxes, split_range

Flat = tuple[list[TensorGroup], list[Box], list[int], list[int]]  # groups, TP boxes, offsets, range starts


class ExpertRankBuffers:
    """Per (stage, TP rank, DP rank), the (group, boxes) an EP holder ``h`` (``geometry.Holder``) holds,
    with ``h.zero`` its flat-buffer ranges; the same interface as ``geometry.RankBuffers``."""

    def __init__(self, h, groups: ModelGroups):
        self.h, self.groups = h, groups
        self.dims = h.placement.layout.dims
        self.experts = groups.arch.moe.experts
        self._flat: dict[tuple[int, int, int, bool], Flat] = {}

    def _owner(self, g: TensorGroup) -> int:
        """The EP rank holding expert group ``g``."""
        return next(e for e in range(self.dims.ep) if g.spec.expert in expert_range(self.experts, self.dims.ep, e))

    def _buffer(self, s: int, t: int, e: int, experts: bool) -> Flat:
        """The dense (or EP rank ``e``'s expert) groups of rank (stage ``s``, TP rank ``t``) as one flat
        buffer, split over DP (experts: over the ranks holding them) when ``h.zero``, else whole."""
        key = (s, t, e, experts)
        if key not in self._flat:
            dims, arch = self.dims, self.groups.arch
            mine = expert_range(self.experts, dims.ep, e)
            gs = [g for g in self.groups.at_stage(self.h.pipeline, s)
                  if (g.spec.expert in mine if experts else g.spec.expert is None)]
            boxes = [class_tp_box(g.cls, arch, dims.tp, t) for g in gs]
            offsets, total = [], 0
            for b in boxes:
                offsets.append(total)
                total += box_volume(b)
            parts = (dims.dp // dims.ep if experts else dims.dp) if self.h.zero else 1
            starts = [split_range(total, parts, i)[0] for i in range(parts)] + [total]
            self._flat[key] = (gs, boxes, offsets, starts)
        return self._flat[key]

    def _index(self, r: int, experts: bool) -> int:
        """DP rank ``r``'s range in its dense or expert buffer."""
        if not self.h.zero:
            return 0
        return self.dims.edp_rank(r) if experts else r

    def part(self, s: int, t: int, r: int) -> list[tuple[TensorGroup, BoxSet]]:
        """What DP rank ``r`` of rank (s, t) holds: (group, boxes) of every tensor, dense then experts."""
        out = []
        for experts in (False, True):
            gs, boxes, offsets, starts = self._buffer(s, t, self.dims.ep_rank(r), experts)
            i = self._index(r, experts)
            lo, hi = starts[i], starts[i + 1]
            for g, box, o in zip(gs, boxes, offsets, strict=True):
                a, b = max(lo, o), min(hi, o + box_volume(box))
                if a < b:
                    out.append((g, (box,) if b - a == box_volume(box) else flat_range_boxes(box, a - o, b - o)))
        return out

    def cells(self, g: TensorGroup) -> list[tuple[BoxSet, int, int | None]]:
        """(boxes, TP rank, DP rank: None for any) of every part of group ``g`` over all TP ranks; an
        expert's parts from the first EP group."""
        s = g.stages[self.h.pipeline]
        experts = g.spec.expert is not None
        e = self._owner(g) if experts else 0
        out = []
        for t in range(self.dims.tp):
            gs, boxes, offsets, starts = self._buffer(s, t, e, experts)
            i = gs.index(g)
            o, n = offsets[i], box_volume(boxes[i])
            for j in range(len(starts) - 1):
                a, b = max(starts[j], o), min(starts[j + 1], o + n)
                if a >= b:
                    continue
                bs = (boxes[i],) if b - a == n else flat_range_boxes(boxes[i], a - o, b - o)
                if not self.h.zero:
                    out.append((bs, t, e if experts else None))
                else:
                    out.append((bs, t, j * self.dims.ep + e if experts else j))
        return out

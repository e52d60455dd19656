"""What one rank holds of every model state, addressed by global boxes: the executor's view of the runtime.

A *buffer* is one tensor's state on one device under one layout, as the transition graph names it:
(model, state, tensor name, box set). Its components are flat 1-D tensors — one for weights, three for
the optimizer (fp32 master, Adam's two moments) — laid out row-major box after box, which is how a
ZeRO range of the contract's flat buffer covers a tensor (``sharding.flat_range_boxes``). A weight
buffer is a view of the parameter itself, an optimizer buffer is one of ``ShardedAdam``'s segments:
nothing is copied to build the view, and a kept buffer is handed to the new layout as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nereus.runtime.engine import ShardedModel, tied_head
from nereus.runtime.parallel.dp import ShardedAdam
from nereus.spec.sharding import Box, box_volume, flat_range_boxes, rank_order, rank_tensors

WEIGHTS, OPTIMIZER = "weights", "optimizer"
BufferKey = tuple[str, str, str, tuple[Box, ...]]  # (model, state, tensor name, box set)


class TransitionExecutionError(RuntimeError):
    """The graph and what a rank holds disagree, or a transfer failed; the old layout is intact."""


def extent(box: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


def index_in(box: Box, origin: Box) -> tuple[slice, ...]:
    """``box`` (global coordinates) as slices of a tensor holding ``origin``."""
    out = []
    for (lo, hi), (o_lo, o_hi) in zip(box, origin, strict=True):
        if lo < o_lo or hi > o_hi:
            raise TransitionExecutionError(f"box {box} is outside the buffer {origin}")
        out.append(slice(lo - o_lo, hi - o_lo))
    return tuple(out)


@dataclass
class Buffer:
    boxes: tuple[Box, ...]
    comps: tuple[torch.Tensor, ...]  # flat, row-major over ``boxes`` in order
    written: int = 0  # elements filled so far (new buffers)

    @property
    def numel(self) -> int:
        return sum(box_volume(b) for b in self.boxes)

    def view(self, piece: Box) -> list[torch.Tensor]:
        """Each component's elements of ``piece`` (inside one of the buffer's boxes), as views."""
        offset = 0
        for box in self.boxes:
            n = box_volume(box)
            if all(lo >= b_lo and hi <= b_hi for (lo, hi), (b_lo, b_hi) in zip(piece, box, strict=True)):
                where = index_in(piece, box)
                return [c[offset: offset + n].view(extent(box))[where] for c in self.comps]
            offset += n
        raise TransitionExecutionError(f"piece {piece} is not inside one box of the buffer {self.boxes}")


class Holdings:
    """Buffers by key; several keys may hold one tensor (a model's stages under different layouts)."""

    def __init__(self) -> None:
        self.buffers: dict[BufferKey, Buffer] = {}

    def add(self, key: BufferKey, buf: Buffer) -> None:
        self.buffers.setdefault(key, buf)  # identical copies (DP replicas of two stages) serve alike

    def find(self, model: str, state: str, name: str, piece: Box) -> list[torch.Tensor]:
        """Any buffer of the tensor that holds ``piece`` whole (the graph's rule for sources)."""
        for (m, st, n, boxes), buf in self.buffers.items():
            if (m, st, n) == (model, state, name) and any(
                    all(lo >= b_lo and hi <= b_hi for (lo, hi), (b_lo, b_hi) in zip(piece, b, strict=True))
                    for b in boxes):
                return buf.view(piece)
        raise TransitionExecutionError(f"no buffer of {model}/{state} {name} holds {piece}")

    def get(self, key: BufferKey) -> Buffer:
        try:
            return self.buffers[key]
        except KeyError:
            raise TransitionExecutionError(f"the new layout places no buffer {key} on this rank") from None

    def storage_bytes(self) -> int:
        return storage_bytes(c for b in self.buffers.values() for c in b.comps)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def weight_boxes(sm_cfg, groups) -> dict[str, Box]:
    """The contract's boxes of a rank (``rank_tensors``): the last stage's ``tied_head`` is left out,
    as it follows the embedding (``ShardedModel.sync_tied_head``)."""
    return rank_tensors(sm_cfg.arch, groups.layout, groups.rank, sm_cfg.value_head)


def optimizer_segment_boxes(cfg, groups, opt: ShardedAdam) -> list[tuple[str, tuple[Box, ...]]]:
    """(tensor, box set) of each of ``opt``'s segments: its range of the tensor's flattened TP box."""
    c = groups.coords
    boxes = dict(rank_order(cfg.arch, groups.layout, c.pp, c.tp, cfg.value_head))
    return [(opt.names[i], flat_range_boxes(boxes[opt.names[i]], a, b)) for i, a, b in opt.segments]


def holdings_of(model: str, sm: ShardedModel, into: Holdings | None = None) -> Holdings:
    """Views of ``sm``'s weights and, once Adam has stepped, its optimizer segments."""
    out = into or Holdings()
    boxes = weight_boxes(sm.cfg, sm.groups)
    for name, p in sm.shards().items():
        out.add((model, WEIGHTS, name, (boxes[name],)), Buffer((boxes[name],), (p.data.view(-1),)))
    opt = sm.optimizer
    moments = opt.moments() if opt is not None else None
    if moments is not None:
        avg, sq, _ = moments
        for (name, bset), m, a, s in zip(optimizer_segment_boxes(sm.cfg, sm.groups, opt), opt.master, avg, sq,
                                         strict=True):
            out.add((model, OPTIMIZER, name, bset), Buffer(bset, (m.data, a, s)))
    return out


def has_tied_head(sm: ShardedModel) -> bool:
    return tied_head(sm.cfg) and sm.groups.layout.pp > 1 and sm.groups.last_stage

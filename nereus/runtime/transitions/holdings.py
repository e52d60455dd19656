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

from nereus.runtime.comm.transfer import TransitionExecutionError
from nereus.runtime.parallel.sharded import ShardedModel
from nereus.spec.sharding import Box, box_volume, rank_tensors, zero_shards

WEIGHTS, OPTIMIZER = "weights", "optimizer"
BufferKey = tuple[str, str, str, tuple[Box, ...]]  # (model, state, tensor name, box set)


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


def inside(piece: Box, box: Box) -> bool:
    return all(lo >= b_lo and hi <= b_hi for (lo, hi), (b_lo, b_hi) in zip(piece, box, strict=True))


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
            if inside(piece, box):
                where = index_in(piece, box)
                return [c[offset: offset + n].view(extent(box))[where] for c in self.comps]
            offset += n
        raise TransitionExecutionError(f"piece {piece} is not inside one box of the buffer {self.boxes}")


class Holdings:
    """Buffers by key; several keys may hold one tensor (a model's stages under different layouts)."""

    def __init__(self) -> None:
        self.buffers: dict[BufferKey, Buffer] = {}
        self._by_tensor: dict[tuple[str, str, str], list[Buffer]] = {}  # for ``find``, in insertion order

    def add(self, key: BufferKey, buf: Buffer) -> None:
        if key not in self.buffers:  # identical copies (DP replicas of two stages) serve alike
            self.buffers[key] = buf
            self._by_tensor.setdefault(key[:3], []).append(buf)

    def of_tensor(self, model: str, state: str, name: str) -> list[Buffer]:
        """Every buffer of one tensor's state, in the order they were added."""
        return self._by_tensor.get((model, state, name), [])

    def find(self, model: str, state: str, name: str, piece: Box) -> list[torch.Tensor]:
        """Any buffer of the tensor that holds ``piece`` whole (the graph's rule for sources)."""
        for buf in self.of_tensor(model, state, name):
            if any(inside(piece, b) for b in buf.boxes):
                return buf.view(piece)
        raise TransitionExecutionError(f"no buffer of {model}/{state} {name} holds {piece}")

    def get(self, key: BufferKey) -> Buffer:
        try:
            return self.buffers[key]
        except KeyError:
            raise TransitionExecutionError(f"the new layout places no buffer {key} on this rank") from None


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def weight_boxes(cfg, groups) -> dict[str, Box]:
    """The contract's boxes of a rank (``rank_tensors``): the last stage's ``tied_head`` is left out,
    as it follows the embedding (``ShardedModel.sync_tied_head``)."""
    return rank_tensors(cfg.arch, groups.dims, groups.rank, cfg.value_head)


def optimizer_boxes(cfg, groups) -> list[tuple[str, tuple[Box, ...]]]:
    """(tensor, box set) of each optimizer segment a rank holds under a layout, in checkpoint order: its
    ZeRO range of the contract's flat buffer (``sharding.zero_shards``; the whole buffer without ZeRO-1),
    which is what ``ShardedAdam`` keeps."""
    c, lay = groups.coords, groups.layout
    return list(zero_shards(cfg.arch, groups.dims, c.pp_rank, c.tp_rank, c.dp_rank, cfg.value_head,
                            zero=lay.zero1 or lay.fsdp).items())


def weight_buffers(cfg, groups) -> list[tuple[str, tuple[Box, ...]]]:
    """(tensor, box set) of each weight buffer a rank holds under a layout: its boxes (``weight_boxes``), or
    under ZeRO-3 (``Layout.fsdp``) its range of the flat buffer, the optimizer's (``runtime.parallel.zero3``)."""
    if groups.layout.fsdp:
        return optimizer_boxes(cfg, groups)
    return [(name, (box,)) for name, box in weight_boxes(cfg, groups).items()]


def holdings_of(model: str, sm: ShardedModel, into: Holdings | None = None) -> Holdings:
    """Views of ``sm``'s weights and, once Adam has stepped, its optimizer segments."""
    out = into if into is not None else Holdings()
    if sm.zero3 is not None:  # views of the ZeRO-3 weight range, one per tensor it touches
        ranges = sm.zero3.weights.split([b - a for _, a, b in sm.zero3.segments()])
        for (name, bset), flat in zip(weight_buffers(sm.cfg, sm.groups), ranges, strict=True):
            out.add((model, WEIGHTS, name, bset), Buffer(bset, (flat,)))
    else:
        boxes = weight_boxes(sm.cfg, sm.groups)
        for name, p in sm.shards().items():
            out.add((model, WEIGHTS, name, (boxes[name],)), Buffer((boxes[name],), (p.data.view(-1),)))
    opt = sm.optimizer
    moments = opt.moments() if opt is not None else None
    if moments is not None:
        avg, sq, _ = moments
        for (name, bset), m, a, s in zip(optimizer_boxes(sm.cfg, sm.groups), opt.master, avg, sq, strict=True):
            out.add((model, OPTIMIZER, name, bset), Buffer(bset, (m.data, a, s)))
    return out

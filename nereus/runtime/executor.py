"""Execute a transition graph's weight moves inside one torch.distributed world (issue 6, first piece).

``nereus.elastic.build_graph`` plans the move of every model state between two plans as operations per
device: ``keep`` (a new buffer equal to an old one on the same device), ``copy`` (a local re-slice of old
buffers), ``send`` (the pieces one device receives from one source, coalesced) and ``commit``. Graph
device ``d`` is global rank ``d`` of the default group here. Every rank calls ``execute_weights`` with the
same graph: it reads the operations it takes part in, packs the pieces of each ``send`` into one flat
buffer per (source, destination) pair, exchanges all of them with one
``torch.distributed.batch_isend_irecv`` call, re-slices what is local, and returns its new shards (the
boxes ``rank_tensors`` assigns under the new layout). ``transition_model`` then installs them in a
``ShardedModel`` built for the new layout.

Only the weights of one model-stage move here: optimizer state, chunking, host detours, rollback and
memory accounting are later parts of issue 6.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from nereus.elastic.graph import TransitionGraph
from nereus.runtime.engine import ShardedModel, shard_boxes, tied_head
from nereus.runtime.groups import ParallelGroups
from nereus.runtime.model import ModelConfig
from nereus.spec.sharding import Box, box_volume

WEIGHTS = "weights"
Entry = tuple[str, Box]  # (tensor name, global box of one piece)


class TransitionExecutionError(RuntimeError):
    """The graph and the shards a rank holds disagree (a piece outside a buffer, a buffer left unfilled)."""


def _index(box: Box, origin: Box) -> tuple[slice, ...]:
    """``box`` (global coordinates) as slices of a tensor holding ``origin``."""
    out = []
    for (lo, hi), (o_lo, o_hi) in zip(box, origin, strict=True):
        if lo < o_lo or hi > o_hi:
            raise TransitionExecutionError(f"box {box} is outside the buffer {origin}")
        out.append(slice(lo - o_lo, hi - o_lo))
    return tuple(out)


def _parts(op, model: str) -> Iterator[tuple]:
    """The weight pieces of ``model`` an operation carries."""
    for m, state, part in op.parts:
        if m == model and state == WEIGHTS:
            yield from part


def _single(boxes: tuple[Box, ...], where: str) -> Box:
    if len(boxes) != 1:
        raise TransitionExecutionError(f"{where}: weight buffers are one box each, got {boxes}")
    return boxes[0]


def send_entries(op, model: str) -> list[Entry]:
    """The (tensor, box) pieces of a ``send`` op in the order both ends pack them."""
    return [(name, box) for group, piece, _dest in _parts(op, model) for name in group.names for box in piece]


def execute_weights(graph: TransitionGraph, model: str, old: dict[str, torch.Tensor] | None,
                    old_boxes: dict[str, Box] | None, new_boxes: dict[str, Box] | None,
                    dtype: torch.dtype = torch.float32,
                    device: torch.device | None = None) -> dict[str, torch.Tensor] | None:
    """Move this rank's part of ``model``'s weights as ``graph`` says.

    ``old``/``old_boxes``: this rank's shards and their global boxes under the old layout (None when the
    rank holds none); ``new_boxes``: the boxes it holds under the new layout (None when none). Returns the
    new shards by name (None when the rank is outside the new layout). Collective over the default group
    only in that every rank taking part in a ``send`` must call it.
    """
    me = dist.get_rank()
    old, old_boxes = old or {}, old_boxes or {}
    device = device or torch.device("cpu")
    new = {name: torch.empty(tuple(hi - lo for lo, hi in box), dtype=dtype, device=device)
           for name, box in (new_boxes or {}).items()}
    written = dict.fromkeys(new, 0)

    def put(name: str, box: Box, value: torch.Tensor) -> None:
        if name not in new:
            raise TransitionExecutionError(f"rank {me}: the graph writes {name}, which the new layout does not "
                                           "place here")
        new[name][_index(box, new_boxes[name])] = value
        written[name] += box_volume(box)

    def take(name: str, box: Box) -> torch.Tensor:
        if name not in old:
            raise TransitionExecutionError(f"rank {me}: the graph reads {name}, which the old layout does not "
                                           "place here")
        return old[name][_index(box, old_boxes[name])]

    sends, recvs = [], []
    for op in graph.ops:
        if op.kind == "keep" and op.device == me:
            for group, bufs in _parts(op, model):
                box = _single(bufs, "keep")
                for name in group.names:
                    put(name, box, take(name, box))
        elif op.kind == "copy" and op.device == me:
            for group, piece, _src, _dest in _parts(op, model):
                for name in group.names:
                    for box in piece:
                        put(name, box, take(name, box))
        elif op.kind == "send" and me in (op.device, op.peer) and op.device != op.peer:
            entries = send_entries(op, model)
            if not entries:
                continue
            if op.device == me:
                flat = torch.cat([take(n, b).reshape(-1) for n, b in entries]).to(dtype).contiguous()
                sends.append(dist.P2POp(dist.isend, flat, op.peer))
            else:
                flat = torch.empty(sum(box_volume(b) for _, b in entries), dtype=dtype, device=device)
                recvs.append((dist.P2POp(dist.irecv, flat, op.device), entries))
    p2p = sends + [r for r, _ in recvs]
    if p2p:
        for work in dist.batch_isend_irecv(p2p):
            work.wait()
    for recv, entries in recvs:
        offset = 0
        for name, box in entries:
            n = box_volume(box)
            put(name, box, recv.tensor[offset: offset + n].view(tuple(hi - lo for lo, hi in box)))
            offset += n
    for name, box in (new_boxes or {}).items():
        if written[name] != box_volume(box):
            raise TransitionExecutionError(f"rank {me}: {name} {box}: the graph wrote {written[name]} of "
                                           f"{box_volume(box)} elements")
    return new if new_boxes is not None else None


def transition_model(cfg: ModelConfig, graph: TransitionGraph, model: str, old: ShardedModel | None,
                     new_groups: ParallelGroups, dtype: torch.dtype = torch.float32,
                     schedule: str = "1f1b") -> ShardedModel | None:
    """``old`` (this rank's shard under the old layout, None outside it) moved to the layout of
    ``new_groups`` (created by every rank beforehand, as ``ParallelGroups`` requires): the new shard, or
    None on ranks outside the new layout. Every rank passes the same ``dtype`` (the shards' dtype)."""
    for lay in ([old.groups.layout] if old is not None else []) + [new_groups.layout]:
        if tied_head(cfg) and lay.pp > 1:
            raise ValueError("this executor does not move a tied embedding's last-stage copy (tied_head) yet")
    old_shards = old.shards() if old is not None else None
    old_boxes = shard_boxes(cfg, old.groups) if old is not None else None
    new_boxes = shard_boxes(cfg, new_groups) if new_groups.member else None
    with torch.no_grad():
        tensors = execute_weights(graph, model, old_shards, old_boxes, new_boxes, dtype, new_groups.device)
    if tensors is None:
        return None
    return ShardedModel(cfg, new_groups, tensors, dtype=dtype, schedule=schedule)

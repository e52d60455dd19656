"""Baselines for moving sharded weights between layouts, and bandwidth probes to put their times in context.

The live-transition executor (``nereus.runtime.transitions.executor``) is only worth its complexity if it beats the two
things a practitioner would do without it:

* ``gather_scatter``: funnel every tensor through one root rank and hand the new pieces back out, which is
  simple but serialises all traffic through the root's link and memory;
* ``checkpoint_reshard``: save a distributed checkpoint and load it in the new layout (checkpoint-restart),
  which pays for a disk round trip but needs no transfer plan at all.

``p2p_bandwidth`` and ``all_pairs_bandwidth`` measure the links so that benchmark times can be compared with
what the hardware allows. Every function is collective: all ranks of the default group call it together.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, init_from_local_shards
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

Box = tuple[tuple[int, int], ...]  # global (start, stop) per dim
Shards = dict[str, list[tuple[Box, torch.Tensor]]]  # name -> pieces held here: (global box, local tensor)
# (holder rank, index of the holder's piece, disjoint sub-box that this holder is responsible for)
Owned = list[tuple[int, int, Box]]


def _extent(box: Box) -> list[int]:
    return [stop - start for start, stop in box]


def _subtract(a: Box, b: Box) -> list[Box]:
    """Disjoint boxes covering ``a`` minus ``b``: peel off the slabs of ``a`` outside ``b`` one dim at a time."""
    if any(max(s1, s2) >= min(e1, e2) for (s1, e1), (s2, e2) in zip(a, b, strict=True)):
        return [a]  # no overlap
    out, rest = [], list(a)
    for d, ((s, e), (bs, be)) in enumerate(zip(a, b, strict=True)):
        if s < bs:
            out.append(tuple(rest[:d] + [(s, bs)] + rest[d + 1:]))
        if be < e:
            out.append(tuple(rest[:d] + [(be, e)] + rest[d + 1:]))
        rest[d] = (max(s, bs), min(e, be))
    return out


def _owners(boxes_by_rank: list[dict[str, list[Box]]]) -> dict[str, Owned]:
    """Assign every element to exactly one holder, lowest rank first, so replicas are sent/saved once.

    Identical replicas and disjoint pieces stay whole; only partially overlapping pieces get split."""
    owned: dict[str, Owned] = {}
    claimed: dict[str, list[Box]] = {}
    for rank, boxes in enumerate(boxes_by_rank):
        for name, pieces in boxes.items():
            for i, box in enumerate(pieces):
                todo = [box]
                for c in claimed.setdefault(name, []):
                    todo = [part for t in todo for part in _subtract(t, c)]
                todo = [t for t in todo if math.prod(_extent(t)) > 0]
                owned.setdefault(name, []).extend((rank, i, t) for t in todo)
                claimed[name].extend(todo)
    return owned


def _view(tensor: torch.Tensor, held: Box, want: Box) -> torch.Tensor:
    """The part of a piece covering global box ``want`` (which lies inside the piece's box ``held``)."""
    return tensor[tuple(slice(ws - hs, we - hs) for (hs, _), (ws, we) in zip(held, want, strict=True))]


def _device(old: Shards) -> torch.device:
    """The pieces' device; a rank holding none falls back to what the backend can carry."""
    for pieces in old.values():
        for _, t in pieces:
            return t.device
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _exchange(ops: list[dist.P2POp]) -> None:
    # batch_isend_irecv rejects an empty list, and a rank may have nothing to move
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


def gather_scatter(old: Shards, new_boxes: dict[str, list[Box]], shapes: dict[str, tuple[int, ...]],
                   dtypes: dict[str, torch.dtype], root: int = 0) -> Shards:
    """Naive baseline: assemble every full tensor on ``root``, then send each rank its new boxes.

    Only one holder of each element sends it (replicas would otherwise multiply the root's ingress), and
    the root copies its own pieces locally. Returns this rank's new pieces in ``new_boxes`` order."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device(old)
    old_meta: list[dict[str, list[Box]]] = [{} for _ in range(world)]
    dist.all_gather_object(old_meta, {n: [b for b, _ in ps] for n, ps in old.items()})
    new_meta: list[dict[str, list[Box]]] = [{} for _ in range(world)]
    dist.all_gather_object(new_meta, {n: list(bs) for n, bs in new_boxes.items()})

    # gather: every rank walks the same owner list in the same order, so sends and receives pair up
    full = {n: torch.empty(shapes[n], dtype=dtypes[n], device=device) for n in shapes} if rank == root else {}
    ops, landed = [], []
    for name, owned in _owners(old_meta).items():
        for holder, i, box in owned:
            if holder == rank:
                held, t = old[name][i]
                if rank == root:
                    _view(full[name], _full_box(shapes[name]), box).copy_(_view(t, held, box))
                else:
                    ops.append(dist.P2POp(dist.isend, _view(t, held, box).contiguous(), root))
            elif rank == root:
                buf = torch.empty(_extent(box), dtype=dtypes[name], device=device)
                ops.append(dist.P2POp(dist.irecv, buf, holder))
                landed.append((name, box, buf))
    _exchange(ops)
    for name, box, buf in landed:
        _view(full[name], _full_box(shapes[name]), box).copy_(buf)

    # scatter: the root walks every rank's list, each rank only its own
    ops, result = [], {}
    for dst in range(world) if rank == root else [rank]:
        for name, boxes in new_meta[dst].items():
            for box in boxes:
                if rank == root:
                    piece = _view(full[name], _full_box(shapes[name]), box)
                    if dst == root:
                        result.setdefault(name, []).append((box, piece.clone()))
                    else:
                        ops.append(dist.P2POp(dist.isend, piece.contiguous(), dst))
                else:
                    buf = torch.empty(_extent(box), dtype=dtypes[name], device=device)
                    ops.append(dist.P2POp(dist.irecv, buf, root))
                    result.setdefault(name, []).append((box, buf))
    _exchange(ops)
    return result


def _full_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


def _meta(box: Box, rank: int, device: torch.device) -> ShardMetadata:
    where = f"rank:{rank}/{device.type}" + (f":{device.index}" if device.index is not None else "")
    return ShardMetadata(shard_offsets=[s for s, _ in box], shard_sizes=_extent(box), placement=where)


def _load_target(boxes: list[Box], shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> ShardedTensor:
    """An empty ShardedTensor holding this rank's ``boxes``, built without talking to other ranks.

    ShardedTensor insists its global metadata tiles the tensor exactly, but new boxes may be replicated on
    several ranks. DCP's load reads only the local shards, so the metadata lists them plus filler entries
    for the rest of the tensor nominally placed on the next rank; no data is ever attached to the filler."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local = [Shard(torch.empty(_extent(b), dtype=dtype, device=device), _meta(b, rank, device)) for b in boxes]
    rest = [_full_box(shape)]
    for b in boxes:
        rest = [part for r in rest for part in _subtract(r, b)]
    filler = [_meta(r, (rank + 1) % world, device) for r in rest if math.prod(_extent(r)) > 0]
    meta = ShardedTensorMetadata([s.metadata for s in local] + filler, torch.Size(shape), TensorProperties(dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, meta)


def checkpoint_reshard(old: Shards, new_boxes: dict[str, list[Box]], shapes: dict[str, tuple[int, ...]],
                       dtypes: dict[str, torch.dtype], path: str) -> Shards:
    """Checkpoint-restart baseline, run for real: DCP ``save`` of the old pieces to ``path``, ``load`` of the new.

    Each tensor becomes a ``ShardedTensor`` whose shards carry arbitrary global offsets and sizes (uneven,
    several or none per rank), which DCP saves as chunks and, on load, reads back by intersecting the
    requested shards with the saved chunks -- DCP's own resharding. DTensor cannot express such boxes (its
    shards follow a regular placement over a device mesh), hence the older ShardedTensor type.

    Save: replicas are deduplicated (lowest holder saves) so the shards are disjoint and cover the tensor, as
    the public, validating ``init_from_local_shards`` requires. Load: new boxes may be replicated across ranks,
    which that validation rejects, so each rank builds its load target alone (see ``_load_target``, which
    uses the private ``_init_from_local_shards_and_global_metadata``). Caveats: a rank's own new boxes of
    one tensor must not overlap each other, and a world of one rank cannot load a partial tensor.
    Returns this rank's new pieces in ``new_boxes`` order."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device(old)
    old_meta: list[dict[str, list[Box]]] = [{} for _ in range(world)]
    dist.all_gather_object(old_meta, {n: [b for b, _ in ps] for n, ps in old.items()})
    owners = _owners(old_meta)

    state = {}
    for name in sorted(shapes):  # every rank builds the same tensors in the same order: the calls are collective
        mine = [(i, box) for holder, i, box in owners[name] if holder == rank]
        local = [Shard(_view(old[name][i][1], old[name][i][0], box).contiguous(), _meta(box, rank, device))
                 for i, box in mine]
        state[name] = init_from_local_shards(local, *shapes[name])
    dcp.save(state, checkpoint_id=path)
    dist.barrier()  # every rank's chunks and the coordinator's metadata file are on disk before anyone reads

    target = {n: _load_target(bs, shapes[n], dtypes[n], device) for n, bs in new_boxes.items() if bs}
    dcp.load(target, checkpoint_id=path)  # collective even for a rank that asks for nothing
    return {n: [(b, s.tensor) for b, s in zip(new_boxes[n], st.local_shards(), strict=True)]
            for n, st in target.items()}


def _sync(device: torch.device) -> None:
    # CUDA p2p work completes asynchronously to the host; the timer must see the transfer finish
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _probe_device(device: torch.device | None) -> torch.device:
    return device if device is not None else _device({})


def p2p_bandwidth(nbytes: int, repeats: int = 3, device: torch.device | None = None) -> float:
    """Bytes/s of one ``nbytes`` transfer from rank 0 to rank 1 (best of ``repeats``; all ranks return it).

    Rank 0 times from its send to a 1-byte acknowledgement sent once rank 1 holds the data, so the figure
    covers delivery rather than merely handing the buffer to the transport; the ack's latency is negligible
    for large ``nbytes``. Other ranks only join the barriers and the final broadcast."""
    if dist.get_world_size() < 2:
        raise ValueError("p2p_bandwidth needs at least two ranks")
    rank, device = dist.get_rank(), _probe_device(device)
    data = torch.empty(nbytes, dtype=torch.uint8, device=device)
    ack = torch.zeros(1, dtype=torch.uint8, device=device)
    best = math.inf
    for _ in range(repeats):
        dist.barrier()
        if rank == 0:
            t0 = time.perf_counter()
            dist.send(data, 1)
            dist.recv(ack, 1)
            _sync(device)
            best = min(best, time.perf_counter() - t0)
        elif rank == 1:
            dist.recv(data, 0)
            _sync(device)
            dist.send(ack, 0)
    dist.barrier()
    rate = torch.tensor([nbytes / best if rank == 0 else 0.0], dtype=torch.float64, device=device)
    dist.broadcast(rate, 0)
    return float(rate.item())


def all_pairs_bandwidth(nbytes: int, repeats: int = 3, device: torch.device | None = None) -> float:
    """This rank's egress rate (bytes/s) when every rank sends ``nbytes`` to every other at once, in one
    ``batch_isend_irecv``: the contended all-to-all case a layout change creates. Best of ``repeats``."""
    rank, world, device = dist.get_rank(), dist.get_world_size(), _probe_device(device)
    peers = [p for p in range(world) if p != rank]
    send = torch.empty(nbytes, dtype=torch.uint8, device=device)
    recv = {p: torch.empty(nbytes, dtype=torch.uint8, device=device) for p in peers}
    best = math.inf
    for _ in range(repeats):
        ops = [dist.P2POp(dist.isend, send, p) for p in peers] + [dist.P2POp(dist.irecv, recv[p], p) for p in peers]
        dist.barrier()
        t0 = time.perf_counter()
        _exchange(ops)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    dist.barrier()
    return nbytes * len(peers) / best if peers else 0.0

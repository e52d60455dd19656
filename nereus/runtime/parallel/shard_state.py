"""A layout's shards and Adam state read out of (and written back into) ``ShardedModel``\\ s, for
checkpoints: whole weights assembled from global boxes, and each rank's Adam state in the flat-buffer
form a checkpoint stores (fp32 master range, moments, step count), checked against the layout it is
written into."""

from __future__ import annotations

import torch

from nereus.runtime.parallel.ep import first_copy
from nereus.runtime.parallel.sharded import ShardedModel, shard_boxes

Shards = dict[str, tuple[tuple, torch.Tensor]]  # name → (global box, local tensor)


def read_shards(sm: ShardedModel) -> Shards | None:
    """name → (global box, local tensor) on DP replica 0 (other replicas hold copies; under EP each expert
    from its first holder: ``ep.first_copy``), else None. Every rank
    of the layout calls it (under ZeRO-3 the local tensors are gathered over DP)."""
    shards = {k: v for k, v in sm.shards().items() if first_copy(k, sm.groups)}  # EP: experts of other ranks
    if not shards:
        return None
    boxes = shard_boxes(sm.cfg, sm.groups)
    return {k: (tuple(boxes[k]), v.detach().clone()) for k, v in shards.items()}


def assemble(parts: list[Shards | None]) -> dict[str, torch.Tensor]:
    """Whole tensors from the boxes of ``read_shards`` (every element covered once per replica)."""
    shapes: dict[str, list[int]] = {}
    for part in filter(None, parts):
        for name, (box, _) in part.items():
            shape = shapes.setdefault(name, [0] * len(box))
            for d, (_, hi) in enumerate(box):
                shape[d] = max(shape[d], hi)
    full = {name: torch.empty(shape) for name, shape in shapes.items()}
    for part in filter(None, parts):
        for name, (box, t) in part.items():
            full[name][tuple(slice(lo, hi) for lo, hi in box)] = t
    return full


def replica_weights(sm: ShardedModel) -> dict[str, torch.Tensor] | None:
    """The replica's whole tensors (pp=1) on its TP rank 0, None on its other TP ranks: every TP rank's
    shard with its global box, gathered over the TP group — a collective every rank of the group calls.
    What a rollout engine of the layout's TP size loads: its own loaders cut each worker's shard."""
    if sm.groups.layout.pp != 1:
        raise ValueError(f"replica_weights: pp={sm.groups.layout.pp}; a rollout engine's layout has pp=1")
    if sm.groups.layout.tp == 1:
        return {k: v.detach() for k, v in sm.shards().items()}
    import torch.distributed as dist

    boxes = shard_boxes(sm.cfg, sm.groups)
    mine = {k: (tuple(boxes[k]), v.detach()) for k, v in sm.shards().items()}
    group, first = sm.groups.tp_group, sm.groups.coords.tp_rank == 0
    parts: list[Shards | None] | None = [None] * sm.groups.layout.tp if first else None
    dist.gather_object(mine, parts, dst=dist.get_global_rank(group, 0), group=group)
    return {k: v.to(sm.dtype) for k, v in assemble(parts).items()} if first else None


def read_optimizer(sm: ShardedModel) -> dict[str, torch.Tensor] | None:
    """This rank's Adam state (fp32 master range of the flat buffer, moments, step count), or None before
    the first step."""
    opt = sm.optimizer
    moments = opt.moments() if opt is not None else None
    if moments is None:
        return None
    avg, sq, step = moments
    cat = lambda ts: torch.cat(ts) if ts else torch.zeros(0)  # noqa: E731
    return {"master": opt.flat_master().clone(), "exp_avg": cat(avg), "exp_avg_sq": cat(sq),
            "step": torch.tensor([step])}


@torch.no_grad()
def write_optimizer(sm: ShardedModel, state: dict[str, torch.Tensor], lr: float) -> None:
    """Restore what ``read_optimizer`` returned on the same rank of the same layout; a state that does not
    fit this rank's ZeRO range raises ``ValueError`` saying so."""
    opt = sm.optimizer or sm.make_optimizer(lr, init_master=False)
    if state["master"].numel() != opt.hi - opt.lo:
        raise ValueError(f"optimizer shard of {tuple(state['master'].shape)} does not fit this layout's "
                         f"{opt.hi - opt.lo} elements: resume under the layout the checkpoint was written with")
    sizes = [b - a for _, a, b in opt.segments]
    split = lambda t: [x.clone() for x in torch.split(t.float(), sizes)]  # noqa: E731
    opt.install_state(split(state["master"]), split(state["exp_avg"]), split(state["exp_avg_sq"]),
                      float(state["step"][0]))

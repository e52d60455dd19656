"""A quick estimate of a plan-to-plan transition: the controller's screen before it asks the transition
graph (nereus.elastic) for the scheduled makespan.

Every model-stage whose placement changes must give each destination device its new shard of the
state it keeps across steps: bf16 weights, and for training stages fp32 master weights and Adam moments
(gradients are rebuilt by the next step). A device that already holds exactly that shard (same TP/PP
position of the same model-stage) receives nothing. Devices receive in parallel over full-duplex links,
so the time is the largest per-device receive volume over the device's link (NVLink when the old and
new GPU sets share nodes, InfiniBand otherwise), plus a latency per model-stage moved.
"""

from __future__ import annotations

from dataclasses import dataclass

from nereus.cost.hardware import Hardware
from nereus.cost.memory import BF16, OPTIMIZER_BYTES_PER_PARAM, stage_params
from nereus.spec.job import JobSpec
from nereus.spec.layout import Placement, Plan


@dataclass(frozen=True)
class TransitionEstimate:
    seconds: float
    bytes_moved: float
    moved_model_stages: tuple[str, ...]


def state_bytes_per_device(job: JobSpec, p: Placement) -> float:
    """Bytes of state one device of ``p`` keeps across steps (weights; training adds optimizer state)."""
    params = stage_params(job.models[p.model_stage.model], p.layout, job.has_value_head(p.model_stage.model))
    if p.layout.fsdp:
        params /= p.layout.dp
    if p.model_stage.stage != "training":
        return params * BF16
    shard = p.layout.dp if p.layout.zero1 and not p.layout.fsdp else 1
    return params * (BF16 + OPTIMIZER_BYTES_PER_PARAM / shard)


def _position(p: Placement, gpu: int) -> tuple[int, int] | None:
    """(pp_rank, tp_rank) of ``gpu`` in ``p``: the shard it holds (DP replicas hold the same one)."""
    try:
        rank = p.gpus.index(gpu)
    except ValueError:
        return None
    pp_rank, _, tp_rank = p.layout.coords(rank)
    return pp_rank, tp_rank


def estimate_transition(hw: Hardware, job: JobSpec, old: Plan, new: Plan) -> TransitionEstimate:
    recv = [0.0] * max(new.num_gpus, old.num_gpus)
    moved, total = [], 0.0
    for p in new.placements:
        try:
            q = old.placement(p.model_stage)
        except KeyError:
            q = None
        if q is not None and q.layout == p.layout and q.gpus == p.gpus:
            continue
        moved.append(str(p.model_stage))
        size = state_bytes_per_device(job, p)
        same_shape = q is not None and (q.layout.tp, q.layout.pp) == (p.layout.tp, p.layout.pp)
        for g in p.gpus:
            if same_shape and _position(q, g) == _position(p, g):
                continue
            recv[g] += size
            total += size
    if not moved:
        return TransitionEstimate(0.0, 0.0, ())
    old_nodes = {hw.cluster.node_of(g) for q in old.placements for g in q.gpus}
    cross = any(hw.cluster.node_of(g) not in old_nodes for p in new.placements for g in p.gpus)
    seconds = hw.p2p_time(max(recv), cross_node=cross or hw.cluster.nodes > 1 and len(old_nodes) > 1)
    return TransitionEstimate(seconds + len(moved) * hw.priors.inter_latency_s, total, tuple(moved))

"""A quick estimate of a plan-to-plan transition: the controller's screen before it asks the transition
graph (nereus.elastic) for the scheduled makespan.

Every model-stage whose placement changes must give each destination device its new shard of the
state it keeps across steps: bf16 weights, and for training stages fp32 master weights and Adam moments
(gradients are rebuilt by the next step). A device that already holds exactly that shard (same TP/PP
position of the same model-stage) receives nothing. Devices receive in parallel over full-duplex links,
so the time is the largest per-device receive volume over the device's link (NVLink when the old and
new GPU sets share nodes, InfiniBand otherwise), plus a latency per model-stage moved.

That is the bandwidth part. A transition also has a fixed part that moves no bytes: the driver's round
trips to every worker, regrouping process groups of the new layouts, rebuilding inference engines and
freeing the old state. A rollout engine that is a program of its own (vLLM; ``EngineTraits.restarts_on_move``)
is started anew on a moved generation stage, one per data-parallel replica, in parallel; that start (tens of
seconds on a GPU: loading, compiling, capturing graphs) dwarfs the rest. ``TransitionFit`` prices it as

    t = bytes_factor · t_bandwidth + fixed_s + per_stage_s · (model-stages moved)
        + engine_start_s · [engines rebuilt]

and ``TransitionCalibrator`` fits the four numbers to measured transitions (non-negative least squares
on relative errors with a ridge pull towards the prior, as ``nereus.cost.calibration`` does for stage
times), so the controller's admission test sees what a move costs on this cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from nereus.cost.calibration import nnls
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
    pp_rank, _, tp_rank = p.layout.dims.coords(rank)
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


@dataclass(frozen=True)
class TransitionFit:
    """Transition time from its bandwidth-bound time and the model-stages it moves (module docstring)."""

    bytes_factor: float = 1.0
    fixed_s: float = 0.0
    per_stage_s: float = 0.0
    engine_start_s: float = 0.0  # once per move that rebuilds engines (they start in parallel)

    @staticmethod
    def prior(hw: Hardware) -> TransitionFit:
        p = hw.priors
        return TransitionFit(1.0, p.transition_fixed_s, p.transition_per_stage_s, p.engine_start_s)

    def seconds(self, bandwidth_s: float, moved_stages: int, engines: int = 0) -> float:
        """A plan that moves nothing costs nothing; every real move pays the fixed part once, and the
        engines' start once when it rebuilds any."""
        if moved_stages == 0 and bandwidth_s == 0:
            return 0.0
        return (self.bytes_factor * bandwidth_s + self.fixed_s + self.per_stage_s * moved_stages
                + self.engine_start_s * (engines > 0))


def moved_stages(old: Plan, new: Plan) -> int:
    """Model-stages of ``new`` whose layout or devices differ from ``old`` (new ones included)."""
    before = {p.model_stage: (p.layout, p.gpus) for p in old.placements}
    return sum(before.get(p.model_stage) != (p.layout, p.gpus) for p in new.placements)


def engines_rebuilt(job: JobSpec, old: Plan, new: Plan) -> int:
    """Rollout engines a move starts anew: with an engine that restarts on a move
    (``EngineTraits.restarts_on_move``: vLLM), one per data-parallel replica
    of a generation stage whose layout or devices change, except a replica whose engine device (its TP rank
    0) held an engine of the same TP size before: that worker keeps its engine running and reloads it
    (``runtime.engines.pool``)."""
    if job.run is None or not job.run.rollout_engine.traits.restarts_on_move:
        return 0
    before = {p.model_stage: p for p in old.placements}
    started = 0
    for p in new.placements:
        was = before.get(p.model_stage)
        if p.model_stage.stage != "generation" or was == p:
            continue
        kept = set() if was is None or was.layout.tp != p.layout.tp else set(engine_devices(was))
        started += sum(g not in kept for g in engine_devices(p))
    return started


def engine_devices(p: Placement) -> list[int]:
    """The devices of a generation placement's engines: each data-parallel replica's TP rank 0 (pp = 1)."""
    dims = p.layout.dims
    return [p.gpus[dims.rank(0, d, 0)] for d in range(dims.dp)]


@dataclass
class TransitionCalibrator:
    """``TransitionFit`` fitted to measured transitions: rows (bandwidth-bound s, stages moved, engines
    rebuilt, measured s).

    With one kind of move only (the same number of model-stages every time) the fixed and per-stage
    terms are not separately identifiable; the ridge then splits them, and the fit still predicts that
    kind of move right."""

    prior: TransitionFit = TransitionFit()
    ridge: float = 1e-4
    max_rows: int = 64
    rows: list[tuple[float, int, int, float]] = field(default_factory=list)
    fit: TransitionFit | None = None

    def __post_init__(self) -> None:
        self.fit = self.fit or self.prior

    def observe(self, bandwidth_s: float, moved: int, measured_s: float, engines: int = 0) -> TransitionFit:
        if not (0 < measured_s < float("inf")) or moved < 1:
            return self.fit  # a move that moved nothing, or no measurement, tells nothing
        self.rows.append((max(0.0, bandwidth_s), moved, engines, measured_s))
        del self.rows[: max(0, len(self.rows) - self.max_rows)]
        a = np.array([[b / y, 1 / y, m / y, (e > 0) / y] for b, m, e, y in self.rows])
        p = self.prior
        prior = np.array([p.bytes_factor, p.fixed_s, p.per_stage_s, p.engine_start_s])
        lam = np.sqrt(self.ridge * len(self.rows))
        # the pull is on each number relative to its prior where that is over a second (an engine start
        # of tens of seconds), absolute otherwise (factors near 1, fixed parts near 0)
        scale = np.maximum(np.abs(prior), 1.0)
        c = nnls(np.vstack([a, lam * np.diag(1 / scale)]),
                 np.concatenate([np.ones(len(self.rows)), lam * prior / scale]))
        self.fit = TransitionFit(*(float(x) for x in c))
        return self.fit

    def relative_errors(self) -> list[float]:
        return [self.fit.seconds(b, m, e) / y - 1 for b, m, e, y in self.rows]

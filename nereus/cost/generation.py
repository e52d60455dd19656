"""Generation at sequence granularity, and a generation stage that changes layout mid-stage: the pricing.

One model prices the stage for both sides of the control loop: the simulator's ground truth runs it on each
step's drawn lengths under its hidden factors, the policies (``control.intrastep``) on the forecast's
quantiles under their calibrated factors. Each replica's decode timing under continuous batching is
``cost.batching``'s (``Factors``, ``step_table``, ``run_replicas``): the decode model's step cost at the
live batch, ``slots`` sequences in flight, a freed slot refilled at once (Yu et al. 2022, "Orca").

A tail layout (``spec.generation.TailPhase``) switches the stage at a trigger — at most ``trigger_live``
sequences still generating — from the bulk layout (the plan's generation placement: many narrow replicas,
throughput) to ``tail_replicas`` replicas of TP ``tail_tp`` on the first GPUs of the placement (latency).
Every unfinished sequence either sends its KV caches (per layer and KV-head range:
``elastic.tail_plan`` builds the piece-level plan) or is dropped and re-prefilled there (prompt plus
generated tokens), whichever is cheaper for its group of similar contexts (PAT, arXiv 2605.23945, migrates
or recomputes the same way). Sources free their caches only after the commit point, so the move's memory
peak holds both. With ``overlap``, the GPUs the tail frees run the inference model-stages on finished
samples (RLHFuse's inter-stage fusion, arXiv 2409.13221).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from nereus.cost.batching import Factors, ReplicaRun, StepTable, run_replicas, step_table
from nereus.cost.hardware import Hardware, kv_cache_budget
from nereus.cost.plan_cost import PlanEstimate, resident_per_device
from nereus.cost.stages import ENGINE_MAX_SEQUENCES
from nereus.cost.static_decode import decodes_static
from nereus.spec.generation import TailPhase
from nereus.spec.job import JobSpec, ResponseLength
from nereus.spec.layout import ModelStage, Placement, Plan
from nereus.spec.model import ModelArch
from nereus.spec.parallel_dims import tp_splits

ROLLOUT = ModelStage("actor", "generation")
COLUMNS = 512  # decode-step columns per replica at most: bucket = ceil(longest / COLUMNS) tokens
KV_GROUPS = 8  # sequence groups (by context) for the send-or-recompute choice


@dataclass
class GenModel:
    """What prices a plan's generation stage: replicas, slots, memory (from the plan's estimate)."""

    hw: Hardware
    job: JobSpec
    plan: Plan
    placement: Placement
    slots: int
    resident: list[float]  # bytes per device held across the step (all models)
    kv_used: float  # bytes per device of the bulk replicas' KV caches at their fullest

    @staticmethod
    def of(hw: Hardware, job: JobSpec, plan: Plan, est: PlanEstimate) -> GenModel:
        p = plan.placement(ROLLOUT)
        cost = est.costs[str(ROLLOUT)]
        per_replica = cost.detail.get("batch_per_replica", 1)
        slots = int(cost.detail.get("concurrent", per_replica))
        resident = resident_per_device(hw, job, plan, est.costs)
        return GenModel(hw, job, plan, p, max(1, slots), resident, cost.transient_bytes)

    @property
    def arch(self) -> ModelArch:
        return self.job.models["actor"]

    def table(self, tp: int) -> StepTable:
        return step_table(self.hw, self.arch, tp, self.job.options.weight_bytes, self.job.options.rollout_engine)

    @property
    def static(self) -> bool:
        """Static batches: an engine without a paged KV cache, or generate calls each waited for
        (``cost.static_decode``)."""
        return decodes_static(self.job.options)

    def replica_gpus(self, replica: int) -> list[int]:
        dims = self.placement.layout.dims
        return [self.placement.gpus[dims.rank(pp, replica, t)] for pp in range(dims.pp) for t in range(dims.tp)]

    def tail_slots(self, tp: int) -> int:
        """Sequences a tail replica of TP ``tp`` holds at full length (the same KV budget rule)."""
        arch, wl = self.arch, self.job.workload
        weights = arch.params() * self.job.options.weight_bytes / tp
        others = max(self.resident[g] for g in self.placement.gpus) - self.placement_weights()
        budget = kv_cache_budget(self.hw, weights, others, self.job.options.gpu_memory_utilization)
        per_seq = arch.kv_bytes_per_token() / min(tp, arch.kv_heads) * (wl.prompt_length + wl.response.max)
        return int(max(0, min(ENGINE_MAX_SEQUENCES, budget // per_seq)))

    def placement_weights(self) -> float:
        lay = self.placement.layout
        return self.arch.params() * self.job.options.weight_bytes / (lay.tp * lay.pp)

    def kv_token_bytes(self, tp: int) -> float:
        """KV bytes per token on one rank of a TP ``tp`` replica (heads beyond the KV heads replicated)."""
        return self.arch.kv_bytes_per_token() / min(tp, self.arch.kv_heads)


@dataclass
class BulkRun:
    """Every bulk replica's run of one step's lengths (sequence i on replica i mod dp)."""

    lengths: np.ndarray
    replica: np.ndarray  # bulk replica of each sequence
    start_s: np.ndarray
    finish_s: np.ndarray
    runs: list[ReplicaRun]
    bucket: int
    start_col: np.ndarray  # the column each sequence starts at on its replica (ReplicaRun.start_col, by id)

    @property
    def end_s(self) -> float:
        return float(self.finish_s.max())

    def members(self, replica: int) -> np.ndarray:
        """The sequences of ``replica``, ascending (``flatnonzero(self.replica == replica)`` without the scan
        over every sequence, which at 1,024 GPUs made the per-replica loops quadratic)."""
        return np.arange(replica, len(self.lengths), len(self.runs))


def run_bulk(model: GenModel, lengths: np.ndarray, f: Factors, contexts: np.ndarray | None = None) -> BulkRun:
    """Every bulk replica decoding ``lengths`` (sequence i on replica i mod dp, in order) after the prompt,
    or after ``contexts`` tokens each (responses resumed from an earlier step: their context re-prefilled)."""
    lay, prompt = model.placement.layout, float(model.job.workload.prompt_length)
    n, dp = len(lengths), lay.dp
    ctx = np.full(n, prompt) if contexts is None else np.asarray(contexts, float)
    bucket = max(1, math.ceil(float(lengths.max()) / COLUMNS))
    table = model.table(lay.tp)
    replica = np.arange(n) % dp
    start, finish, start_col = np.zeros(n), np.zeros(n), np.zeros(n, np.int64)
    groups = [np.arange(r, n, dp) for r in range(dp)]  # flatnonzero(replica == r)
    work = [(lengths[i], ctx[i], float(ctx[i].sum()), float(ctx[i].mean()) if len(i) else prompt) for i in groups]
    runs = run_replicas(table, work, model.slots, bucket, f, model.static)
    for idx, run in zip(groups, runs, strict=True):
        start[idx], finish[idx], start_col[idx] = run.start_s, run.finish_s, run.start_col
    return BulkRun(lengths, replica, start, finish, runs, bucket, start_col)


def trigger_time(bulk: BulkRun, k: int) -> float:
    """The earliest time at most ``k`` sequences are still generating (started and not finished)."""
    fin = np.sort(bulk.finish_s)
    started = np.searchsorted(np.sort(bulk.start_s), fin, side="right")
    live = started - np.arange(1, len(fin) + 1)
    hit = np.flatnonzero(live <= k)
    return float(fin[hit[0]]) if len(hit) else float(fin[-1])


@dataclass
class GenOutcome:
    """One generation stage as run: where its time went and what a mid-stage move did."""

    generation_s: float
    bulk_s: float  # until the trigger (no move: until at most 10% of the sequences are left)
    migration_s: float  # pause for the move: transfers to the commit point, then re-prefills
    tail_s: float
    idle_gpu_s: float  # GPU-seconds of the stage's GPUs doing nothing (inference overlap excluded)
    moved: bool = False
    refused: str = ""  # why a planned move did not run (memory)
    unfinished: int = 0  # sequences moved at the trigger
    kv_sent: int = 0
    recomputed: int = 0
    bytes_sent: float = 0.0
    move_peak_bytes: float = 0.0  # fullest tail device while the move runs (both copies held) or after
    overlap_share: float = 0.0  # share of the inference GPUs the tail frees
    overlap_window_s: float = 0.0  # from the commit point to the end of generation
    segments: list = field(default_factory=list)  # (group, kind, start_s, end_s) for the timeline

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "segments"}


def no_move(model: GenModel, bulk: BulkRun) -> GenOutcome:
    end = bulk.end_s
    n = len(bulk.lengths)
    t10 = trigger_time(bulk, max(1, n // 10))
    gpus = model.placement.layout.tp * model.placement.layout.pp
    idle = sum(gpus * (end - r.end_s) for r in bulk.runs)
    segs = [(f"replica {r}", "bulk", 0.0, run.end_s) for r, run in enumerate(bulk.runs)]
    return GenOutcome(end, t10, 0.0, end - t10, idle, segments=segs)


def tail_assignment(model: GenModel, bulk: BulkRun, ids: np.ndarray, phase: TailPhase) -> np.ndarray:
    """Tail replica of each unfinished sequence: kept in place when the tail replica is its own bulk
    replica (same TP, PP 1), else round-robin in sequence order."""
    lay = model.placement.layout
    src = bulk.replica[ids]
    if phase.tail_tp == lay.tp and lay.pp == 1:
        out = np.where(src < phase.tail_replicas, src, -1)
        moving = np.flatnonzero(out < 0)
        out[moving] = np.arange(len(moving)) % phase.tail_replicas
        return out
    return np.arange(len(ids)) % phase.tail_replicas


def generated_at(bulk: BulkRun, ids: np.ndarray, t: float | np.ndarray) -> np.ndarray:
    """Response tokens each sequence of ``ids`` had generated by time ``t`` (0 if not yet started); ``t`` is
    one time, or one per bulk replica (each sequence read at its replica's)."""
    times = np.broadcast_to(np.asarray(t, float), (len(bulk.runs),))
    rep = bulk.replica[ids]
    if len(rep) and (rep == rep[0]).all():  # one replica's sequences (the speculation lever asks per replica)
        replicas, which = rep[:1], np.zeros(len(rep), np.int64)
    else:
        replicas, which = np.unique(rep, return_inverse=True)
    done_cols = np.array([np.searchsorted(bulk.runs[r].cum_s, times[r], side="right") for r in replicas.tolist()],
                         np.int64)
    cols = np.maximum(0, done_cols[which] - bulk.start_col[ids])
    return np.minimum(cols * bulk.bucket, bulk.lengths[ids] - 1).astype(float)


def kv_choice(model: GenModel, ctx: np.ndarray, phase: TailPhase, cross: bool, f: Factors) -> np.ndarray:
    """True where a sequence re-prefills instead of sending its caches: per group of similar contexts, the
    cheaper of the transfer (bandwidth term) and the prefill of its tokens on a tail replica."""
    if phase.kv != "cheaper":
        return np.full(len(ctx), phase.kv == "recompute")
    hw, table = model.hw, model.table(phase.tail_tp)
    per_token = model.kv_token_bytes(phase.tail_tp)
    order = np.argsort(ctx)
    out = np.zeros(len(ctx), bool)
    for group in np.array_split(order, min(KV_GROUPS, len(ctx))):
        tokens = float(ctx[group].sum())
        send = (hw.p2p_time(tokens * per_token, cross) - hw.p2p_time(0.0, cross)) * f.transfer
        recompute = table.prefill(tokens, float(ctx[group].mean()), f)
        out[group] = recompute < send
    return out


def nodes_of(model: GenModel, gpus) -> set[int]:
    return {model.hw.cluster.node_of(g) for g in gpus}


def with_tail(model: GenModel, bulk: BulkRun, phase: TailPhase, f: Factors,
              inference_gpus: frozenset[int] = frozenset(), t_star: float | None = None) -> GenOutcome:
    """The stage with ``phase``'s switch at ``t_star`` (default: its trigger, the first time at most
    ``trigger_live`` sequences are still generating); a move that would overfill a device is refused."""
    lay, hw = model.placement.layout, model.hw
    gpus = list(model.placement.gpus)
    t_star = trigger_time(bulk, phase.trigger_live) if t_star is None else t_star
    refusal = _tail_refusal(model, bulk, phase, t_star)
    if refusal is not None:
        return refusal
    ids = np.flatnonzero(bulk.finish_s > t_star)
    prompt = float(model.job.workload.prompt_length)
    generated = generated_at(bulk, ids, t_star)
    ctx, remaining = prompt + generated, bulk.lengths[ids] - generated
    dest = tail_assignment(model, bulk, ids, phase)
    kept = (dest == bulk.replica[ids]) & (phase.tail_tp == lay.tp) & (lay.pp == 1)
    tail_gpus = gpus[:phase.tail_gpus]
    src_gpus = {g for r in set(bulk.replica[ids].tolist()) for g in model.replica_gpus(int(r))}
    cross = bool(nodes_of(model, src_gpus) - nodes_of(model, tail_gpus))
    recompute = kv_choice(model, ctx, phase, cross, f) & ~kept
    send = ~recompute & ~kept
    sends, weight_s, peak = _move_sizes(model, bulk, phase, ids, ctx, remaining, dest, send, cross, f)
    if peak > hw.usable_bytes():
        return _refused(model, bulk, f"the move needs {peak / 1e9:.1f} GB on a tail device, usable "
                                     f"{hw.usable_bytes() / 1e9:.1f} GB", peak)
    commit = max(sends) + weight_s + hw.priors.inter_latency_s
    runs = _run_tail(model, bulk, phase, dest, recompute, remaining, ctx, model.tail_slots(phase.tail_tp), f)
    tail_start = t_star + commit
    prefill = max((r.prefill_s for r in runs), default=0.0)
    end = tail_start + max(r.end_s for r in runs)
    migration = commit + prefill
    group = lay.tp * lay.pp
    idle = sum(group * max(0.0, t_star - r.end_s) for r in bulk.runs)
    idle += sum(phase.tail_tp * (end - tail_start - r.end_s) for r in runs)
    freed = set(gpus) - set(tail_gpus)
    share = len(freed & inference_gpus) / len(inference_gpus) if phase.overlap and inference_gpus else 0.0
    idle += len(freed) * (end - tail_start)  # the caller moves the overlapped inference out of it
    segs = _segments(bulk, runs, t_star, tail_start, prefill)
    return GenOutcome(end, t_star, migration, end - t_star - migration, idle, True, "", len(ids), int(send.sum()),
                      int(recompute.sum()), float(sum(ctx[send]) * model.arch.kv_bytes_per_token()), peak, share,
                      end - tail_start, segs)


def _move_sizes(model: GenModel, bulk: BulkRun, phase: TailPhase, ids: np.ndarray, ctx: np.ndarray,
                remaining: np.ndarray, dest: np.ndarray, send: np.ndarray, cross: bool,
                f: Factors) -> tuple[list[float], float, float]:
    """Seconds of each tail replica's incoming KV transfer, of the weights' reshard (a new TP or PP), and
    the fullest tail device while the move runs (old caches held until the commit) or after it."""
    lay, hw = model.placement.layout, model.hw
    gpus = list(model.placement.gpus)
    tail_gpus = gpus[:phase.tail_gpus]
    per_rank = model.kv_token_bytes(phase.tail_tp)
    new_weights = model.arch.params() * model.job.options.weight_bytes / phase.tail_tp
    reshard = phase.tail_tp != lay.tp or lay.pp != 1
    weight_s = (hw.p2p_time(new_weights, False) * f.transfer) if reshard else 0.0
    sends, peak = [], 0.0
    bulk_kv_rank = model.kv_token_bytes(lay.tp) / lay.pp
    live_ctx = np.bincount(bulk.replica[ids], ctx, lay.dp)  # context tokens cached per bulk replica
    position = {g: i for i, g in enumerate(gpus)}
    for j in range(phase.tail_replicas):
        mine = dest == j
        incoming = float((ctx[mine & send]).sum()) * per_rank
        sends.append(hw.p2p_time(incoming, cross) * f.transfer if incoming else 0.0)
        final_kv = float((ctx[mine] + remaining[mine]).sum()) * per_rank
        for g in tail_gpus[j * phase.tail_tp:(j + 1) * phase.tail_tp]:
            r = lay.dims.coords(position[g]).dp_rank  # the bulk replica this device served
            held = model.resident[g] + live_ctx[r] * bulk_kv_rank  # freed only after the commit
            during = held + (new_weights if reshard else 0.0) + incoming
            after = model.resident[g] + final_kv + (new_weights - model.placement_weights() if reshard else 0.0)
            peak = float(max(peak, during, after))
    return sends, weight_s, peak


def _run_tail(model: GenModel, bulk: BulkRun, phase: TailPhase, dest: np.ndarray, recompute: np.ndarray,
              remaining: np.ndarray, ctx: np.ndarray, slots: int, f: Factors) -> list:
    """Decode each tail replica's sequences (remaining tokens after their context; re-prefilled ones first)."""
    work = []
    for j in range(phase.tail_replicas):
        mine, rec = dest == j, (dest == j) & recompute
        work.append((remaining[mine], ctx[mine], float(ctx[rec].sum()), float(ctx[rec].mean()) if rec.any() else 0.0))
    return run_replicas(model.table(phase.tail_tp), work, slots, bulk.bucket, f)


def _tail_refusal(model: GenModel, bulk: BulkRun, phase: TailPhase, t_star: float) -> GenOutcome | None:
    """The stage without a move when ``phase`` cannot apply: a tail layout the placement cannot hold, no
    sequence left at ``t_star``, or a tail replica too small for one full-length sequence."""
    too_wide = phase.tail_tp > model.hw.cluster.gpus_per_node or not tp_splits(model.arch, phase.tail_tp)
    if phase.tail_gpus > len(model.placement.gpus) or too_wide:
        why = f"tail layout TP {phase.tail_tp} x {phase.tail_replicas} does not fit the placement"
        return _refused(model, bulk, why)
    if not np.any(bulk.finish_s > t_star):
        return _refused(model, bulk, "")
    if model.tail_slots(phase.tail_tp) < 1:
        return _refused(model, bulk, f"a TP {phase.tail_tp} tail replica holds no full-length sequence")
    return None


def _segments(bulk: BulkRun, runs: list, t_star: float, tail_start: float,
              prefill: float) -> list[tuple[str, str, float, float]]:
    """Timeline segments of a phased stage: each bulk replica up to the trigger, the move, each tail replica."""
    segs = [(f"replica {r}", "bulk", 0.0, min(t_star, run.end_s)) for r, run in enumerate(bulk.runs)]
    segs += [("all", "migration", t_star, tail_start + prefill)]
    segs += [(f"tail {j}", "tail", tail_start + prefill, tail_start + run.end_s) for j, run in enumerate(runs)]
    return segs


def _refused(model: GenModel, bulk: BulkRun, why: str, peak: float = 0.0) -> GenOutcome:
    out = no_move(model, bulk)
    out.refused, out.move_peak_bytes = why, peak
    return out


def overlapped_inference(inference_s: float, out: GenOutcome, sequences: int) -> tuple[float, float]:
    """(inference seconds left after generation, seconds it ran early on the tail's freed GPUs): the freed
    share of the inference GPUs works through the finished samples during the tail; the samples still in
    the tail at its trigger are scored after it (then training starts)."""
    if not out.moved or out.overlap_share <= 0 or inference_s <= 0:
        return inference_s, 0.0
    ready = 1.0 - out.unfinished / max(1, sequences)
    done = min(ready, out.overlap_share * out.overlap_window_s / inference_s)
    return inference_s * (1 - done), inference_s * done


# ----- a policy's prediction of one step, on the forecast ---------------------------------------------

def forecast_lengths(resp: ResponseLength, n: int) -> np.ndarray:
    """``n`` response lengths standing for the forecast: equally weighted quantiles, the largest set to the
    expected longest of ``n`` draws, in a fixed shuffled order (sequence i runs on replica i mod dp)."""
    q = np.array(resp.quantiles(64), float)
    lengths = np.interp(np.linspace(0, len(q) - 1, n), np.arange(len(q)), q)
    lengths[-1] = max(lengths[-1], float(resp.longest(n)))
    return np.maximum(1.0, lengths[np.random.default_rng(0).permutation(n)])


def inference_gpus(plan: Plan) -> frozenset[int]:
    return frozenset(g for p in plan.placements if p.model_stage.stage == "inference" for g in p.gpus)


@dataclass
class Prediction:
    """The model's view of one step's generation and inference, with and without the move."""

    base_s: float  # generation + inference without a move
    phased_s: float  # with it (inference overlapped on the freed GPUs)
    migration_s: float
    outcome: GenOutcome

    @property
    def gain_s(self) -> float:
        return self.base_s - self.phased_s

    def to_dict(self) -> dict:
        return {"base_s": self.base_s, "phased_s": self.phased_s, "gain_s": self.gain_s,
                "migration_s": self.migration_s}


def predict(model: GenModel, bulk: BulkRun, phase: TailPhase, f: Factors, inference_s: float,
            base: GenOutcome | None = None) -> Prediction:
    base = base or no_move(model, bulk)
    out = with_tail(model, bulk, phase, f, inference_gpus(model.plan))
    after, _ = overlapped_inference(inference_s, out, len(bulk.lengths))
    return Prediction(base.generation_s + inference_s, out.generation_s + after, out.migration_s, out)

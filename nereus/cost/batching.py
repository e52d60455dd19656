"""A generation replica's decode timing under continuous batching (``cost.generation`` builds on it).

Per decode step it uses the decode model's step cost (``nereus.cost.decode.StepModel``: weight reads vs GEMM
FLOPs, KV reads at the live context, two all-reduces per layer, engine costs) at the step's live batch; a
replica keeps ``slots`` sequences in flight and refills a slot as soon as its sequence ends (continuous
batching; Yu et al. 2022, "Orca"), then drains. Decode steps are grouped into columns of ``bucket`` tokens
so a 20k-token tail costs a few hundred array entries. Pure functions of their inputs: no plan, no job.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import cached_property, lru_cache
from itertools import pairwise

import numpy as np

from nereus.cost.decode import StepModel, prefill_time
from nereus.cost.hardware import Hardware
from nereus.cost.stages import ENGINE_MAX_SEQUENCES, generation_replica
from nereus.spec.engines import PRICING_ENGINE
from nereus.spec.model import ModelArch


@dataclass(frozen=True)
class Factors:
    """Multipliers on the decode terms, on prefill and on transfers (hidden truth or calibrated fit)."""

    memory: float = 1.0
    compute: float = 1.0
    tp_comm: float = 1.0
    overhead: float = 1.0
    transfer: float = 1.0

    @staticmethod
    def of(factors: dict[str, float] | None, transfer: float = 1.0) -> Factors:
        f = factors or {}

        def g(t: str) -> float:
            return f.get(f"generation.{t}", f.get(t, 1.0)) or 1.0
        return Factors(g("memory"), g("compute"), g("tp_comm"), g("overhead"), transfer)


class StepTable:
    """A replica's decode-step cost as arrays over the live batch (``StepModel`` worked out per batch)."""

    def __init__(self, hw: Hardware, arch: ModelArch, tp: int, weight_bytes: int, bmax: int,
                 engine: str = PRICING_ENGINE) -> None:
        self.replica = generation_replica(hw, arch, tp, weight_bytes, engine=engine)
        m = StepModel(self.replica)
        self.model = m
        self.weights_s, self.kv_s = m.weights_s, max(m.kv_s_per_token, m.attn_s_per_token)
        self.comm_fixed, self.comm_per_seq = m.comm_fixed, m.comm_per_seq
        self.per_seq, self.fixed = m.per_seq_s, m.fixed_s
        self.compute = np.array([0.0] + [m.compute_s(b) for b in range(1, bmax + 1)])
        # weight reads by batch: constant for a dense model, the experts hit for an MoE one (``cost.moe``)
        self.reads = (np.full(bmax + 1, m.weights_s) if m.experts is None
                      else np.array([m.weights_s] + [m.read_s(b) for b in range(1, bmax + 1)]))

    def seconds(self, live: np.ndarray, ctx_sum: np.ndarray, f: Factors) -> np.ndarray:
        """One decode step at each (live batch, summed context); 0 where nothing is live."""
        at = np.minimum(live, len(self.compute) - 1).astype(int)
        comp, reads = self.compute[at], self.reads[at]
        mem_bound = reads >= comp
        gemm = np.where(mem_bound, reads * f.memory, comp * f.compute)
        tp = (self.comm_fixed + live * self.comm_per_seq) * f.tp_comm if self.comm_fixed else 0.0
        t = gemm + ctx_sum * self.kv_s * f.memory + tp + (live * self.per_seq + self.fixed) * f.overhead
        return np.where(live > 0, t, 0.0)

    def prefill(self, tokens: float, context: float, f: Factors) -> float:
        return prefill_time(self.replica, tokens, context) * f.compute if tokens > 0 else 0.0


@lru_cache(maxsize=64)
def step_table(hw: Hardware, arch: ModelArch, tp: int, weight_bytes: int, engine: str = PRICING_ENGINE) -> StepTable:
    return StepTable(hw, arch, tp, weight_bytes, ENGINE_MAX_SEQUENCES, engine)


@dataclass
class ReplicaRun:
    """One replica's continuous-batching run: per-sequence start and finish times (seconds from its start)."""

    start_s: np.ndarray
    finish_s: np.ndarray
    cum_s: np.ndarray  # seconds at the end of each column (prefill included)
    start_col: np.ndarray
    prefill_s: float
    bucket: int

    @cached_property  # asked per replica by every lever and tail pricing (millions of times at 1,024 GPUs)
    def end_s(self) -> float:
        return float(self.finish_s.max()) if len(self.finish_s) else 0.0


def _list_schedule(cols: np.ndarray, slots: int) -> np.ndarray:
    """The start column of each sequence: the first ``slots`` at once, then each queued sequence taking the
    slot that frees first (list scheduling)."""
    start = np.zeros(len(cols), np.int64)
    free = [int(c) for c in cols[:slots]]
    heapq.heapify(free)
    for i in range(slots, len(cols)):
        start[i] = free[0]
        heapq.heapreplace(free, free[0] + int(cols[i]))
    return start


def _static_schedule(cols: np.ndarray, slots: int) -> np.ndarray:
    """The start column of each sequence in static batches of ``slots`` (``cost.static_decode``): a batch
    starts when the previous one's longest ends."""
    start, at = np.zeros(len(cols), np.int64), 0
    for lo in range(0, len(cols), slots):
        start[lo:lo + slots] = at
        at += int(cols[lo:lo + slots].max())
    return start


def run_replicas(table: StepTable, work: list[tuple[np.ndarray, np.ndarray, float, float]], slots: int,
                 bucket: int, f: Factors, static: bool = False) -> list[ReplicaRun]:
    """Each replica decodes its ``remaining`` tokens per sequence (arrival order) after ``context`` tokens,
    ``slots`` in flight, a freed slot refilled at once (``static``: batches of ``slots``, each waiting for
    the last one's longest), after a prefill of (tokens, context); columns of ``bucket`` decode steps. All
    replicas in one array pass (a row each; sequences concatenated by row). A static batch's finished rows
    keep stepping with it in the engine; here they stop counting toward the live batch, which a
    memory-bound step barely feels."""
    rows = len(work)
    if not rows:
        return []
    bounds = [0, *np.cumsum([len(w[0]) for w in work]).tolist()]  # replica i's sequences: bounds[i]:bounds[i+1]
    cols = np.maximum(1, np.ceil(np.concatenate([np.asarray(w[0]) for w in work]) / bucket)).astype(np.int64)
    st = np.zeros(len(cols), np.int64)
    for lo, hi in pairwise(bounds):
        if hi - lo > slots:  # queued sequences: list scheduling on this replica (or static batches)
            st[lo:hi] = (_static_schedule if static else _list_schedule)(cols[lo:hi], slots)
    en = st + cols
    width = (int(en.max()) if len(en) else 0) + 1
    row = np.repeat(np.arange(rows), np.diff(bounds))
    cx = np.concatenate([np.asarray(w[1], float) for w in work])
    size = rows * width

    def live_sum(weights: np.ndarray | None) -> np.ndarray:
        grid = np.bincount(row * width + st, weights, size) - np.bincount(row * width + en, weights, size)
        return np.cumsum(grid.reshape(rows, width), axis=1)

    live = live_sum(None)
    ctx_sum = live_sum(cx) + bucket * (np.arange(width) * live - live_sum(st.astype(float)))
    prefills: dict[tuple[float, float], float] = {}  # replicas with the same prompts prefill alike
    for _, _, t, c in work:
        if (t, c) not in prefills:
            prefills[t, c] = table.prefill(t, c, f)
    pre = np.array([prefills[t, c] for _, _, t, c in work])
    cum = pre[:, None] + np.cumsum(bucket * table.seconds(live, ctx_sum, f), axis=1)
    flat = cum.ravel()
    start_s = np.where(st > 0, flat[row * width + np.maximum(st - 1, 0)], pre[row])
    finish_s = flat[row * width + en - 1]
    return [ReplicaRun(start_s[lo:hi], finish_s[lo:hi], cum[i], st[lo:hi], float(pre[i]), bucket)
            for i, (lo, hi) in enumerate(pairwise(bounds))]

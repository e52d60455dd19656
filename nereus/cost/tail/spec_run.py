"""Speculative decoding at sequence granularity: one step's generation with speculation switched on per
replica once its live batch is small (``spec.levers.Speculation``), the pricing both sides of the loop use.

Each bulk replica runs its continuous-batching schedule (``cost.generation.run_bulk``) until its queue is
empty and at most ``live_at_most`` sequences are still live; from there on every iteration drafts k tokens
per live sequence and verifies them in one target forward of k + 1 tokens (``SpecTable``: the decode
step's terms with (k + 1)·b GEMM rows, k + 1 queries per KV read, (k + 1)·b all-reduced rows, the
engine's host cost once, the model-free drafter's lookup per sequence). A sequence with r tokens left then
needs N iterations, the renewal count of tokens per iteration Y = 1 + min(G, k), P(G ≥ j) = α^j
(Leviathan et al. 2023): E[Y] = (1 − α^(k+1)) / (1 − α). The simulator's ground truth draws N per
sequence from the renewal central limit N ~ Normal(r / E[Y], r·Var[Y] / E[Y]³) at the trace's α (every
token's acceptance drawn, in aggregate); a policy prices N = r / E[Y] at its calibrated α.

Model-free drafts only (n-gram, suffix): they hold no device memory and no draft weights, so the KV budget
and the slots stay as planned. Pure functions of typed inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import pairwise

import numpy as np

from nereus.cost.batching import Factors, StepTable, run_replicas
from nereus.cost.generation import BulkRun, GenModel, GenOutcome, generated_at
from nereus.cost.stages import ENGINE_MAX_SEQUENCES
from nereus.cost.tail.speculative import MODEL_FREE_HOST_S

MODEL_FREE = ("ngram", "suffix")


def tokens_per_iteration(alpha: float, k: int) -> tuple[float, float]:
    """(mean, variance) of the tokens one verification yields per sequence: 1 + min(G, k)."""
    if k <= 0:
        return 1.0, 0.0
    probs = [alpha**j * (1 - alpha) for j in range(k)] + [alpha**k]
    mean = sum((j + 1) * p for j, p in enumerate(probs))
    var = sum((j + 1) ** 2 * p for j, p in enumerate(probs)) - mean**2
    return mean, max(0.0, var)


class SpecTable:
    """A replica's draft-and-verify iteration cost over the live batch (duck-types ``StepTable`` for
    ``run_replicas``): ``verify_seconds`` of ``cost.tail.speculative`` as arrays, under ``Factors``."""

    def __init__(self, plain: StepTable, k: int, host_s: float = MODEL_FREE_HOST_S) -> None:
        m, rows = plain.model, k + 1
        self.plain, self.rows, self.host_s = plain, rows, host_s
        self.weights_s = m.weights_s
        self.kv_s = max(m.kv_s_per_token, rows * m.attn_s_per_token)
        self.comm_fixed, self.comm_per_seq = m.comm_fixed, m.comm_per_seq
        self.per_seq, self.fixed = m.per_seq_s, m.fixed_s
        self.compute = np.array([0.0] + [m.compute_s(b * rows) for b in range(1, ENGINE_MAX_SEQUENCES + 1)])
        self.reads = (np.full(ENGINE_MAX_SEQUENCES + 1, m.weights_s) if m.experts is None
                      else np.array([m.weights_s] + [m.read_s(b * rows) for b in range(1, ENGINE_MAX_SEQUENCES + 1)]))

    def seconds(self, live: np.ndarray, ctx_sum: np.ndarray, f: Factors) -> np.ndarray:
        at = np.minimum(live, len(self.compute) - 1).astype(int)
        comp, reads = self.compute[at], self.reads[at]
        gemm = np.where(reads >= comp, reads * f.memory, comp * f.compute)
        tp = (self.comm_fixed + live * self.rows * self.comm_per_seq) * f.tp_comm if self.comm_fixed else 0.0
        host = (live * (self.per_seq + self.host_s) + self.fixed) * f.overhead
        t = gemm + ctx_sum * self.kv_s * f.memory + tp + host
        return np.where(live > 0, t, 0.0)

    def prefill(self, tokens: float, context: float, f: Factors) -> float:
        return self.plain.prefill(tokens, context, f)


@lru_cache(maxsize=64)
def spec_table(plain: StepTable, k: int) -> SpecTable:
    return SpecTable(plain, k)


@dataclass
class SpecOutcome:
    """The stage with speculation: its outcome (``GenOutcome``: no move) and what the engine measured."""

    outcome: GenOutcome
    switched: int  # replicas that turned speculation on
    spec_tokens: float  # tokens generated while speculating
    verifications: float  # draft-and-verify iterations summed over sequences (vLLM's num_drafts)
    spec_s: float  # seconds from the first switch to the end
    switch_s: list[float] = field(default_factory=list)
    # each sequence's finish under speculation (the bulk's order; unchanged where its replica never switched)
    finish_s: np.ndarray | None = None

    @property
    def accepted_tokens(self) -> float:
        """Draft tokens accepted (vLLM's num_accepted_tokens): each verification adds one of its own."""
        return max(0.0, self.spec_tokens - self.verifications)


def switch_time(bulk: BulkRun, replica: int, live_at_most: int) -> float:
    """When ``replica``'s queue is empty and at most ``live_at_most`` of its sequences are live (inf: never)."""
    mine = bulk.members(replica)
    if not len(mine):
        return math.inf
    start, fin = bulk.start_s[mine], np.sort(bulk.finish_s[mine])
    last_start = float(start.max())
    live_after = len(mine) - np.arange(1, len(fin) + 1)  # live right after each finish, once all started
    hit = np.flatnonzero((live_after <= live_at_most) & (fin >= last_start))
    if len(mine) <= live_at_most:
        return last_start
    return float(fin[hit[0]]) if len(hit) else math.inf


def switch_times(bulk: BulkRun, live_at_most: int) -> np.ndarray:
    """``switch_time`` of every replica in one array pass (the same numbers: elements are picked, never
    computed). Replica r's sequences are column r of the ids laid out ``rows × replicas``; past the last
    start, a replica's sorted finishes hit ``live_at_most`` live at index count − 1 − live_at_most."""
    replicas, n = len(bulk.runs), len(bulk.lengths)
    rows = -(-n // replicas)
    pad = rows * replicas - n  # the last row's missing ids: never finish, never start
    fin = np.sort(np.concatenate([bulk.finish_s, np.full(pad, np.inf)]).reshape(rows, replicas), axis=0)
    last_start = np.concatenate([bulk.start_s, np.full(pad, -np.inf)]).reshape(rows, replicas).max(axis=0)
    count = np.bincount(bulk.replica, minlength=replicas)
    first = np.maximum(count - 1 - live_at_most, np.argmax(fin >= last_start, axis=0))
    hit = fin[np.minimum(first, rows - 1), np.arange(replicas)]
    out = np.where(first < count, hit, math.inf)
    out = np.where(count <= live_at_most, last_start, out)
    return np.where(count == 0, math.inf, out)


def _speculated_rest(bulk: BulkRun, t: np.ndarray, replicas: list[int], mean_y: float, var_y: float,
                     rng: np.random.Generator | None,
                     ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Per switching replica (ascending): the tokens left, the draft-and-verify iterations and the tokens
    generated of each sequence still live at its switch time ``t[r]``, and those sequences' ids (ascending).
    One array pass over every replica's sequences (the draws in that same order, so a replica at a time
    draws the same)."""
    if not replicas:
        return []
    on = np.zeros(len(bulk.runs), bool)
    on[replicas] = True
    live = np.flatnonzero(on[bulk.replica] & (bulk.finish_s > t[bulk.replica]))
    ids = live[np.argsort(bulk.replica[live], kind="stable")]  # by replica, then by id
    generated = generated_at(bulk, ids, t)  # each replica at its own switch time
    left = np.maximum(1.0, bulk.lengths[ids] - generated)
    iters = left / mean_y
    if rng is not None and var_y > 0:
        iters = iters + rng.standard_normal(len(ids)) * np.sqrt(left * var_y / mean_y**3)
    iters = np.maximum(1.0, np.ceil(iters))
    bounds = [0, *np.searchsorted(bulk.replica[ids], replicas[1:]).tolist(), len(ids)]
    return [(left[lo:hi], iters[lo:hi], generated[lo:hi], ids[lo:hi]) for lo, hi in pairwise(bounds)]


def with_speculation(model: GenModel, bulk: BulkRun, k: int, live_at_most: int, alpha: float, f: Factors,
                     rng: np.random.Generator | None = None) -> SpecOutcome:
    """The stage with speculation of ``k`` drafts at acceptance ``alpha`` on each replica below
    ``live_at_most`` live sequences; ``rng`` draws each sequence's iterations (ground truth), None prices
    their expectation (a policy's prediction)."""
    lay = model.placement.layout
    prompt = float(model.job.workload.prompt_length)
    table = spec_table(model.table(lay.tp), k)
    mean_y, var_y = tokens_per_iteration(alpha, k)
    ends = [run.end_s for run in bulk.runs]
    t = switch_times(bulk, live_at_most)
    switched = [(r, t_r) for r, (t_r, e) in enumerate(zip(t.tolist(), ends, strict=True))
                if math.isfinite(t_r) and t_r < e]
    work, ids, spec_tokens, verifications = [], [], 0.0, 0.0
    for left, iters, context, live in _speculated_rest(bulk, t, [r for r, _ in switched], mean_y, var_y, rng):
        work.append((iters, prompt + context, 0.0, 0.0))
        ids.append(live)
        spec_tokens += float(left.sum())
        verifications += float(iters.sum())
    finish = bulk.finish_s.copy()
    if work:  # every switched replica's rest in one array pass; each keeps all its sequences in flight
        slots = max(len(w[0]) for w in work)
        runs = run_replicas(table, work, slots, bulk.bucket, f)
        for (r, t_r), after, live in zip(switched, runs, ids, strict=True):
            ends[r] = t_r + after.end_s
            finish[live] = t_r + after.finish_s
    switches = [t for _, t in switched]
    end = max(ends)
    group = lay.tp * lay.pp
    idle = sum(group * (end - e) for e in ends)
    first = min(switches, default=end)
    on = dict(switched)
    segs = [(f"replica {r}", "bulk", 0.0, on.get(r, e)) for r, e in enumerate(ends)]
    segs += [(f"replica {r}", "speculation", t_r, ends[r]) for r, t_r in switched]
    out = GenOutcome(end, first, 0.0, end - first, idle, segments=segs)
    return SpecOutcome(out, len(switches), spec_tokens, verifications, end - first, switches, finish)

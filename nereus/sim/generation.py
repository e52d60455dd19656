"""The simulator's generation loop: one step's generation stage at sequence granularity, with decision points.

Each step's drawn lengths are decoded sequence by sequence under the hidden factors (``cost.generation``:
continuous batching, slots refilled, the tail drained). The loop asks the policy at the stage's decision
points (``Policy.during_generation``, ``spec.generation``): at the start, then wherever the answer's
``look`` names — once at most ``live_at_most`` sequences are still generating, or after ``iterations``
decode iterations of every replica (the time the slowest replica gets there; the simulator prices no
pause for a look) — with every unfinished sequence as a ``SequenceRecord`` (its tokens so far at that
time; the simulator forecasts nothing, ``forecast`` 0.0). A look at or before the previous one's time ends
the looks.

A ``ChangeTailLayout`` is carried out at its decision point (``with_tail``, its move refused when it
would overfill a device); the looks end there. A ``MoveSequences`` between replicas of one layout is
recorded as not carried out (the simulator prices tail layouts, not single moves). Every recorded decision
returns as a ``GenerationEntry`` with its predicted and realised numbers.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from nereus.control.backend import GenerationPolicy
from nereus.cost.batching import Factors
from nereus.cost.generation import BulkRun, GenModel, GenOutcome, generated_at, trigger_time, with_tail
from nereus.spec.generation import (
    ChangeTailLayout,
    GenerationDecision,
    GenerationEntry,
    GenerationStatus,
    Measured,
    NextLook,
    Outcome,
    ReplicaStatus,
    SequenceRecord,
    SetSpeculation,
    TailPhase,
)
from nereus.spec.layout import ModelStage
from nereus.spec.levers import GenerationLevers

ROLLOUT = ModelStage("actor", "generation")
NOT_HERE = ("the simulator carries out tail layouts (change_tail_layout) and speculation (set_speculation), not "
            "moves between replicas of one layout nor cut rounds")
CARRIED_OUT = (ChangeTailLayout, SetSpeculation)


@dataclass(frozen=True)
class Look:
    """A decision point the loop reached: its time and iteration, the status shown, the answer."""

    t: float
    status: GenerationStatus
    decision: GenerationDecision
    overhead_s: float


def status_at(model: GenModel, bulk: BulkRun | None, step: int, point: str, t: float, iteration: int,
              limit: int, phases: TailPhase | None, levers: GenerationLevers | None = None) -> GenerationStatus:
    """The stage at time ``t`` (``bulk`` None: before the first iteration, every sequence queued)."""
    lay = model.placement.layout
    prompt = model.job.workload.prompt_length
    n = model.job.sequences_per_step()
    reps = all_queued(n, lay.dp, prompt) if bulk is None else unfinished_at(bulk, t, lay.dp, prompt)
    kv_token = model.arch.kv_bytes_per_token(int(model.job.options.weight_bytes))
    return GenerationStatus(step, str(ROLLOUT), point, iteration, model.slots, limit, tuple(reps),
                            Measured(elapsed_s=t), kv_token, phases, levers)


@lru_cache(maxsize=8)
def all_queued(n: int, dp: int, prompt: int) -> tuple[ReplicaStatus, ...]:
    """Before the first iteration: sequence i queued on replica i mod dp (the same every step of a batch
    size, so built once)."""
    return tuple(ReplicaStatus(r, (), tuple(_record(i, r, prompt, 0) for i in range(r, n, dp))) for r in range(dp))


def unfinished_at(bulk: BulkRun, t: float, dp: int, prompt: int) -> tuple[ReplicaStatus, ...]:
    """Every replica's running and queued sequences at time ``t``, with their tokens so far."""
    live = (bulk.start_s <= t) & (bulk.finish_s > t)
    queued = bulk.start_s > t
    generated = np.zeros(len(bulk.lengths))
    ids = np.flatnonzero(live)
    generated[ids] = generated_at(bulk, ids, t)
    tokens = generated.astype(int).tolist()
    reps = []
    for r in range(dp):
        mine = bulk.replica == r
        active = tuple(_record(i, r, prompt, tokens[i]) for i in np.flatnonzero(live & mine).tolist())
        waiting = tuple(_record(i, r, prompt, tokens[i]) for i in np.flatnonzero(queued & mine).tolist())
        reps.append(ReplicaStatus(r, active, waiting))
    return tuple(reps)


def _record(i: int, replica: int, prompt: int, generated: int) -> SequenceRecord:
    """A sequence of the simulated stage: every position of its context cached, no forecast."""
    return SequenceRecord(i, replica, prompt, generated, prompt + generated)


def look_time(bulk: BulkRun, look: NextLook, iteration: int) -> tuple[float, int]:
    """(time, decode iterations the furthest replica ran) of the decision point ``look`` names."""
    if look.live_at_most:
        t = trigger_time(bulk, look.live_at_most)
    else:
        target = iteration + look.iterations
        cols = math.ceil(target / bulk.bucket)
        t = max(float(run.cum_s[min(cols, len(run.cum_s)) - 1]) for run in bulk.runs)
    done = max(int(np.searchsorted(run.cum_s, t, side="right")) for run in bulk.runs)
    return min(t, bulk.end_s), done * bulk.bucket


def walk(policy: GenerationPolicy, start: Look, model: GenModel, bulk: BulkRun, limit: int) -> list[Look]:
    """The recorded decision points from the start's (``start``) on, up to the first that acts, or none left."""
    looks = [start] if start.decision.recorded else []
    d, t_prev, iteration, st = start.decision, -1.0, 0, start.status
    while not d.acts and not d.look.none:
        t, iteration = look_time(bulk, d.look, iteration)
        if t <= t_prev:
            break
        t_prev = t
        status = status_at(model, bulk, st.step, "look", t, iteration, limit, st.phases, st.levers)
        t0 = time.perf_counter()
        d = policy.during_generation(status)
        if d.recorded:
            looks.append(Look(t, status, d, time.perf_counter() - t0))
    return looks


def tail_outcome(model: GenModel, bulk: BulkRun, look: Look, f: Factors, inf_gpus: frozenset[int],
                 base: GenOutcome, out: GenOutcome, gen_noise: float, inference: float, after: float,
                 usable: float) -> Outcome:
    """What the tail layout did, against the stage without it: its move's measured pause and the realised
    gain; the policy's model at the decision point, where the live sequences and their contexts are known
    (its predicted move cost on this step, and the same with transfers unscaled, what it calibrates on)."""
    phase = look.decision.phase
    seen = Factors(**phase.predicted["factors"]) if "factors" in phase.predicted else Factors()
    at_point = with_tail(model, bulk, phase, seen, inf_gpus, look.t) if out.moved else out
    modelled = with_tail(model, bulk, phase, replace(seen, transfer=1.0), inf_gpus, look.t) if out.moved else out
    figures = {"predicted_migration_s": at_point.migration_s, "migration_modelled_s": modelled.migration_s,
               "move_peak_bytes": out.move_peak_bytes, "usable_bytes": usable, "unfinished": float(out.unfinished),
               "kv_sent": float(out.kv_sent), "recomputed": float(out.recomputed), "bytes_sent": out.bytes_sent}
    return Outcome(out.moved, out.refused, out.migration_s,
                   (base.generation_s - out.generation_s) * gen_noise + inference - after, figures)


def entries_of(looks: list[Look], acted: Outcome | None) -> tuple[GenerationEntry, ...]:
    """The recorded decisions of the walk: the one carried out (a tail layout, speculation) with its
    outcome ``acted``, the others as not carried out."""
    out = []
    for lk in looks:
        d = lk.decision
        if not d.recorded:
            continue
        if isinstance(d, CARRIED_OUT) and acted is not None and lk is looks[-1]:
            outcome = acted
        else:
            outcome = Outcome(False, NOT_HERE if d.acts else "declined")
        out.append(GenerationEntry(lk.status.step, lk.status.model_stage, lk.status.iteration, lk.status.live, d,
                                   outcome, lk.overhead_s))
    return tuple(out)

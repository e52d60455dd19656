"""Mid-step moves of unfinished sequences between generation replicas (``run.rollout.midstep``), decided
by a small cost model calibrated on the run's own measurements.

The continuous-batching engine runs each live sequence as its own one-row micro-batch, so an iteration
of a replica costs about (live sequences) × (seconds per row). When one DP replica has drained its queue
and another still holds a backlog of long sequences, the first idles while the second finishes: moving
some of the second's unfinished sequences — with their KV caches, or as records the receiver re-prefills
(``elastic.kvplan``, ``runtime.generation.kv_migrate``) — splits the tail between them.

The driver runs every replica's engine (``Worker.gen_open``/``gen_run``, ``runtime.generation.session``) in
chunks of iterations, each a round trip to every worker that also holds the replicas in lockstep, so the
controller looks only when a move could be decided and could pay (``MidStep.next_look``):

- *before any replica is under the trigger*: the chunk runs every replica up to the iteration at which the
  first of them is predicted to fall under it (``until_below`` on the engine schedule replayed with the
  forecast lengths below);
- *while one is*: ``chunk`` iterations between two looks;
- *no later look*: once no move can be admitted any more — no replica holds two unfinished sequences, or
  (while one is under the trigger) even the best split of the remaining predicted work between two
  replicas gains no more than ``margin`` × a move's fixed cost (``gain_bound``) — the final call runs
  every replica to the end and answers. The bound holds for the forecasts of the moment: a sequence that
  outlives its forecast is not looked at again.

After each chunk, when a replica's unfinished sequences fill less than ``trigger`` of its slots (the
*receiver*) while the replica with the most predicted work left (the *donor*) holds at least two, the
controller decides:

- *remaining work*: each unfinished sequence's final length is forecast as the mean of the lengths seen
  so far in the run that exceed what it has generated (``final_lengths``), and each replica's engine schedule
  is replayed to the end (``drain``: slots refilled from the queue, an iteration costing its live rows);
  a replica's remaining seconds are its rows × its measured seconds per row (this step's chunk timings);
- *candidates*: the donor's queued sequences from the back, then its active ones, longest forecast first,
  while the receiver has free slots and each one lowers the pair's predicted finish; per sequence, its
  KV caches are sent (modelled bytes × calibrated seconds per byte) or re-prefilled (the generated tokens
  replayed, one row each at the receiver; ``transfer: auto`` picks the cheaper);
- *admission*: predicted gain (the pair's predicted finish without the move minus with it) >
  ``margin`` × predicted cost: a fixed part per move (a call to every worker and the commit vote: the
  median of the measured moves less their modelled bytes; before the first, two of this step's measured
  driver round trips per chunk) plus bytes × seconds per byte.

*Measured gain* of an admitted move, once generation has ended: the no-move counterfactual from the
decision point minus the measured wall time from the decision point to the end of generation. The
counterfactual is the plain engine's: no move and no further look, every replica run to the end in one
call — its engine schedule replayed without the move (``drain``) with the sequences' actual final lengths,
each replica's rows × its measured seconds per row in this step, the slowest replica's, plus one call's
measured driver overhead (a chunk's wall time minus its slowest replica's busy time, averaged over the
step). The looks, lockstep waits and decisions the mode makes after the decision point are thus on the
measured side: a move that only pays for its polling reads as no gain. Later moves of the same step count
in the earlier one's measured figure (it measures "this move and what followed" against "no move and no
look from here"). The step's ``midstep/step_gain_s`` is the same comparison for the whole generation: the
plain engine from the start (one call; the replay from the step's initial queues) minus the measured wall
time from ``gen_open`` to the final answer, so every round trip the mode adds counts against it. They are
figures of the run, never asserted in tests.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from nereus.elastic.kvplan import GenPlacement, KVShape, SeqMove
from nereus.run.overlap import Call, Calls
from nereus.spec.run import MidstepSpec

if TYPE_CHECKING:
    from nereus.control.record import RunRecord
    from nereus.runtime.cluster.workers import Runtime
    from nereus.runtime.transitions.live import KeySpec

METRICS = ("midstep/decisions", "midstep/moves", "midstep/moved_sequences", "midstep/move_s",
           "midstep/predicted_gain_s", "midstep/predicted_cost_s", "midstep/measured_gain_s", "midstep/chunks",
           "midstep/row_ms", "midstep/step_gain_s", "midstep/poll_s")
HISTORY = 4096  # response lengths kept for the forecast: a few steps' worth of rows
MOVE_FIXED_PRIOR_S = 0.05  # before any move is measured: a Ray round trip plus a gloo vote on this machine
S_PER_BYTE_PRIOR = 1e-9  # 1 GB/s: loopback gloo moves far faster; tiny caches make it negligible either way
ROW_PRIOR_S = 1e-3  # seconds per row with ``calibrate: false``: a tiny model's one-row forward on this CPU


def slot_iterations(prompt: int, generated: int, cached: int, final: int) -> int:
    """Iterations a sequence still occupies a slot until it ends at ``final`` tokens: until its next
    sample (one when caught up; the prompt plus each generated token replayed when its caches are gone),
    then one per further token (``DecodeEngine.step``)."""
    first = 1 + generated if cached == 0 else prompt + generated - cached
    return first + max(0, final - generated - 1)


def drain(active: list[int], queued: list[int], slots: int) -> tuple[int, int]:
    """(rows, iterations) until every sequence ends: ``active``/``queued`` hold each sequence's remaining
    slot iterations; free slots take queued sequences in order, every iteration costs its live rows."""
    live, queue, rows, its = list(active), deque(queued), 0, 0
    while live or queue:
        while len(live) < slots and queue:
            live.append(queue.popleft())
        rows += len(live)
        its += 1
        live = [r - 1 for r in live if r > 1]
    return rows, its


def until_below(active: list[int], queued: list[int], slots: int, below: float) -> int:
    """Iterations of ``drain``'s schedule until fewer than ``below`` sequences are unfinished (0: already
    fewer; the drain's whole length when that happens only at the end)."""
    live, queue, its = list(active), deque(queued), 0
    while (live or queue) and len(live) + len(queue) >= below:
        while len(live) < slots and queue:
            live.append(queue.popleft())
        its += 1
        live = [r - 1 for r in live if r > 1]
    return its


def gain_bound(rows: list[int], longest: list[int], row_s: list[float], donors: list[bool]) -> float:
    """The most predicted gain any move between two replicas could have: over donor d (``donors[d]``: it
    holds two unfinished sequences) and receiver r, with a, b their seconds per row, the pair's predicted
    finish max(rows_d·a, rows_r·b) minus a floor under its finish after any move. A KV or queued move
    carries a sequence's remaining slot iterations along (a re-prefill adds some), so the pair's rows
    stay ≥ R = rows_d + rows_r and the finish ≥ R / (1/a + 1/b) (the perfect split); a sequence's
    remaining iterations run on one replica, so ≥ L_d·min(a, b) and ≥ L_r·b (``longest``). Each term falls
    by at most the wall time that passes while the replicas run, so with fixed forecasts the bound never
    grows: once it is under the admission threshold, no later look can admit a move."""
    best = 0.0
    for d, r in itertools.permutations(range(len(rows)), 2):
        a, b = row_s[d], row_s[r]
        if not donors[d] or a <= 0 or b <= 0:
            continue
        split = (rows[d] + rows[r]) / (1 / a + 1 / b)
        floor = max(split, longest[d] * min(a, b), longest[r] * b)
        best = max(best, max(rows[d] * a, rows[r] * b) - floor)
    return best


@dataclass
class Replica:
    """One DP replica's status after a chunk (``gen_session.run_chunk``): records are [seq id, prompt,
    generated, cached, stream-state bytes]."""

    dp: int
    active: list[list[int]]
    queued: list[list[int]]

    @property
    def unfinished(self) -> int:
        return len(self.active) + len(self.queued)

    def left(self, final: dict[int, int]) -> tuple[list[int], list[int]]:
        """Each active and each queued sequence's remaining slot iterations (``slot_iterations``)."""
        return ([slot_iterations(p, g, c, final[i]) for i, p, g, c, _ in self.active],
                [slot_iterations(p, g, c, final[i]) for i, p, g, c, _ in self.queued])

    def work(self, final: dict[int, int], slots: int, extra: tuple[list[list[int]], list[list[int]]] = ((), ()),
             drop: frozenset[int] = frozenset()) -> tuple[int, int]:
        """``drain`` of this replica with final lengths ``final``; ``extra``: (installed records, of them the
        refilled ones' ids as records) taking the next free slots; ``drop``: ids moved away."""
        inst, refill = extra
        refilled = {r[0] for r in refill}
        act = [slot_iterations(p, g, c, final[i]) for i, p, g, c, _ in self.active if i not in drop]
        front = [slot_iterations(p, g, 0 if i in refilled else c, final[i]) for i, p, g, c, _ in inst]
        back = [slot_iterations(p, g, c, final[i]) for i, p, g, c, _ in self.queued if i not in drop]
        return drain(act, front + back, slots)


@dataclass
class Decision:
    """One mid-step decision, as logged (``decisions.jsonl``, ``run_record.json``)."""

    step: int
    iteration: int
    donor: int
    receiver: int
    admitted: bool
    reason: str
    moved: list[int] = field(default_factory=list)
    kv: int = 0  # running sequences whose caches travel
    refill: int = 0  # running sequences re-prefilled at the receiver
    queued: int = 0  # sequences that had not started (only their records travel)
    bytes: int = 0
    predicted_gain_s: float = 0.0
    predicted_cost_s: float = 0.0
    committed: bool = False  # the migration passed its commit point (an aborted one moved nothing)
    move_s: float | None = None  # measured: the migration call's wall time
    measured_gain_s: float | None = None
    overhead_s: float = 0.0  # the controller's own time deciding

    def entry(self) -> dict:
        return {"action": "midstep", **asdict(self)}


class MidStep:
    """The controller's mid-step rule and its calibration across the run's steps."""

    def __init__(self, spec: MidstepSpec, force: bool = False) -> None:
        self.spec = spec
        self.force = force  # tests only: move the first running sequence found, whatever the model predicts
        self.lengths: deque[int] = deque(maxlen=HISTORY)
        self.moves_measured: list[tuple[int, float]] = []  # (bytes, seconds) of committed moves
        self.decisions: list[Decision] = []  # the last step's, until the job takes them
        self.metrics: dict[str, float] = {}
        self.round_trip_s: float | None = None  # this step's driver overhead per chunk (``GenerationRun``)

    def applies(self, rt: Runtime, key: str, step: int) -> bool:
        """Whether ``step`` generates with mid-step moves: every ``every``-th step, on DP ≥ 2 (an adaptive
        run may hold one replica for a while: then the step generates in one call)."""
        return step % self.spec.every == 0 and rt.specs[key].layout.dp >= 2

    def fixed_batch(self, step: int) -> bool:
        """A step between two mid-step steps (``every`` > 1) generates with the fixed batch."""
        return step % self.spec.every != 0

    # ----- the cost model -----------------------------------------------------------------------------
    def final_lengths(self, reps: list[Replica], limit: int,
                      rounding: Callable[[float], int] = math.ceil) -> dict[int, int]:
        """Expected final length of every unfinished sequence, by id: for one that has generated g tokens,
        the mean of the run's lengths above g (halfway from g to the limit before any is seen), at least
        g + 1 and at most the limit, rounded up (``rounding``). One sort of the lengths, then a binary search
        and a suffix sum per distinct g."""
        lengths = sorted(self.lengths)
        top = [0, *itertools.accumulate(reversed(lengths))]  # top[k]: sum of the k largest lengths
        by_generated = {}
        for g in {r[2] for rep in reps for r in rep.active + rep.queued}:
            n = len(lengths) - bisect.bisect_right(lengths, g)
            guess = top[n] / n if n else (g + limit) / 2
            by_generated[g] = max(g + 1, min(limit, rounding(guess)))
        return {r[0]: by_generated[r[2]] for rep in reps for r in rep.active + rep.queued}

    def next_look(self, reps: list[Replica], row_s: list[float] | None, slots: int, limit: int) -> int | None:
        """Engine iterations to run before the controller looks again; None: no later look can admit a
        move, so the final call runs every replica to the end. ``row_s`` None: nothing measured yet (the
        bound waits for the first chunk's timings)."""
        below = self.spec.trigger * slots
        if below <= 0 or not any(rep.unfinished >= 2 for rep in reps):  # no receiver or no donor, ever
            return None
        if not any(rep.unfinished < below for rep in reps):
            # the forecast rounded down: a look that comes too early costs a round trip, one that comes too
            # late may find the window closed (every replica drained)
            early = [rep.left(self.final_lengths(reps, limit, math.floor)) for rep in reps]
            return max(1, min(until_below(act, queued, slots, below) for act, queued in early))
        final = self.final_lengths(reps, limit)
        left = [rep.left(final) for rep in reps]
        # in the decision window only: before it the replicas' queues hold sequences of one forecast length,
        # so the replay sees them balanced, whatever lengths they will reach
        if not self.spec.calibrate:
            row_s = [ROW_PRIOR_S] * len(reps)
        if row_s is not None and not self.force:
            rows = [drain(act, queued, slots)[0] for act, queued in left]
            longest = [max(act + queued, default=0) for act, queued in left]
            if gain_bound(rows, longest, row_s, [rep.unfinished >= 2 for rep in reps]) <= \
                    self.spec.margin * self.move_cost(0):
                return None
        return self.spec.chunk

    def move_cost(self, nbytes: int) -> float:
        """Predicted seconds of a move: a fixed part (the median of measured moves less their bytes; before
        the first, two of this step's measured driver round trips per chunk — a move is one call to every
        worker plus a vote — or the prior without ``calibrate``) plus its bytes."""
        if not self.spec.calibrate:
            fixed = MOVE_FIXED_PRIOR_S
        elif self.moves_measured:
            fixed = statistics.median([s - b * S_PER_BYTE_PRIOR for b, s in self.moves_measured])
        else:
            fixed = 2 * self.round_trip_s if self.round_trip_s is not None else MOVE_FIXED_PRIOR_S
        return max(0.0, fixed) + nbytes * S_PER_BYTE_PRIOR

    # ----- the decision -------------------------------------------------------------------------------
    def decide(self, step: int, iteration: int, reps: list[Replica], row_s: list[float], slots: int,
               limit: int, shape: KVShape) -> tuple[Decision, list[SeqMove]] | None:
        t0 = time.perf_counter()
        if not self.spec.calibrate:  # reproducible decisions: the priors, never a measured time
            row_s = [ROW_PRIOR_S] * len(reps)
        spare = [rep for rep in reps if rep.unfinished < self.spec.trigger * slots]
        if not spare:
            return None
        final = self.final_lengths(reps, limit)
        secs = [rep.work(final, slots)[0] * row_s[rep.dp] for rep in reps]
        donor = max(reps, key=lambda rep: secs[rep.dp])
        receiver = min(spare, key=lambda rep: secs[rep.dp])
        if donor is receiver or donor.unfinished < 2:
            return None
        base = max(secs[donor.dp], secs[receiver.dp])
        room = slots - receiver.unfinished
        chosen: list[list[int]] = []
        refilled: list[list[int]] = []
        best = base
        running = sorted(donor.active, key=lambda r: -(final[r[0]] - r[2]))
        order = running + donor.queued[::-1] if self.force else donor.queued[::-1] + running
        for rec in order[: max(0, min(room, donor.unfinished - 1))]:
            kv_bytes = 2 * shape.layers * shape.kv_heads * rec[3] * shape.head_dim * shape.elem_bytes
            use_refill = rec[3] > 0 and (self.spec.transfer == "refill" or (
                self.spec.transfer == "auto" and rec[2] * row_s[receiver.dp] < kv_bytes * S_PER_BYTE_PRIOR))
            trial, trial_refill = chosen + [rec], refilled + ([rec] if use_refill else [])
            drop = frozenset(r[0] for r in trial)
            after = max(donor.work(final, slots, drop=drop)[0] * row_s[donor.dp],
                        receiver.work(final, slots, (trial, trial_refill))[0] * row_s[receiver.dp])
            if after >= best and not (self.force and not chosen):
                break
            chosen, refilled, best = trial, trial_refill, after
        if not chosen:
            return None
        ids = {r[0] for r in refilled}
        moves = [SeqMove(i, p, g, c, rng, donor.dp, receiver.dp, refill=i in ids) for i, p, g, c, rng in chosen]
        nbytes = sum(2 * shape.layers * shape.kv_heads * m.cached * shape.head_dim * shape.elem_bytes
                     for m in moves if not m.refill)
        gain, cost = base - best, self.move_cost(nbytes)
        admitted = gain > self.spec.margin * cost
        reason = (f"predicted gain {gain:.3f} s {'>' if admitted else '<='} margin {self.spec.margin:g} × "
                  f"cost {cost:.3f} s" + ("; forced (a test)" if self.force else ""))
        admitted = admitted or self.force
        kv, refill = sum(1 for m in moves if m.cached and not m.refill), sum(1 for m in moves if m.refill)
        d = Decision(step, iteration, donor.dp, receiver.dp, admitted, reason, [m.seq for m in moves], kv, refill,
                     len(moves) - kv - refill, nbytes, gain, cost, overhead_s=time.perf_counter() - t0)
        return d, moves

    def step_metrics(self) -> dict[str, float]:
        """The last generation's ``midstep/*`` metrics, once (zeros for a step generated otherwise)."""
        out, self.metrics = {k: 0.0 for k in METRICS} | self.metrics, {}
        return out

    def take_decisions(self) -> list[Decision]:
        out, self.decisions = self.decisions, []
        return out


def kv_shape(spec: KeySpec) -> KVShape:
    """The KV-cache geometry of a runtime key (``KeySpec``)."""
    from nereus.runtime.model.dtypes import torch_dtype

    a = spec.cfg.arch
    return KVShape(a.layers, a.kv_heads, a.head_dim, torch_dtype(spec.dtype).itemsize)


def placement(spec: KeySpec) -> GenPlacement:
    return GenPlacement(spec.layout, tuple(spec.ranks))


def migrate_on_world(calls: Calls, rt: Runtime, key: str, plan: dict) -> list[dict]:
    """``Worker.gen_migrate`` on every worker of the world (the commit vote is world-wide), accounted as
    generation time of each worker; every worker's answer, by rank."""
    from nereus.runtime.cluster.calls import GenMigrate

    call = Call("gen", "generate", rt.submit_all(GenMigrate(key, plan)), time.perf_counter())
    calls.calls.append(call)
    answers = rt.answers(list(call.refs.values()))
    now = time.perf_counter()
    call.done.update({rank: now for rank in call.refs})
    return answers


def report_decisions(ctl: MidStep, write: Callable[[dict], None], record: RunRecord,
                     say: Callable[[str], None]) -> None:
    """The last step's decisions into the run's decision log (``write``: a ``decisions.jsonl`` writer)
    and record (``RunRecord.decisions``, which ``nereus report`` tables); a line of progress per move."""
    for d in ctl.take_decisions():
        write(d.entry())
        record.decisions.append(d.entry())
        if d.committed:
            say(f"\n  mid-step move in step {d.step} after iteration {d.iteration}: {len(d.moved)} sequences, replica "
                f"{d.donor} -> {d.receiver} ({d.kv} with KV caches, {d.refill} re-prefilled, {d.queued} not started; "
                f"{d.bytes / 1024:.1f} KiB):"
                f" cost {d.move_s:.3f} s measured ({d.predicted_cost_s:.3f} s predicted); gain "
                f"{d.predicted_gain_s:.3f} s predicted, {d.measured_gain_s:+.3f} s measured")

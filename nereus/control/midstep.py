"""The mid-step rule of ``run.rollout.midstep``: when to look at the generation replicas, and which
unfinished sequences to move from one to another (``BalanceTail``).

When one DP replica has drained its queue and another still holds a backlog of long sequences, the first
idles while the second finishes; moving some of the second's unfinished sequences — with their KV caches,
or as records the receiver re-prefills — splits the tail between them. Prices are ``cost.engine``'s;
the statuses are the backend's (``spec.generation.GenerationStatus``), so the rule is a function of its
configuration and the status it is shown.

**When it looks.** Each look of the runtime is a round trip to every worker that holds the replicas in
lockstep, so the rule names the next decision point only when a move could be decided and could pay:

- *before any replica is under the trigger*: after the iterations until the first of them is forecast to
  fall under it (``until_below`` on the engine schedule replayed with the forecast lengths rounded down);
- *while one is*: ``chunk`` iterations between two looks (and ``chunk`` after a move);
- *no later look*: once no move can be admitted any more — no replica holds two unfinished sequences, or
  (while one is under the trigger) even the best split of the remaining predicted work between two
  replicas gains no more than ``margin`` × a move's fixed cost (``gain_bound``). The bound holds for the
  forecasts of the moment: a sequence that outlives its forecast is not looked at again.

**What it moves.** When a replica's unfinished sequences fill less than ``trigger`` of its slots (the
*receiver*) while the replica with the most predicted work left (the *donor*) holds at least two:

- *remaining work*: each replica's engine schedule replayed to the end with every unfinished sequence's
  forecast final length (``replica_work``), in its seconds per row (measured this step, or the prior);
- *candidates*: the donor's queued sequences from the back, then its active ones, longest forecast
  first, while the receiver has free slots and each one lowers the pair's predicted finish; per sequence,
  its KV caches are sent (bytes × seconds per byte) or it is re-prefilled (the generated tokens replayed,
  one row each at the receiver; ``transfer: auto`` picks the cheaper);
- *admission*: predicted gain (the pair's predicted finish without the move minus with it) >
  ``margin`` × predicted cost (``move_cost``: the calibrated fixed part — before the first measured move,
  two of this step's driver round trips — plus the bytes). A refused move is answered as ``Continue``
  with the move ``declined``, so it is recorded with its numbers.
"""

from __future__ import annotations

import math

from nereus.cost.engine import (
    MOVE_FIXED_PRIOR_S,
    ROW_PRIOR_S,
    S_PER_BYTE_PRIOR,
    drain,
    final_length,
    gain_bound,
    move_cost,
    replica_left,
    replica_work,
    row_seconds,
    until_below,
)
from nereus.spec.generation import (
    END,
    Continue,
    GenerationDecision,
    GenerationStatus,
    MoveSequences,
    NextLook,
    ReplicaStatus,
    SequenceMove,
    SequenceRecord,
)
from nereus.spec.run import MidstepSpec


def final_lengths(status: GenerationStatus, rounding=math.ceil) -> dict[int, int]:
    """Every unfinished sequence's forecast final length, by id."""
    return {s.id: final_length(s, status.max_new_tokens, rounding)
            for rep in status.replicas for s in rep.active + rep.queued}


class BalanceTail:
    """The rule of ``run.rollout.midstep`` (see the module docstring). ``force`` (tests only): move the
    first running sequence found, whatever the model predicts."""

    def __init__(self, spec: MidstepSpec, force: bool = False) -> None:
        self.spec, self.force = spec, force

    def during_generation(self, status: GenerationStatus) -> GenerationDecision:
        if status.point == "start":
            return Continue(look=self.next_look(status, None))
        row_s = self.row_s(status)
        move = self.propose(status, row_s)
        if move is None:
            return Continue(look=self.next_look(status, row_s))
        if move.gain_s > self.spec.margin * move.cost_s or self.force:
            # the status is stale after a move: look again after ``chunk`` iterations
            return MoveSequences(moves=move.moves, gain_s=move.gain_s, cost_s=move.cost_s, bytes=move.bytes,
                                 reason=move.reason, look=NextLook(iterations=self.spec.chunk))
        return Continue(look=self.next_look(status, row_s), declined=move, reason=move.reason)

    def row_s(self, status: GenerationStatus) -> list[float] | None:
        """Seconds per row of each replica: measured in this step, or the prior without ``calibrate``."""
        if not self.spec.calibrate:  # reproducible decisions: the priors, never a measured time
            return [ROW_PRIOR_S] * len(status.replicas)
        return row_seconds(status.measured.rows, status.measured.busy_s)

    def fixed_cost(self, status: GenerationStatus) -> float:
        """A move's fixed seconds: the run's measured moves (``EngineCalibration.move_fixed_s``); before the
        first, two of this step's measured driver round trips (a move is one call to every worker plus a
        vote); the prior without ``calibrate`` or before any call."""
        m = status.measured
        if not self.spec.calibrate:
            return MOVE_FIXED_PRIOR_S
        if m.move_fixed_s is not None:
            return m.move_fixed_s
        return 2 * m.call_overhead_s if m.call_overhead_s is not None else MOVE_FIXED_PRIOR_S

    def next_look(self, status: GenerationStatus, row_s: list[float] | None) -> NextLook:
        """The next decision point (``END``: none can admit a move). ``row_s`` None: nothing measured yet
        (the bound waits for the first chunk's timings)."""
        reps, slots = status.replicas, status.slots
        below = self.spec.trigger * slots
        if below <= 0 or not any(rep.unfinished >= 2 for rep in reps):  # no receiver or no donor, ever
            return END
        if not any(rep.unfinished < below for rep in reps):
            # the forecast rounded down: a look that comes too early costs a round trip, one that comes too
            # late may find the window closed (every replica drained)
            early = final_lengths(status, math.floor)
            left = [replica_left(rep, early) for rep in reps]
            return NextLook(iterations=max(1, min(until_below(act, queued, slots, below) for act, queued in left)))
        # in the decision window only: before it the replicas' queues hold sequences of one forecast length,
        # so the replay sees them balanced, whatever lengths they will reach
        if not self.spec.calibrate:
            row_s = [ROW_PRIOR_S] * len(reps)
        if row_s is not None and not self.force:
            left = [replica_left(rep, final_lengths(status)) for rep in reps]
            rows = [drain(act, queued, slots)[0] for act, queued in left]
            longest = [max(act + queued, default=0) for act, queued in left]
            if gain_bound(rows, longest, row_s, [rep.unfinished >= 2 for rep in reps]) <= \
                    self.spec.margin * move_cost(self.fixed_cost(status), 0):
                return END
        return NextLook(iterations=self.spec.chunk)

    def propose(self, status: GenerationStatus, row_s: list[float] | None) -> MoveSequences | None:
        """The best move from the donor to a receiver under the trigger, with its predicted gain and cost
        (not yet admitted); None when no replica is under the trigger or no move lowers the finish."""
        reps, slots = status.replicas, status.slots
        row_s = row_s or [ROW_PRIOR_S] * len(reps)
        spare = [rep for rep in reps if rep.unfinished < self.spec.trigger * slots]
        if not spare:
            return None
        final = final_lengths(status)
        secs = [replica_work(rep, final, slots)[0] * row_s[rep.replica] for rep in reps]
        donor = max(reps, key=lambda rep: secs[rep.replica])
        receiver = min(spare, key=lambda rep: secs[rep.replica])
        if donor is receiver or donor.unfinished < 2:
            return None
        base = max(secs[donor.replica], secs[receiver.replica])
        chosen, refilled, best = self._candidates(status, donor, receiver, final, row_s, base)
        if not chosen:
            return None
        moves = tuple(SequenceMove(s, receiver.replica, s.id in refilled) for s in chosen)
        nbytes = sum(status.kv_token_bytes * m.seq.cached for m in moves if not m.refill)
        gain, cost = base - best, move_cost(self.fixed_cost(status), nbytes)
        admitted = gain > self.spec.margin * cost
        reason = (f"predicted gain {gain:.3f} s {'>' if admitted else '<='} margin {self.spec.margin:g} × "
                  f"cost {cost:.3f} s" + ("; forced (a test)" if self.force else ""))
        return MoveSequences(moves=moves, gain_s=gain, cost_s=cost, bytes=nbytes, reason=reason)

    def _candidates(self, status: GenerationStatus, donor: ReplicaStatus, receiver: ReplicaStatus,
                    final: dict[int, int], row_s: list[float], base: float,
                    ) -> tuple[list[SequenceRecord], frozenset[int], float]:
        """The donor's sequences to move while each lowers the pair's predicted finish (``base`` before),
        the ids of those the receiver re-prefills, and the pair's predicted finish after the move."""
        slots, transfer = status.slots, self.spec.transfer
        room = slots - receiver.unfinished
        chosen: list[SequenceRecord] = []
        refilled: frozenset[int] = frozenset()
        best = base
        running = sorted(donor.active, key=lambda s: -(final[s.id] - s.generated))
        order = running + list(donor.queued[::-1]) if self.force else list(donor.queued[::-1]) + running
        for seq in order[: max(0, min(room, donor.unfinished - 1))]:
            kv_bytes = status.kv_token_bytes * seq.cached
            use_refill = seq.cached > 0 and (transfer == "refill" or (
                transfer == "auto" and seq.generated * row_s[receiver.replica] < kv_bytes * S_PER_BYTE_PRIOR))
            trial, trial_refill = chosen + [seq], refilled | ({seq.id} if use_refill else set())
            drop = frozenset(s.id for s in trial)
            after = max(replica_work(donor, final, slots, drop=drop)[0] * row_s[donor.replica],
                        replica_work(receiver, final, slots, trial, trial_refill)[0] * row_s[receiver.replica])
            if after >= best and not (self.force and not chosen):
                break
            chosen, refilled, best = trial, trial_refill, after
        return chosen, refilled, best

"""The price list of the runtime's continuous-batching engine inside a step, calibrated on the run.

The engine (``runtime.engines.native.decode_engine``) runs each live sequence as its own one-row micro-batch,
so an iteration of a replica costs about (live sequences) × (seconds per row), and a replica's remaining
work is its engine schedule replayed to the end: slots refilled from the queue, each iteration costing its
live rows (``drain``). A move of unfinished sequences between replicas (``runtime.engines.native.kv_migrate``)
costs a fixed part — a call to every worker and the commit vote — plus its KV bytes over the link.

Every number here is either a prior (``ROW_PRIOR_S``, ``MOVE_FIXED_PRIOR_S``, ``S_PER_BYTE_PRIOR``) or
calibrated on what the run measured (``EngineCalibration``: the response lengths seen, which forecast an
unfinished sequence's final length, and the moves' measured seconds). The mid-step rule
(``control.midstep``) decides with these prices; the runtime's engine loop (``run.midstep``) measures with
them (the no-move counterfactual of a move's measured gain, ``plain_finish_s``).
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from collections import deque
from collections.abc import Callable, Iterable

from nereus.spec.generation import ReplicaStatus, SequenceRecord

HISTORY = 4096  # response lengths kept for the forecast: a few steps' worth of rows
MOVE_FIXED_PRIOR_S = 0.05  # before any move is measured: a Ray round trip plus a gloo vote on this machine
S_PER_BYTE_PRIOR = 1e-9  # 1 GB/s: loopback gloo moves far faster; tiny caches make it negligible either way
ROW_PRIOR_S = 1e-3  # seconds per row without calibration: a tiny model's one-row forward on this CPU


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


# ----- a replica's remaining work --------------------------------------------------------------------

def final_length(seq: SequenceRecord, limit: int, rounding: Callable[[float], int]) -> int:
    """A sequence's expected final length from its forecast (``EngineCalibration.forecasts``), rounded
    (``math.ceil`` to decide, ``math.floor`` to time a first look), at least one more token, at most the limit."""
    return max(seq.generated + 1, min(limit, rounding(seq.forecast)))


def replica_left(rep: ReplicaStatus, final: dict[int, int]) -> tuple[list[int], list[int]]:
    """Each active and each queued sequence's remaining slot iterations (``slot_iterations``)."""
    return ([slot_iterations(s.prompt, s.generated, s.cached, final[s.id]) for s in rep.active],
            [slot_iterations(s.prompt, s.generated, s.cached, final[s.id]) for s in rep.queued])


def replica_work(rep: ReplicaStatus, final: dict[int, int], slots: int, installed: Iterable[SequenceRecord] = (),
                 refilled: frozenset[int] = frozenset(), drop: frozenset[int] = frozenset()) -> tuple[int, int]:
    """``drain`` of replica ``rep`` with final lengths ``final``: ``installed`` sequences (moved in; the
    ``refilled`` ones re-prefilled, their caches gone) take the next free slots; ``drop``: ids moved away."""
    act = [slot_iterations(s.prompt, s.generated, s.cached, final[s.id]) for s in rep.active if s.id not in drop]
    front = [slot_iterations(s.prompt, s.generated, 0 if s.id in refilled else s.cached, final[s.id])
             for s in installed]
    back = [slot_iterations(s.prompt, s.generated, s.cached, final[s.id]) for s in rep.queued if s.id not in drop]
    return drain(act, front + back, slots)


def row_seconds(rows: tuple[int, ...], busy_s: tuple[float, ...]) -> list[float] | None:
    """Measured seconds per row of each replica (the mean over replicas where one ran none); None before
    any row ran."""
    if not sum(rows):
        return None
    total = sum(busy_s) / sum(rows)
    return [b / r if r else total for b, r in zip(busy_s, rows, strict=True)]


def move_cost(fixed_s: float, nbytes: int) -> float:
    """Predicted seconds of a move: its fixed part plus its KV bytes at ``S_PER_BYTE_PRIOR``."""
    return max(0.0, fixed_s) + nbytes * S_PER_BYTE_PRIOR


def plain_finish_s(reps: tuple[ReplicaStatus, ...] | list[ReplicaStatus], final: dict[int, int],
                   row_s: list[float], slots: int, call_s: float) -> float:
    """Predicted seconds of the plain engine from status ``reps``: every replica run to the end in one call,
    the slowest replica's rows × its seconds per row plus one call's driver overhead ``call_s``."""
    return max(replica_work(rep, final, slots)[0] * row_s[rep.replica] for rep in reps) + call_s


class EngineCalibration:
    """What the run measured of its engine: the response lengths seen (the forecast's history, the last
    ``HISTORY``) and every committed move's (KV bytes, seconds)."""

    def __init__(self) -> None:
        self.lengths: deque[int] = deque(maxlen=HISTORY)
        self.moves: list[tuple[int, float]] = []

    def observe_lengths(self, lengths: Iterable[int]) -> None:
        self.lengths.extend(lengths)

    def observe_move(self, nbytes: int, seconds: float) -> None:
        self.moves.append((nbytes, seconds))

    def forecasts(self, generated: Iterable[int], limit: int) -> dict[int, float]:
        """Expected final length of a sequence that has generated g tokens, for each g given: the mean of
        the run's lengths above g (halfway from g to the limit before any is seen), unrounded. One sort of
        the lengths, then a binary search and a suffix sum per distinct g."""
        lengths = sorted(self.lengths)
        top = [0, *itertools.accumulate(reversed(lengths))]  # top[k]: sum of the k largest lengths
        out = {}
        for g in set(generated):
            n = len(lengths) - bisect.bisect_right(lengths, g)
            out[g] = top[n] / n if n else (g + limit) / 2
        return out

    def move_fixed_s(self) -> float | None:
        """The fixed part of a move's cost: the median of the measured moves less their bytes (None before
        the first)."""
        if not self.moves:
            return None
        return statistics.median([s - b * S_PER_BYTE_PRIOR for b, s in self.moves])

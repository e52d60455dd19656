"""The mid-step rule (control.midstep.BalanceTail) on typed statuses: when it looks, what it moves, what
it declines. Decisions on the cost model's priors (``calibrate: false``), so nothing depends on timing."""

from __future__ import annotations

from dataclasses import replace

from nereus.control.midstep import BalanceTail, final_lengths
from nereus.cost.engine import EngineCalibration
from nereus.spec.generation import (
    END,
    Continue,
    GenerationStatus,
    MoveSequences,
    NextLook,
    ReplicaStatus,
    SequenceRecord,
)
from nereus.spec.run import MidstepSpec

KV_TOKEN = 256  # 2 (K, V) x 2 layers x 2 KV heads x 8 head width x 4 bytes


def status(reps: list[ReplicaStatus], lengths: list[int], slots: int, limit: int,
           point: str = "look") -> GenerationStatus:
    """The status a backend would show, every record's forecast from the run's ``lengths`` so far."""
    cal = EngineCalibration()
    cal.observe_lengths(lengths)
    guess = cal.forecasts((s.generated for r in reps for s in r.active + r.queued), limit)
    reps = [replace(r, active=tuple(replace(s, forecast=guess[s.generated]) for s in r.active),
                    queued=tuple(replace(s, forecast=guess[s.generated]) for s in r.queued)) for r in reps]
    return GenerationStatus(3, "actor/generation", point, 7, slots, limit, tuple(reps), kv_token_bytes=KV_TOKEN)


def running(i: int, replica: int, generated: int) -> SequenceRecord:
    return SequenceRecord(i, replica, 4, generated, 4 + generated - 1, 16)  # caught up


def queued(i: int, replica: int, prompt: int = 4) -> SequenceRecord:
    return SequenceRecord(i, replica, prompt, 0, 0, 16)


def test_rule_moves_the_tail_only_when_it_pays():
    donor = ReplicaStatus(0, (running(0, 0, 1), running(1, 0, 1)), (queued(2, 0), queued(3, 0)))
    receiver = ReplicaStatus(1, (), ())
    st = status([donor, receiver], [20] * 8, slots=2, limit=32)  # the run's responses so far: 20 tokens each
    rule = BalanceTail(MidstepSpec(trigger=1.0, margin=0.0, calibrate=False, transfer="kv"))
    d = rule.during_generation(st)
    assert isinstance(d, MoveSequences) and d.donor == 0 and d.receiver == 1 and d.gain_s > 0
    assert [m.seq.id for m in d.moves] == [3, 2] and d.queued == 2 and d.bytes == 0  # the queue's back first
    assert d.look == NextLook(iterations=rule.spec.chunk)  # the status is stale after a move
    # the same state under the default margin: the gain (in the 1 ms prior per row) is under 1.5 x 50 ms,
    # so the move is declined, recorded with its numbers
    lazy = BalanceTail(MidstepSpec(trigger=1.0, calibrate=False))
    d = lazy.during_generation(st)
    assert isinstance(d, Continue) and d.recorded and "<=" in d.reason and d.declined.gain_s > 0
    # nobody under the trigger: no decision to record
    busy = ReplicaStatus(1, (running(5, 1, 1),), ())
    d = BalanceTail(MidstepSpec(trigger=0.1, calibrate=False)).during_generation(status([donor, busy], [20] * 8, 2, 32))
    assert isinstance(d, Continue) and not d.recorded


def test_running_sequences_send_caches_or_are_refilled():
    donor = ReplicaStatus(0, (running(0, 0, 6), running(1, 0, 1)), ())
    receiver = ReplicaStatus(1, (), ())
    st = status([donor, receiver], [30] * 8, slots=2, limit=32)
    kv = BalanceTail(MidstepSpec(trigger=1.0, margin=0.0, calibrate=False, transfer="kv")).during_generation(st)
    assert isinstance(kv, MoveSequences) and kv.kv == len(kv.moves) >= 1 and kv.refills == 0
    assert kv.bytes == sum(KV_TOKEN * m.seq.cached for m in kv.moves)
    forced = BalanceTail(MidstepSpec(trigger=1.0, margin=0.0, calibrate=False, transfer="refill"), force=True)
    d = forced.during_generation(st)
    assert isinstance(d, MoveSequences) and d.refills == len(d.moves) >= 1 and d.bytes == 0


def test_looks_sized_from_the_forecast():
    # the forecast: the mean of the run's lengths above what a sequence has generated, within (g, limit]
    reps = [ReplicaStatus(0, (SequenceRecord(0, 0, 4, 4, 7, 16),), (queued(1, 0),)),
            ReplicaStatus(1, (SequenceRecord(2, 1, 4, 10, 13, 16),), ())]
    assert final_lengths(status(reps, [3, 5, 10], slots=2, limit=12)) == {0: 8, 1: 6, 2: 11}
    # slots 4, trigger 0.5: a replica receives under 2 unfinished; every sequence forecast at 4 tokens.
    # Replica 0 (6 queued) keeps 2 after iteration 4, none after 8; replica 1 (2 queued) none after 4:
    # the first look comes after 4 iterations, whatever the chunk
    rule = BalanceTail(MidstepSpec(trigger=0.5, margin=0.0, chunk=1, calibrate=False))
    reps = [ReplicaStatus(0, (), tuple(queued(i, 0, 3) for i in range(6))),
            ReplicaStatus(1, (), tuple(queued(i, 1, 3) for i in range(6, 8)))]
    start = status(reps, [4] * 8, slots=4, limit=8, point="start")
    assert rule.during_generation(start) == Continue(look=NextLook(iterations=4))
    # one replica under the trigger: a look every ``chunk`` iterations while a move may pay
    drained = [ReplicaStatus(0, tuple(SequenceRecord(i, 0, 3, 1, 3, 16) for i in range(2)),
                             tuple(queued(i, 0, 3) for i in range(2, 6))), ReplicaStatus(1, (), ())]
    assert rule.next_look(status(drained, [4] * 8, 4, 8), [1e-3, 1e-3]) == NextLook(iterations=1)
    # the default margin: even the perfect split (1 ms a row) gains less than 1.5 x a move's 50 ms: no more looks
    lazy = BalanceTail(MidstepSpec(trigger=0.5, chunk=1, calibrate=False))
    assert lazy.next_look(status(drained, [4] * 8, 4, 8), [1e-3, 1e-3]) == END
    # no replica holds two unfinished sequences: no donor ever again
    alone = [ReplicaStatus(0, (SequenceRecord(0, 0, 3, 1, 3, 16),), ()), ReplicaStatus(1, (), ())]
    assert rule.next_look(status(alone, [4] * 8, 4, 8), None) == END

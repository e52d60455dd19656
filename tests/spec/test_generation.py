"""The typed values inside the generation stage (spec.generation): every decision kind and a record entry
round-trip through JSON, kinds are registered by name, bad values name themselves."""

from __future__ import annotations

import json

import pytest

from nereus.spec.generation import (
    DECISION_KINDS,
    END,
    CarryOver,
    ChangeTailLayout,
    Continue,
    DeferSequences,
    GenerationEntry,
    GenerationStatus,
    MoveSequences,
    NextLook,
    Outcome,
    ReplicaStatus,
    SequenceMove,
    SequenceRecord,
    SetSpeculation,
    TailPhase,
    decision_from_json,
)
from nereus.spec.levers import Speculation


def _json(value: dict) -> dict:
    return json.loads(json.dumps(value))


def test_every_decision_kind_round_trips_through_json():
    a, b = SequenceRecord(4, 1, 10, 3, 12, 5000, 6.5), SequenceRecord(9, 1, 10, 0, 0, 5000)
    move = MoveSequences(moves=(SequenceMove(a, 0), SequenceMove(b, 0, refill=True)), gain_s=0.2, cost_s=0.05,
                         bytes=3072, reason="pays", look=NextLook(iterations=4))
    decisions = [Continue(), Continue(look=NextLook(live_at_most=32), reason="wait"),
                 Continue(look=END, declined=move, reason="gain <= margin x cost"), move,
                 ChangeTailLayout(phase=TailPhase(16, 4, 2, True, "send", "nereus", {"gain_s": 1.0}), gain_s=1.0),
                 SetSpeculation(speculation=Speculation("suffix", 4, 16), gain_s=2.0),
                 DeferSequences(groups=3), CarryOver(sequences=7)]
    assert set(DECISION_KINDS) == {d.kind for d in decisions}
    for d in decisions:
        back = decision_from_json(_json(d.to_json()))
        assert back == d and type(back) is type(d)
    assert move.donor == 1 and move.receiver == 0 and (move.kv, move.refills, move.queued) == (1, 1, 0)
    assert move.recorded and decisions[2].recorded and not decisions[0].recorded
    with pytest.raises(ValueError, match="unknown generation decision kind 'teleport'; known: continue"):
        decision_from_json({"kind": "teleport"})


def test_a_record_entry_round_trips():
    d = ChangeTailLayout(phase=TailPhase(8, 2, 1), gain_s=0.5, cost_s=0.1, reason="tail")
    entry = GenerationEntry(5, "actor/generation", 120, 8, d, Outcome(True, "", 0.12, 0.4, {"kv_sent": 8.0}), 1e-3)
    assert GenerationEntry.from_json(_json(entry.to_json())) == entry
    assert entry.to_json()["action"] == "generation"


def test_status_and_looks_validate():
    rep = ReplicaStatus(0, (SequenceRecord(0, 0, 4, 2, 5),), (SequenceRecord(1, 0, 4, 0, 0),))
    st = GenerationStatus(0, "actor/generation", "look", 3, 2, 8, (rep,))
    assert st.live == 1 and rep.unfinished == 2 and rep.active[0].context == 6
    with pytest.raises(ValueError, match="point"):
        GenerationStatus(0, "actor/generation", "middle", 3, 2, 8, (rep,))
    with pytest.raises(ValueError, match="not both"):
        NextLook(iterations=2, live_at_most=3)
    with pytest.raises(ValueError, match=">= 0"):
        NextLook(iterations=-1)
    assert END.none and not NextLook(iterations=1).none

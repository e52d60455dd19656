"""The typed transition plan: every step and piece class is registered, and a real plan with every step
kind round-trips through JSON to an equal plan that schedules and verifies alike."""

from __future__ import annotations

import json
import sys

import pytest

from nereus.cost.hardware import Hardware
from nereus.elastic.graph import TransitionOptions, build_graph
from nereus.elastic.plan import (
    KV_PIECE_KINDS,
    KV_STEP_KINDS,
    PIECE_KINDS,
    STEP_KINDS,
    BufferStep,
    Delta,
    Piece,
    Send,
    SentPiece,
    StatePart,
    Step,
    TransitionPlan,
)
from nereus.elastic.schedule import schedule_graph
from nereus.elastic.verify import verify_transition
from tests.elastic.helpers import plan, tiny_job

ABSTRACT = {Step, BufferStep, Piece}


def _subclasses(cls: type) -> list[type]:
    """Every class below ``cls`` that its module defines. ``dataclass(slots=True)`` replaces the class it
    decorates, and the replaced one stays among the subclasses (the frozen ``__setattr__`` refers to it)."""
    out = []
    for sub in cls.__subclasses__():
        if getattr(sys.modules[sub.__module__], sub.__name__, None) is sub:
            out.append(sub)
        out += _subclasses(sub)
    return out


@pytest.mark.parametrize("base,registry", [(Step, STEP_KINDS), (Piece, PIECE_KINDS)])
def test_every_step_and_piece_class_is_registered_under_its_own_kind(base, registry):
    concrete = [c for c in _subclasses(base) if c not in ABSTRACT]
    assert concrete
    for cls in concrete:
        assert registry.get(cls.kind) is cls, f"{cls.__name__} (kind {cls.kind!r}) is not in the registry"
    assert len(registry) == len(concrete)


@pytest.fixture(scope="module")
def every_kind():
    """Weights that must go through host memory (old and new do not fit together) beside a training model
    whose layout changes (gradient buffers freed early and allocated after the commit)."""
    old = plan([("actor/inference", {"tp": 1, "dp": 4}, range(4)), ("critic/training", {"tp": 1, "dp": 2}, [0, 1])],
               4)
    new = plan([("actor/inference", {"tp": 2, "pp": 2, "dp": 1}, range(4)),
                ("critic/training", {"tp": 2, "dp": 1}, [0, 1])], 4)
    probe = build_graph(tiny_job(nodes=1, gpus_per_node=4), old, new)
    job = tiny_job(nodes=1, gpus_per_node=4, memory_gb=1.1 * max(probe.old_bytes) / 0.9 / 1e9)
    hw = Hardware(job.cluster)
    graph = build_graph(job, old, new, hw, TransitionOptions(chunk_bytes=256))
    return job, old, new, hw, graph


def test_a_plan_with_every_step_kind_round_trips_through_json(every_kind):
    job, old, new, hw, graph = every_kind
    # every kind but a live migration's (tests/runtime/engines/native/test_kv_migration.py round-trips those)
    assert set(graph.count()) == set(STEP_KINDS) - set(KV_STEP_KINDS)
    assert {p.kind for s in graph.steps for p in s.all_pieces()} == set(PIECE_KINDS) - set(KV_PIECE_KINDS)
    text = json.dumps(graph.to_json())
    back = TransitionPlan.from_json(json.loads(text))
    assert back == graph
    assert [type(s) for s in back.steps] == [type(s) for s in graph.steps]
    assert (back.commit, back.bytes_sent, back.detour_bytes) == (graph.commit, graph.bytes_sent, graph.detour_bytes)
    assert back.detour_bytes > 0 and back.detours == graph.detours
    sched = schedule_graph(back, hw)
    assert sched.makespan_s == schedule_graph(graph, hw).makespan_s
    assert verify_transition(job, old, new, back, sched, hw) == []


def test_from_json_refuses_another_format_unknown_kinds_and_misnumbered_steps(every_kind):
    *_, graph = every_kind
    data = graph.to_json()
    with pytest.raises(ValueError, match="format"):
        TransitionPlan.from_json({**data, "format": "nereus.transition-plan/1"})
    with pytest.raises(ValueError, match="unknown kind 'reshard'"):
        TransitionPlan.from_json({**data, "steps": [{**data["steps"][0], "kind": "reshard"}, *data["steps"][1:]]})
    with pytest.raises(ValueError, match="steps: ids"):
        TransitionPlan.from_json({**data, "steps": data["steps"][1:]})


def test_send_stages_at_both_ends_unless_it_reads_host_memory():
    parts = (StatePart("actor", "weights", (SentPiece(0, (((0, 4),),), (((0, 8),),)),)),)
    direct = Send(id=0, deps=(), src=1, dst=2, bytes=64, parts=parts, from_host=False, chunks=1, staging=64)
    assert direct.memory().at_start == (Delta(2, 64), Delta(1, 64))
    assert direct.memory().at_end == (Delta(2, -64), Delta(1, -64))
    hosted = Send(id=0, deps=(), src=1, dst=2, bytes=64, parts=parts, from_host=True, chunks=1, staging=64)
    assert hosted.memory().at_start == (Delta(2, 64),) and direct.model == "actor" and direct.state == "weights"

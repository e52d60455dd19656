"""Adaptation inside the step in the simulator: sequence-level generation, phased generation with KV moves,
the controller's per-step decision through the generation protocol, and the policies that use them."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from nereus.cost.batching import Factors, run_replicas, step_table
from nereus.cost.decode_events import generation_time
from nereus.cost.generation import GenModel, no_move, run_bulk, with_tail
from nereus.cost.hardware import Hardware
from nereus.cost.plan_cost import estimate_plan
from nereus.elastic.plan import Commit, KVFree, KVPiece, KVSend
from nereus.elastic.tail_plan import tail_migration_plan
from nereus.planner.search import search
from nereus.sim.run import simulate
from nereus.spec import load_job
from nereus.spec.errors import SpecError
from nereus.spec.generation import ChangeTailLayout, GenerationEntry, TailPhase
from nereus.spec.job import ResponseLength
from nereus.spec.layout import Plan
from nereus.spec.trace import load_trace

ROOT = Path(__file__).resolve().parents[2]


@lru_cache(maxsize=1)
def _setup():
    job = load_job(ROOT / "examples" / "ppo_8b_h100.yaml")
    job = job.with_response(ResponseLength(3000, 20480, "lognormal", 1.0))
    hw = Hardware(job.cluster)
    plan = search(hw, job, None).plan
    return job, hw, plan, GenModel.of(hw, job, plan, estimate_plan(hw, job, plan))


def _lengths(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.minimum(rng.lognormal(math.log(3000) - 0.5, 1.0, n), 20480)


def test_replica_matches_the_decode_models_event_simulation():
    """Token-bucketed continuous batching against cost.decode_events.generation_time's exact event simulation on
    the same replica, lengths and batch (queue, refills and drain included)."""
    job, hw, _, _ = _setup()
    table = step_table(hw, job.models["actor"], 4, 2)
    lengths = np.round(_lengths(96, 1)).astype(int)
    exact = generation_time(table.replica, 1024, lengths.tolist(), 32)
    run = run_replicas(table, [(lengths.astype(float), np.full(96, 1024.0), 96 * 1024.0, 1024.0)], 32, 4,
                       Factors())[0]
    assert run.end_s == pytest.approx(exact.total_s, rel=0.05)
    # slots refill: the 33rd sequence starts when the first one ends, never more than 32 in flight
    assert (run.start_s[32:] > run.prefill_s).all()
    events = sorted([(t, 1) for t in run.start_s] + [(t, -1) for t in run.finish_s], key=lambda e: (e[0], e[1]))
    assert max(np.cumsum([d for _, d in events])) <= 32


def test_phases_round_trip_through_json_with_the_plan():
    _, _, plan, _ = _setup()
    phase = TailPhase(32, 8, 2, True, "cheaper", "nereus", {"gain_s": 1.5})
    p = replace(plan, generation=phase, weight_sync="hybrid-reshard")
    back = Plan.from_dict(json.loads(json.dumps(p.to_dict())))
    assert back == plan and back.generation == phase and back.generation.predicted == {"gain_s": 1.5}
    assert back.strategy == plan.strategy != "" and back.weight_sync == "hybrid-reshard"
    assert "generation_phases" not in plan.to_dict()  # a plan without phases stays its placements
    with pytest.raises(SpecError, match=r"plan\.generation_phases\.format"):
        Plan.from_dict({**p.to_dict(), "generation_phases": {**phase.to_dict(), "format": "x"}})
    with pytest.raises(SpecError, match=r"plan\.weight_sync"):
        Plan.from_dict({**p.to_dict(), "weight_sync": "telepathy"})
    with pytest.raises(ValueError, match="kv"):
        TailPhase(1, 8, 1, kv="teleport")


def test_tail_switch_moves_every_unfinished_sequence_and_the_kv_plan_matches_its_bytes():
    job, hw, _, model = _setup()
    bulk = run_bulk(model, _lengths(job.sequences_per_step(), 2), Factors())
    phase = TailPhase(64, 8, 4, True, "send")
    out = with_tail(model, bulk, phase, Factors())
    assert out.moved and out.unfinished >= 1 and out.kv_sent == out.unfinished
    assert out.migration_s > 0 and out.generation_s < no_move(model, bulk).generation_s
    mig = tail_migration_plan(model, bulk, phase)
    assert json.loads(json.dumps(mig.to_json())) == mig.to_json()
    assert type(mig).from_json(mig.to_json()) == mig
    # every byte the model prices is a KV piece of the plan (TP 4 -> 8 splits each rank's heads in two); the
    # model prices pieces a rank keeps (same GPU in both layouts) as transfers too: an upper bound
    assert sum(s.bytes for s in mig.sends()) == pytest.approx(out.bytes_sent)
    assert mig.bytes_sent <= out.bytes_sent
    commit = mig.commit
    assert all(commit in s.deps for s in mig.steps if isinstance(s, KVFree))
    assert all(s.id < commit for s in mig.steps if isinstance(s, KVSend))
    assert isinstance(mig.steps[commit], Commit)


def test_a_move_that_would_overfill_a_device_is_refused():
    """One TP-1 replica taking hundreds of unfinished sequences cannot hold their caches: refused, and the
    stage runs as without a move."""
    job, hw, _, model = _setup()
    bulk = run_bulk(model, _lengths(job.sequences_per_step(), 3), Factors())
    out = with_tail(model, bulk, TailPhase(600, 1, 1, False, "send"), Factors())
    assert not out.moved and "GB" in out.refused and out.move_peak_bytes > hw.usable_bytes()
    assert out.generation_s == no_move(model, bulk).generation_s


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), trigger=st.integers(1, 600), tp=st.sampled_from([1, 2, 4, 8]),
       replicas=st.sampled_from([1, 2, 4, 8]), kv=st.sampled_from(["cheaper", "send", "recompute"]))
def test_property_mid_step_moves_never_exceed_memory(seed, trigger, tp, replicas, kv):
    job, hw, _, model = _setup()
    bulk = run_bulk(model, _lengths(job.sequences_per_step(), seed), Factors())
    out = with_tail(model, bulk, TailPhase(trigger, tp, replicas, True, kv), Factors())
    if out.moved:
        assert out.move_peak_bytes <= hw.usable_bytes()
        assert out.kv_sent + out.recomputed <= out.unfinished  # the rest kept their caches in place
        assert out.generation_s >= out.bulk_s + out.migration_s
    else:
        assert out.refused or out.unfinished == 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), tp=st.sampled_from([4, 8]), replicas=st.sampled_from([1, 2, 4]),
       trigger=st.integers(4, 200))
@example(seed=41182, tp=4, replicas=1, trigger=4)
@example(seed=139, tp=4, replicas=1, trigger=4)
def test_property_kv_pieces_cover_each_destination_shard_exactly_once(seed, tp, replicas, trigger):
    job, _, _, model = _setup()
    arch = job.models["actor"]
    bulk = run_bulk(model, _lengths(job.sequences_per_step(), seed), Factors())
    mig = tail_migration_plan(model, bulk, TailPhase(trigger, tp, replicas, kv="send"))
    area: dict[tuple[int, int], int] = {}
    for s in mig.sends():
        for part in s.parts:
            for piece in part.pieces:
                if isinstance(piece, KVPiece):
                    key = (s.dst, piece.seq)
                    size = (piece.layers[1] - piece.layers[0]) * (piece.heads[1] - piece.heads[0])
                    area[key] = area.get(key, 0) + size
    per_rank = arch.layers * max(1, arch.kv_heads // tp)
    # every sequence sent arrives whole; KV bytes cross ranks only where a send carries KV pieces to another
    # rank (a cache already on its tail rank is a local copy, and a sequence's record alone weighs no KV:
    # seeds 41182 and 139, TP 4, one replica, trigger 4, found by hypothesis)
    kv_crossing = [s for s in mig.sends()
                   if s.src != s.dst and any(isinstance(p, KVPiece) for part in s.parts for p in part.pieces)]
    assert set(area.values()) <= {per_rank} and bool(kv_crossing) == (mig.bytes_sent > 0)


def test_controller_calibrates_the_move_cost_and_logs_every_decision():
    """nereus (tail layouts only) on the DAPO long-tail trace: every planned move is in the run record with
    its predicted and realised gain; after the transfer cost is calibrated on measured moves, realised migration cost is
    within 20% of the prediction."""
    job = load_job(ROOT / "examples" / "ppo_8b_h100.yaml")
    record = simulate(job, load_trace(ROOT / "traces" / "long_tail_dapo.yaml"), "nereus-tail", seed=1, steps=45)
    moves = [GenerationEntry.from_json(json.loads(json.dumps(d))) for d in record.generation_decisions]
    assert moves and all(isinstance(e.decision, ChangeTailLayout) and e.outcome.gain_s is not None for e in moves)
    assert all(e.decision.gain_s == e.decision.phase.predicted["gain_s"] for e in moves)
    calibrated = [e for e in moves[20:] if e.outcome.applied
                  and e.decision.phase.predicted.get("transfer_factor", 1.0) != 1.0]
    assert calibrated
    errors = [abs(e.outcome.cost_s / e.outcome.figures["predicted_migration_s"] - 1) for e in calibrated]
    assert sum(errors) / len(errors) <= 0.2
    assert record.generation_summary()["moved"] == sum(e.outcome.applied for e in moves)
    assert min(e.step for e in moves) >= 5  # no move before the first calibration fit


def test_policies_run_and_intrastep_ones_move_inside_the_step():
    job = load_job(ROOT / "examples" / "ppo_8b_h100.yaml")
    trace = load_trace(ROOT / "traces" / "long_tail_dapo.yaml")
    for policy in ("nereus-interstep", "pat-like", "rlhfuse-like"):
        record = simulate(job, trace, policy, seed=0, steps=6)
        moved = record.generation_summary()["moved"]
        assert (moved > 0) == (policy != "nereus-interstep"), policy
        assert all(s["generation"]["bulk_s"] > 0 for s in record.steps)


def test_step_timeline_shows_bulk_migration_tail_and_overlapped_inference(tmp_path):
    from nereus.sim.run import simulate_with_backend
    from nereus.sim.step_timeline import chrome_trace, plot, step_rows

    job = load_job(ROOT / "examples" / "ppo_8b_h100.yaml")
    # the first fit after step 4, moves from step 5
    record, backend = simulate_with_backend(job, load_trace(ROOT / "traces" / "long_tail_dapo.yaml"),
                                            "nereus-tail", seed=0, steps=7)
    rows = step_rows(backend.last_generation)
    kinds = {kind for _, kind, _, _ in rows}
    assert {"bulk", "migration", "tail", "inference (overlapped)", "training"} <= kinds
    # the step ends when its last phase does: the rows span the measured step time
    assert max(b for *_, b in rows) == pytest.approx(record.steps[-1]["step_time_s"], rel=1e-6)
    trace = json.loads(json.dumps(chrome_trace(rows, "step")))
    assert {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"} == kinds - {"idle"}
    plot(rows, "step", tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 0

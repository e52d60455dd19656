"""The fault model's draws and the two recovery mechanisms' replays, on small synthetic timelines."""

from __future__ import annotations

import pytest

from nereus.sim.fault_replay import (
    LiveRecovery,
    RestartRecovery,
    StepTimeline,
    replay_live,
    replay_restart,
)
from nereus.sim.faults import (
    NODE_LOSS,
    ROLLOUT_CRASH,
    STRAGGLER,
    TRANSITION_CRASH,
    WEIGHT_SYNC_CRASH,
    FaultEvent,
    FaultModel,
    draw_faults,
    llama3_gpu_hours_per_failure,
)

PHASES = (("generation", 6.0), ("inference", 1.0), ("training", 2.0), ("weight_sync", 1.0))  # a 10 s step
LIVE = LiveRecovery(detect_process_s=0.0, detect_node_s=50.0, reform_s=0.1, restore_s=0.5, comm_init_s=2.0,
                    reshard_s=1.0, regrow_s=1.0, snapshot_s=0.0, spare_s=1e9, checkpoint_every=10**6)
RESTART = RestartRecovery(detect_process_s=0.0, detect_node_s=50.0, relaunch_s=300.0, load_s=20.0,
                          checkpoint_every=5, checkpoint_s=0.0)


def timeline(steps: int = 20, transition_after: int | None = None) -> StepTimeline:
    transitions = tuple(3.0 if i == transition_after else 0.0 for i in range(steps))
    return StepTimeline((PHASES,) * steps, transitions, samples_per_step=64, nodes=16)


def accounted(r) -> float:
    return r.productive_s + r.overhead_s + sum(r.lost_s.values())


def test_draws_are_seeded_and_the_count_scales_with_the_fraction():
    model = FaultModel(0.5)
    a = draw_faults(model, nodes=1000, run_s=3600.0, horizon_s=3600.0, seed=3)
    assert a == draw_faults(model, nodes=1000, run_s=3600.0, horizon_s=3600.0, seed=3)
    assert a != draw_faults(model, nodes=1000, run_s=3600.0, horizon_s=3600.0, seed=4)
    assert 0.85 * 500 < len(a) < 1.15 * 500  # 50% of 1,000 machines over the run
    counts = [len(draw_faults(FaultModel(f), 128, 3600.0, 3600.0, seed=0)) for f in (0.0, 0.05, 0.1, 0.2, 0.4)]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] > counts[2] > 0
    shares = {e: sum(f.effect == e for f in a) / len(a) for e in ("process", "node", "partition", "straggler")}
    for effect, share in model.shares().items():
        assert shares[effect] == pytest.approx(share, abs=0.06)


def test_the_rate_is_quoted_against_llama_3():
    assert llama3_gpu_hours_per_failure() == pytest.approx(16384 * 54 * 24 / 419)
    assert sum(FaultModel(0.1).shares().values()) == pytest.approx(1.0)
    assert FaultModel(0.1).gpu_hours_per_failure(1024, 128, 3600.0) == pytest.approx(1024 / (12.8 / 3600) / 3600)
    with pytest.raises(ValueError, match="failure_fraction"):
        FaultModel(-0.1)


def test_restart_loses_the_steps_since_the_last_checkpoint():
    tl = timeline()
    r = replay_restart(tl, (FaultEvent(72.0, "process"),), RESTART)  # step 7 in flight, checkpoint after step 5
    assert r.failures == {ROLLOUT_CRASH: 1}
    assert r.steps_lost == 3 and r.samples_lost == 3 * 64  # steps 5 and 6, and 7 in flight
    assert r.wall_s == pytest.approx(tl.productive_s + 20.0 + 2.0 + 300.0 + 20.0)
    assert r.wall_s == pytest.approx(accounted(r))


def test_nereus_loses_at_most_the_step_in_flight():
    tl = timeline()
    r = replay_live(tl, (FaultEvent(72.0, "process"),), LIVE)
    assert r.failures == {ROLLOUT_CRASH: 1} and r.steps_lost == 1 and r.samples_lost == 64
    on_survivors = 13 * 10.0 * (16 / 15 - 1)  # steps 7..19 on 15 of 16 nodes (no replacement comes)
    assert r.wall_s == pytest.approx(tl.productive_s + 2.0 + LIVE.recover_s() + on_survivors)
    assert r.wall_s == pytest.approx(accounted(r))
    faults = draw_faults(FaultModel(2.0), nodes=16, run_s=tl.productive_s, horizon_s=10 * tl.productive_s, seed=1)
    many = replay_live(tl, faults, LIVE)
    fail_stops = many.failure_count - many.failures.get(STRAGGLER, 0)
    assert fail_stops > 3 and many.steps_lost <= fail_stops
    assert many.wall_s == pytest.approx(accounted(many))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ettr_is_a_fraction_and_live_recovery_beats_restart(seed: int):
    tl = timeline(200)
    faults = draw_faults(FaultModel(0.5), nodes=16, run_s=tl.productive_s, horizon_s=50 * tl.productive_s,
                         seed=seed)
    live, restart = replay_live(tl, faults, LIVE), replay_restart(tl, faults, RESTART)
    assert 0.0 < restart.ettr < live.ettr <= 1.0
    assert restart.wall_s == pytest.approx(accounted(restart))
    assert replay_live(tl, (), LIVE).ettr == pytest.approx(1.0)


def test_a_kinds_recovery_cost_is_applied():
    tl = timeline()
    process = replay_live(tl, (FaultEvent(72.0, "process"),), LIVE)
    node = replay_live(tl, (FaultEvent(72.0, "node"),), LIVE)
    assert node.failures == {NODE_LOSS: 1}
    assert node.wall_s - process.wall_s == pytest.approx(LIVE.detect_node_s - LIVE.detect_process_s, rel=1e-3)
    sync = replay_live(tl, (FaultEvent(79.5, "process"),), LIVE)  # the last second of step 7 sends weights
    assert sync.failures == {WEIGHT_SYNC_CRASH: 1}


def test_a_crash_during_a_transition_keeps_the_finished_step():
    tl = timeline(transition_after=7)
    r = replay_live(tl, (FaultEvent(81.0, "process"),), LIVE)  # step 7 ended at 80 s; its transition runs
    assert r.failures == {TRANSITION_CRASH: 1} and r.steps_lost == 0
    assert r.wall_s == pytest.approx(accounted(r))


def test_a_straggler_slows_steps_until_it_is_spotted():
    tl = timeline(100)
    fault = (FaultEvent(50.0, "straggler"),)
    live = replay_live(tl, fault, LIVE, straggler_slowdown=2.0, straggler_spot_s=100.0)
    restart = replay_restart(tl, fault, RESTART, straggler_slowdown=2.0, straggler_spot_s=100.0)
    assert live.failures == restart.failures == {STRAGGLER: 1}
    assert live.steps_lost == 0 and 0 < live.lost_s[STRAGGLER] < 120.0  # ~5 slow steps and the re-plan
    assert restart.lost_s[STRAGGLER] > RESTART.relaunch_s  # killed and restarted from its checkpoint
    assert live.wall_s == pytest.approx(accounted(live)) and restart.wall_s == pytest.approx(accounted(restart))


def test_a_simulated_record_becomes_a_timeline_in_step_order():
    from nereus.control.record import RunRecord
    from nereus.sim.fault_costs import timeline_from_record

    record = RunRecord("nereus", "job", "trace", 0)
    record.steps = [{"step_time_s": 10.0, "transition_s": 0.5,
                     "phases": {"training": 2.0, "generation": 6.0, "weight_sync": 1.0, "inference": 1.0}},
                    {"step_time_s": 5.0, "transition_s": 0.0, "phases": {"generation": 8.0, "training": 2.0}}]
    tl = timeline_from_record(record, samples_per_step=8, nodes=2)
    assert [name for name, _ in tl.phases[0]] == ["generation", "inference", "training", "weight_sync"]
    assert tl.step_s(0) == pytest.approx(10.0) and tl.step_s(1) == pytest.approx(5.0)  # overlap shares the step
    assert tl.transition_s == (0.5, 0.0) and tl.productive_s == pytest.approx(15.0)

"""Partial rollout in the simulator: responses carried across steps, every trained token at most one step
old, the policy lag recorded per step; the controller picks it only when run.policy_lag allows."""

import numpy as np
import pytest

from nereus.sim.carry import CarriedResponses, plan_round
from nereus.sim.run import run_policy_lag, simulate
from tests.control.test_controller import small_job, trace


def test_a_round_cuts_new_responses_at_the_budget_and_finishes_the_carried_ones():
    carried = CarriedResponses(np.array([300.0, 50.0]), np.array([1000.0, 1000.0]))
    rnd = plan_round(np.array([200.0, 1500.0, 999.0]), carried, 100.0, 1000)
    assert rnd.lengths.tolist() == [300.0, 50.0, 200.0, 1000.0, 999.0]
    assert rnd.contexts.tolist() == [1100.0, 1100.0, 100.0, 100.0, 100.0] and rnd.carried_in == 2
    assert sorted(rnd.trained_lengths.tolist()) == [200.0, 999.0, 1050.0, 1300.0]
    assert rnd.carried_out.remaining.tolist() == [500.0] and rnd.carried_out.generated.tolist() == [1000.0]
    share = 2000.0 / (200 + 999 + 1050 + 1300)
    assert rnd.policy_lag == pytest.approx((1 - share, share))
    off = plan_round(np.array([200.0, 1500.0]), CarriedResponses.none(), 100.0, None)
    assert off.policy_lag == (1.0,) and len(off.carried_out) == 0 and off.trained == 2


def test_lag_one_runs_partial_rollout_and_records_each_steps_lag():
    job, tr = small_job(16), trace(12)
    assert run_policy_lag(job, tr) == 0 and run_policy_lag(job, tr, 1) == 1
    strict = simulate(job, tr, "nereus", seed=0, steps=12)
    lagged = simulate(job, tr, "nereus", seed=0, steps=12, policy_lag=1)
    assert strict.summary()["policy_lag_max"] == 0
    s = lagged.summary()
    assert s["policy_lag_max"] == 1 and all(len(st["policy_lag"]) <= 2 for st in lagged.steps)
    assert s["on_policy_share"] < 1.0 and strict.summary()["on_policy_share"] == 1.0
    april = simulate(job, tr, "april-like", seed=0, steps=12)
    assert 0 < april.summary()["policy_lag_mean"] < 1 and april.summary()["policy_lag_max"] == 1


def test_verl_async_like_runs_one_step_off_on_two_pools():
    record = simulate(small_job(16), trace(8), "verl-async-like", seed=0, steps=8)
    plan = record.plans[0]["plan"]
    rollout = next(set(p["gpus"]) for p in plan["placements"] if p["model_stage"] == "actor/generation")
    others = [set(p["gpus"]) for p in plan["placements"] if p["model_stage"] != "actor/generation"]
    assert len(rollout) == 8 and all(not rollout & o for o in others)
    assert all(s["policy_lag"] == [0.0, 1.0] for s in record.steps)
    for s in record.steps:  # the slower pool plus the weight sync
        ph = s["phases"]
        assert s["step_time_s"] == pytest.approx(max(ph["generation"], ph["inference"] + ph["training"])
                                                 + ph["weight_sync"])
